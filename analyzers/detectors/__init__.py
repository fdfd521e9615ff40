"""Misconfiguration detectors: pure functions of the analyzed run, returning Findings.

The reduce (analyzers/engine/reduce.py) builds one `DetectorContext` from values (FSDP ledgers per
rank, step tables, detector facts, manifest facts, memory evidence, the cross-rank matching)
and `run_context(ctx)` runs every detector in `DETECTORS`, returning their findings and
warnings. Each detector lives in its own module with its thresholds as named constants next to
the reasoning behind them. A detector that fails on unexpected input becomes a warning instead
of failing the analysis.
"""

from __future__ import annotations

from collections.abc import Callable
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
    optimizer_state_dominant,
    step_verdicts,
    straggler,
    tiny_layer_wrap,
    whole_model_wrap,
)
from .context import DetectorContext, build_context
from .reconcile import reconcile

Detector = Callable[[DetectorContext], list[Finding]]

DETECTORS: dict[str, Detector] = {
    "crash": crash.detect,
    "hang": hang.detect,
    "whole-model-wrap": whole_model_wrap.detect,
    "tiny-layer-wrap": tiny_layer_wrap.detect,
    "missing-overlap": missing_overlap.detect,
    "activation-oom": activation_oom.detect,
    "optimizer-state-dominant": optimizer_state_dominant.detect,
    "fragmentation": fragmentation.detect,
    "memory-imbalance": memory_imbalance.detect,
    "straggler": straggler.detect,
    "host-sync": host_sync.detect,
    "fp32-collectives": fp32_collectives.detect,
    "flat-sharding-multinode": flat_sharding.detect,
    "comm-bound": comm_bound.detect,
    "host-bound": step_verdicts.detect_host_bound,
    "exposed-comm": step_verdicts.detect_exposed_comm,
}
"""Finding id -> detector, in report order."""

FSDP_FINDING_IDS = frozenset(
    {
        "whole-model-wrap",
        "tiny-layer-wrap",
        "missing-overlap",
        "fp32-collectives",
        "flat-sharding-multinode",
        "comm-bound",
    }
)
"""Findings that only FSDP/ZeRO traffic can raise."""


@dataclass(frozen=True)
class DetectorResults:
    """What the detectors returned: findings in registry order, and warnings (a detector that
    crashed, named with its error)."""

    findings: list[Finding] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def run_context(ctx: DetectorContext) -> DetectorResults:
    """Every detector on one context, then the findings reconciled (detectors/reconcile.py: two
    findings never claim the same time); a detector's crash becomes a warning, not a failure."""
    findings: list[Finding] = []
    warnings: list[str] = []
    for name, detect in DETECTORS.items():
        try:
            findings.extend(detect(ctx))
        except Exception as exc:  # one broken detector must not sink the analysis
            warnings.append(
                f"detector {name} failed ({type(exc).__name__}: {exc}); its finding is missing"
            )
    return DetectorResults(findings=reconcile(findings), warnings=warnings)


__all__ = [
    "DETECTORS",
    "FSDP_FINDING_IDS",
    "DetectorContext",
    "DetectorResults",
    "build_context",
    "run_context",
]
