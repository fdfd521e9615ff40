"""Misconfiguration detectors: pure functions of the analyzed run, returning Findings.

The reduce (analyzers/engine/reduce.py) builds one `DetectorContext` from values (FSDP ledgers per
rank, step tables, detector facts, manifest facts, memory evidence, the cross-rank matching)
and `run_context(ctx)` runs every rule in `RULES`, returning their findings and warnings. A rule
(detectors/rule.py) is a record its module declares: the finding id, what it detects, why it
matters, an example, its thresholds with their reasoning, its scope and its function. A rule is
one module plus one line below. A detector that fails on unexpected input becomes a warning
instead of failing the analysis.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..report import Finding
from . import (
    activation_oom,
    comm_bound,
    crash,
    flat_sharding,
    fp32_collectives,
    fragmentation,
    hang,
    host_sync,
    memory_imbalance,
    missing_overlap,
    no_communication,
    optimizer_state_dominant,
    pipeline_bubble,
    replicate_allreduce,
    step_verdicts,
    straggler,
    tiny_layer_wrap,
    tp_across_nodes,
    whole_model_wrap,
)
from .context import DetectorContext, build_context
from .reconcile import reconcile
from .rule import Rule

RULES: tuple[Rule, ...] = (
    crash.RULE,
    hang.RULE,
    no_communication.RULE,
    whole_model_wrap.RULE,
    tiny_layer_wrap.RULE,
    missing_overlap.RULE,
    activation_oom.RULE,
    optimizer_state_dominant.RULE,
    fragmentation.RULE,
    memory_imbalance.RULE,
    straggler.RULE,
    pipeline_bubble.RULE,
    host_sync.RULE,
    fp32_collectives.RULE,
    flat_sharding.RULE,
    replicate_allreduce.RULE,
    tp_across_nodes.RULE,
    comm_bound.RULE,
    step_verdicts.HOST_BOUND_RULE,
    step_verdicts.EXPOSED_COMM_RULE,
)
"""Every rule, in report order."""

BY_ID: dict[str, Rule] = {r.id: r for r in RULES}
"""Finding id -> its rule."""

STRAGGLER_RULE = straggler.RULE
"""The rule whose thresholds `Report.thresholds` shows for runs of two or more ranks."""


def failure_warning(rule_id: str, exc: Exception) -> str:
    """The warning for a detector that crashed (its id is also in `Report.failed_detectors`)."""
    return f"detector {rule_id} failed ({type(exc).__name__}: {exc}); its finding is missing"


@dataclass(frozen=True)
class DetectorResults:
    """What the detectors returned: findings in registry order, warnings (a detector that
    crashed, named with its error) and the ids of the rules whose detector crashed."""

    findings: list[Finding] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    failed: tuple[str, ...] = ()


def run_context(ctx: DetectorContext, rules: tuple[Rule, ...] = RULES) -> DetectorResults:
    """Every rule's detector on one context, then the findings reconciled (detectors/
    reconcile.py: two findings never claim the same time); a detector's crash becomes a
    warning, not a failure."""
    findings: list[Finding] = []
    warnings: list[str] = []
    failed: list[str] = []
    for rule in rules:
        try:
            findings.extend(rule.detect(ctx))
        except Exception as exc:  # one broken detector must not sink the analysis
            warnings.append(failure_warning(rule.id, exc))
            failed.append(rule.id)
    return DetectorResults(findings=reconcile(findings), warnings=warnings, failed=tuple(failed))


__all__ = [
    "BY_ID",
    "RULES",
    "STRAGGLER_RULE",
    "DetectorContext",
    "DetectorResults",
    "Rule",
    "build_context",
    "failure_warning",
    "run_context",
]
