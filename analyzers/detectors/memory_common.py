"""What the memory detectors share: each rank's peak by category, from the best source.

A rank's memory at its peak comes from its CUDA snapshot's breakdown (replayed from the
allocator history), else from Kineto memory events (`kineto_memory.py`), else from the memory
evidence (OOM record, memory timeline). Bytes that are not known stay None, never 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..report import MemoryBreakdown, WhatIf
from .context import DetectorContext

MIB = 1024**2


@dataclass(frozen=True)
class RankPeak:
    """One rank's peak: total, by category (empty when unknown), capacity, failure."""

    rank: int
    source: str
    peak_bytes: int | None
    category_bytes: dict[str, int] = field(default_factory=dict)
    capacity_bytes: int | None = None
    oom: bool = False
    breakdown: MemoryBreakdown | None = None

    @property
    def over_capacity(self) -> bool:
        """Ran out of memory, or its peak exceeds the known capacity."""
        return self.oom or (
            self.capacity_bytes is not None
            and self.peak_bytes is not None
            and self.peak_bytes > self.capacity_bytes
        )

    def what_if(self, change_prefix: str) -> WhatIf | None:
        """The breakdown's what-if whose change starts with `change_prefix`."""
        if self.breakdown is None:
            return None
        return next((w for w in self.breakdown.what_if if w.change.startswith(change_prefix)), None)


def rank_peaks(ctx: DetectorContext) -> list[RankPeak]:
    """Every rank with memory data, by rank (breakdowns first, then the memory evidence)."""
    out: dict[int, RankPeak] = {}
    for b in ctx.memory_breakdowns:
        if b.rank in out:
            continue
        out[b.rank] = RankPeak(
            rank=b.rank,
            source=b.source,
            peak_bytes=b.peak_bytes,
            category_bytes=dict(b.peak_category_bytes),
            capacity_bytes=b.capacity_bytes,
            oom=b.oom,
            breakdown=b,
        )
    for ev in ctx.memory:
        if ev.rank in out:
            continue
        out[ev.rank] = RankPeak(
            rank=ev.rank,
            source=ev.source,
            peak_bytes=ev.peak_bytes,
            category_bytes=dict(ev.category_bytes),
            capacity_bytes=ev.capacity_bytes,
            oom=ev.oom,
        )
    return [out[r] for r in sorted(out)]
