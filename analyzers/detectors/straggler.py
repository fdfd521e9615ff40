"""`straggler`: ranks that arrive last at collectives and make the others wait (crossrank.py)."""

from __future__ import annotations

from zdiag.analyzers.crossrank import find_stragglers
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.report import Finding


def detect(ctx: DetectorContext) -> list[Finding]:
    """The cross-rank straggler finding, from the reduce's matching and the step tables."""
    if ctx.crossrank is None or len(ctx.crossrank.ranks) < 2:
        return []
    return find_stragglers(ctx.crossrank, ctx.breakdowns)
