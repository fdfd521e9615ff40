"""`straggler`: ranks that arrive last at collectives and make the others wait (crossrank.py)."""

from __future__ import annotations

from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.report import Finding


def detect(ctx: DetectorContext) -> list[Finding]:
    """B2's cross-rank straggler detector, run on the pipeline's RunData and Analysis."""
    if ctx.run is None or ctx.analysis is None or len(ctx.traces) < 2:
        return []
    from zdiag.analyzers.crossrank import detect_stragglers

    return list(detect_stragglers(ctx.run, ctx.analysis))
