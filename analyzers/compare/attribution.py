"""Whether two runs compare, and the one sentence that says where the step-time change went.

Refused (`refusal`): runs on different kinds of device, recorded runs of different world sizes,
runs of different models (the captured model class or parameter count differ), or with no step
on a side. Warned: bare traces of different world sizes, different GPUs, too few steps to tell a
change from noise, different sets of ranks analyzed.

The headline measures, it does not guess: the median step time's change and whether it lies
outside the spread; the breakdown part holding most of the mean change (the parts add up to it);
inside that part, the FSDP unit whose exposed wait grew most, or the rank whose compute grew most
when one rank alone slowed; then what else differs that names a cause: findings raised in B only
(by their ids) and the configuration keys that changed (prefetch, wrap, resharding, ...).
"""

from __future__ import annotations

from typing import Any

from .model import ConfigChange, Delta, FindingChange, RankDelta, Share, UnitDelta
from .sections import config_of, steps_per_rank
from .spread import MIN_STEPS

SLOW_RANK_FACTOR = 3.0
"""A rank's compute change this many times the median rank's (and beyond the spread) names it as
the one rank that slowed."""

UNIT_SHARE = 0.25
"""A unit is named in the headline when its exposed wait moved by this share of the exposed-comm
change or more (a unit holding 1% of it is not where the time went)."""

NOT_FSDP_DIMS = ("(tp)", "(pp)", "(ep)", "(cp)", "(other)")
"""Exposed comm over these dimensions is not the FSDP units' (their collectives shard or
replicate): a unit is not named for it."""

CAUSE_OF_FINDING = {
    "missing-overlap": "all-gathers not prefetched",
    "whole-model-wrap": "whole-model wrap",
    "tiny-layer-wrap": "tiny-layer wrap",
    "straggler": "slow rank",
    "host-sync": "host sync",
    "exposed-comm": "exposed communication",
    "activation-oom": "activation memory",
}
"""Findings whose appearance names a cause, with the words the headline uses."""

CAUSE_KEYS = ("prefetch", "unit", "wrap", "reshard", "checkpoint", "ac", "mesh", "precision")
"""Configuration keys (substrings) that name a cause when they change."""

MAX_CAUSES = 3


def refusal(
    config_a: dict[str, Any], config_b: dict[str, Any], *, recorded: bool = True
) -> tuple[str | None, list[str]]:
    """Why two runs do not compare, in one sentence (None when they do), and the differences
    that only warn. A different world size refuses runs that zdiag recorded (their manifests
    say it); for bare traces it comes from each trace's header, and two traces of different
    jobs are compared as HTA's trace diff compares them, with a warning."""
    warnings = []
    for key, what in (
        ("device", "kinds of device"),
        ("world size", "world sizes"),
        ("model class", "models"),
        ("parameters", "model sizes"),
    ):
        va, vb = config_a.get(key), config_b.get(key)
        if va is None or vb is None or va == vb:
            continue
        if key == "world size" and not recorded:
            warnings.append(
                f"different world sizes in the traces' headers ({va} in A, {vb} in B): "
                "compared rank by rank as given"
            )
            continue
        return f"the runs are not comparable: different {what} ({key} {va} in A, {vb} in B)", []
    return None, warnings


def comparability_warnings(
    a: Any, b: Any, config_a: dict[str, Any], config_b: dict[str, Any]
) -> list[str]:
    """What limits the comparison without refusing it (`a`, `b`: Reports; their configuration
    tables, `configs`)."""
    out = []
    gpu_a, gpu_b = config_a.get("gpu"), config_b.get("gpu")
    if gpu_a and gpu_b and gpu_a != gpu_b:
        out.append(
            f"different GPUs ({gpu_a} in A, {gpu_b} in B): every delta includes the hardware's"
        )
    na, nb = steps_per_rank(a), steps_per_rank(b)
    if min(na, nb) < MIN_STEPS:
        out.append(
            f"too few steps to tell a change from noise ({na} in A, {nb} in B; at least "
            f"{MIN_STEPS} per side): deltas are shown as undetermined"
        )
    ra, rb = {r.rank for r in a.ranks}, {r.rank for r in b.ranks}
    if ra != rb:
        out.append(
            f"different ranks analyzed ({len(ra)} in A, {len(rb)} in B): the per-rank table "
            "shows the ranks in both"
        )
    return out


def _slow_rank(ranks: list[RankDelta], straggler: bool) -> tuple[int, float] | None:
    """The one rank whose compute grew far more than the others', with its change: with the
    straggler finding new in B (it measured the others waiting), or among 3+ ranks (with two,
    one rank's noise is the other's "far more")."""
    if not straggler and len(ranks) < 3:
        return None
    changes = []
    for r in ranks:
        d = next((m for m in r.metrics if m.metric == "compute"), None)
        if d is not None:
            changes.append((r.rank, d))
    if len(changes) < 2:
        return None
    changes.sort(key=lambda x: -x[1].delta)
    rank, top = changes[0]
    rest = sorted(abs(d.delta) for _, d in changes[1:])
    typical = rest[len(rest) // 2]
    if top.change == "up" and top.delta > SLOW_RANK_FACTOR * max(typical, top.spread):
        return rank, top.delta
    return None


def _where(part: Share, units: list[UnitDelta], ranks: list[RankDelta], straggler: bool) -> str:
    """Inside the dominant part: the unit or the rank that moved most."""
    fsdp_part = part.component.startswith("exposed comm") and not any(
        dim in part.component for dim in NOT_FSDP_DIMS
    )
    if fsdp_part and units:
        u = units[0]
        grew = u.exposed_wait_ms_b - u.exposed_wait_ms_a
        if grew * part.delta_ms > 0 and abs(grew) >= UNIT_SHARE * abs(part.delta_ms):
            share = 100 * grew / part.delta_ms
            return f", {share:.0f}% of that waiting on unit `{u.unit or '(root)'}` ({grew:+.1f} ms/step)"
    slow = _slow_rank(ranks, straggler)
    if slow is not None:
        return f", with rank {slow[0]}'s compute {slow[1]:+.1f} ms/step (a slow rank)"
    return ""


def _config_cause(c: ConfigChange) -> str | None:
    key = c.key.lower()
    if not any(word in key for word in CAUSE_KEYS):
        return None
    off = ("none set", "false", "off", "0", "none")
    if "prefetch" in key and (str(c.b).lower() in off or str(c.b).startswith("off")):
        return f"prefetch off in B ({c.key}: {c.a} -> {c.b})"
    return f"{c.key}: {c.a} -> {c.b}"


def causes(findings: list[FindingChange], config: list[ConfigChange]) -> list[str]:
    """The differences that name a cause: new findings, then changed settings."""
    out = [
        f"{f.id} ({CAUSE_OF_FINDING[f.id]}) in B"
        for f in findings
        if f.change == "appeared" and f.id in CAUSE_OF_FINDING
    ]
    out += [c for c in map(_config_cause, config) if c]
    return out[:MAX_CAUSES]


def headline(
    step: Delta | None,
    parts: list[Share],
    units: list[UnitDelta],
    ranks: list[RankDelta],
    findings: list[FindingChange],
    config: list[ConfigChange],
) -> str:
    """The attribution in one sentence (see the module docstring)."""
    cause = causes(findings, config)
    because = f"; differs: {'; '.join(cause)}" if cause else ""
    if step is None:
        return "no step in either run" + because
    pct = f"{step.pct:+.1f}%" if step.pct is not None else "n/a"
    if step.change in ("no change", "undetermined"):
        word = "no change" if step.change == "no change" else "undetermined (too few steps)"
        return (
            f"{word}: median step {step.a:.1f} -> {step.b:.1f} ms ({pct}, spread "
            f"+-{step.spread:.1f} ms){because}"
        )
    direction = [p for p in parts if p.delta_ms * step.delta > 0]
    straggler = any(f.id == "straggler" and f.change == "appeared" for f in findings)
    lead = f"{step.delta:+.1f} ms/step ({pct}, median {step.a:.1f} -> {step.b:.1f} ms)"
    if not direction:
        return lead + because
    top = max(direction, key=lambda p: abs(p.delta_ms))
    return f"{lead}, {100 * top.share:.0f}% of it {top.component}{_where(top, units, ranks, straggler)}{because}"


def configs(a: Any, b: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both runs' configuration tables (sections.config_of)."""
    return config_of(a), config_of(b)
