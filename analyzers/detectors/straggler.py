"""`straggler`: ranks that arrive last at collectives and make the others wait (crossrank.py)."""

from __future__ import annotations

from zdiag.analyzers.crossrank import find_stragglers
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.report import Finding


def detect(ctx: DetectorContext) -> list[Finding]:
    """The cross-rank straggler finding, from the reduce's matching and the step tables."""
    if ctx.crossrank is None or len(ctx.crossrank.ranks) < 2:
        return []
    gpu = _uses_gpu(ctx)
    m = ctx.manifest
    one_host = m is not None and len({e.host for e in m.ranks}) == 1 and m.ranks[0].host is not None
    return find_stragglers(
        ctx.crossrank, ctx.breakdowns, gpu=gpu, shared_cpu_host=not gpu and one_host
    )


def _uses_gpu(ctx: DetectorContext) -> bool:
    """False when the manifest says every rank trained on a CPU (no GPU advice then); True when
    unknown (traces recorded elsewhere)."""
    m = ctx.manifest
    if m is None or not m.ranks:
        return True
    devices = [e.device for e in m.ranks]
    if any(d is None for d in devices):
        return True
    return any(str(d).startswith("cuda") for d in devices)
