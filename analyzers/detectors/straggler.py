"""`straggler`: ranks that arrive last at collectives and make the others wait (run/stragglers.py)."""

from __future__ import annotations

from ..report import Finding
from ..run.stragglers import find_stragglers
from .context import DetectorContext
from .facts import cpu_only


def detect(ctx: DetectorContext) -> list[Finding]:
    """The cross-rank straggler finding, from the reduce's matching and the step tables."""
    if ctx.crossrank is None or len(ctx.crossrank.ranks) < 2:
        return []
    gpu = not cpu_only(ctx)
    hosts = _hosts(ctx)
    one_host = len(hosts) == 1 and None not in hosts
    return find_stragglers(
        ctx.crossrank, ctx.breakdowns, gpu=gpu, shared_cpu_host=not gpu and one_host
    )


def _hosts(ctx: DetectorContext) -> set[str | None]:
    """The ranks' host names: the manifest's, else the traces' (None where unknown)."""
    m = ctx.manifest
    if m is not None and m.ranks:
        return {e.host for e in m.ranks}
    return {f.host for f in ctx.facts.values()} if ctx.facts else {None}
