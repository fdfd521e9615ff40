"""`diff_reports(a, b)`: two Reports in, one `RunDiff` out (A the baseline, B the candidate).

It reads the Reports only (their steps, units, collectives, memory, findings, configuration
and operator tables), so two runs of 1000 ranks compare from their stored summaries or saved
`--json` reports without any trace being read again. `NotComparable` says, in one sentence,
why two runs do not compare (attribution.refusal); `allow_incomparable` turns it into a warning.
"""

from __future__ import annotations

from zdiag import __version__

from ..report import Report
from .attribution import comparability_warnings, configs, headline, refusal
from .model import RunDiff
from .operator_changes import has_operators, operator_changes
from .sections import (
    collective_deltas,
    config_changes,
    dimensions,
    finding_changes,
    group_deltas,
    idle_causes,
    memory_deltas,
    rank_deltas,
    run_deltas,
    shares,
    steps_per_rank,
    unit_deltas,
)


class NotComparable(ValueError):
    """Two runs that do not compare; the message is the one sentence saying why."""


def diff_reports(
    a: Report,
    b: Report,
    *,
    baseline: str = "A",
    candidate: str = "B",
    allow_incomparable: bool = False,
) -> RunDiff:
    """The diff of two analyzed runs (see the module docstring)."""
    for label, report in (("A", a), ("B", b)):
        if steps_per_rank(report) == 0:
            raise NotComparable(
                f"run {label} has no analyzed step, so there is no step time to compare"
            )
    config_a, config_b = configs(a, b)
    recorded = all(
        str((r.run or {}).get("schema", "")).startswith("zdiag.manifest") for r in (a, b)
    )
    why, soft = refusal(config_a, config_b, recorded=recorded)
    warnings = soft + comparability_warnings(a, b, config_a, config_b)
    if why is not None:
        if not allow_incomparable:
            raise NotComparable(why)
        warnings.insert(0, why)
    dims = dimensions(a, b)
    step = run_deltas(a, b, dims)
    ranks = rank_deltas(a, b, dims)
    units = unit_deltas(a, b)
    findings = finding_changes(a, b)
    config = config_changes(config_a, config_b)
    parts = shares(a, b, dims)
    ops, unchanged, complete = operator_changes(a, b)
    if not (has_operators(a) and has_operators(b)):
        warnings.append(
            "a report without an operator table (saved by an older zdiag): operators are not "
            "compared; analyze the run again to compare them"
        )
    diff = RunDiff(
        zdiag_version=__version__,
        baseline=baseline,
        candidate=candidate,
        comparable=why is None,
        warnings=warnings,
        steps_a=steps_per_rank(a),
        steps_b=steps_per_rank(b),
        ranks_a=sorted(r.rank for r in a.ranks),
        ranks_b=sorted(r.rank for r in b.ranks),
        step=step,
        shares=parts,
        idle_causes=idle_causes(a, b),
        ranks=ranks,
        units=units,
        collectives=collective_deltas(a, b),
        groups=group_deltas(a, b),
        memory=memory_deltas(a, b),
        findings=findings,
        config=config,
        operators=ops,
        operators_unchanged=unchanged,
        operators_complete=complete,
    )
    diff.headline = headline(diff.step_time(), parts, units, ranks, findings, config)
    return diff
