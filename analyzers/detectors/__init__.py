"""Misconfiguration detectors: pure functions of the analyzed run, returning Findings.

`run_detectors(run, analysis)` is what the pipeline calls (`zdiag analyze`): it builds one
`DetectorContext` (FSDP ledgers per rank, manifest facts, memory evidence) and runs every
detector in `DETECTORS`. Each detector lives in its own module with its thresholds as named
constants next to the reasoning behind them. A detector that fails on unexpected input is
reported as a warning on the Report instead of failing the analysis.
"""

from __future__ import annotations

from collections.abc import Callable

from zdiag.analyzers.detectors import (
    activation_oom,
    comm_bound,
    flat_sharding,
    fp32_collectives,
    missing_overlap,
    straggler,
    tiny_layer_wrap,
    whole_model_wrap,
)
from zdiag.analyzers.detectors.context import DetectorContext, build_context
from zdiag.analyzers.report import Finding
from zdiag.analyzers.run_data import Analysis, RunData

Detector = Callable[[DetectorContext], list[Finding]]

DETECTORS: dict[str, Detector] = {
    "whole-model-wrap": whole_model_wrap.detect,
    "tiny-layer-wrap": tiny_layer_wrap.detect,
    "missing-overlap": missing_overlap.detect,
    "activation-oom": activation_oom.detect,
    "straggler": straggler.detect,
    "fp32-collectives": fp32_collectives.detect,
    "flat-sharding-multinode": flat_sharding.detect,
    "comm-bound": comm_bound.detect,
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


def run_context(ctx: DetectorContext) -> list[Finding]:
    """Every detector on one context; a detector's crash becomes a warning, not a failure."""
    findings: list[Finding] = []
    for name, detect in DETECTORS.items():
        try:
            findings.extend(detect(ctx))
        except Exception as exc:  # one broken detector must not sink the analysis
            if ctx.report is not None:
                ctx.report.warnings.append(
                    f"detector {name} failed ({type(exc).__name__}: {exc}); its finding is missing"
                )
    return findings


def run_detectors(run: RunData, analysis: Analysis) -> list[Finding]:
    """All findings for a pipeline `RunData` and `Analysis` (analyzers/run_data.py)."""
    return run_context(build_context(run, analysis))


__all__ = ["DETECTORS", "FSDP_FINDING_IDS", "DetectorContext", "build_context", "run_detectors"]
