"""One rank's collectives as columns: the map's per-rank input to the cross-rank matching.

`rank_collectives(trace, windows)` takes the rank's collective table (`collectives_of(trace)`)
and the step windows; the result (`RankCollectives`) is kept in the rank's summary and handed to
the matching (`run/crossrank_match.py`) as coded columns (`RankColumns`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..inputs.events import RankTrace
from .collective_table import collectives_of
from .declared_groups import Members
from .steps import StepWindows

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class RankColumns:
    """One rank's collectives as compact columns, what the matching reads: `kind` and `group`
    are codes into `kinds` / `groups`, `step` the step holding each call (-1: none). In start
    order (the matcher sorts them otherwise). A summary gives these as views of its packed bytes
    (`CollectiveCalls.columns`), so feeding the matcher copies nothing.

    `group_members[g]` are the member ranks of group `groups[g]` on this rank (None: unknown;
    empty: not said, `declared_groups.group_members`), what the matching keys group instances
    by; the codes in `unattributed` are calls whose group the trace does not say while the rank
    belongs to groups of different members: the matching leaves them out."""

    rank: int
    start_us: FloatArray
    end_us: FloatArray
    kind: npt.NDArray[np.integer]
    kinds: Sequence[str]
    group: npt.NDArray[np.integer]
    groups: Sequence[str]
    step: npt.NDArray[np.integer]
    ends_align: bool = True
    group_members: Sequence[Members | None] = ()
    unattributed: frozenset[int] = field(default_factory=frozenset)

    def members_of(self, g: int) -> Members | None:
        """The members of group code `g` (None when unknown)."""
        return self.group_members[g] if g < len(self.group_members) else None

    def __len__(self) -> int:
        return len(self.start_us)


@dataclass
class RankCollectives:
    """One rank's collectives in start order: the map's per-rank value of them.

    `step[i]` is the step number holding collective i (-1: outside any step / no steps);
    `process_group[i]` is "" when the trace does not say. `ends_align` says whether this rank's
    collective ends line up with other ranks' (device kernels: NCCL/RCCL ranks finish a
    collective together); host-thread collectives (CPU/gloo) finish milliseconds apart, so their
    ends neither measure a clock offset nor re-pair collectives: they are matched by sequence.
    """

    rank: int
    start_us: FloatArray
    end_us: FloatArray
    kind: list[str]
    process_group: list[str]
    step: IntArray
    ends_align: bool = True

    def __post_init__(self) -> None:
        n = len(self.start_us)
        if not (
            len(self.end_us) == len(self.kind) == len(self.process_group) == len(self.step) == n
        ):
            raise ValueError(f"rank {self.rank}: collective columns differ in length")
        order = np.argsort(self.start_us, kind="stable")
        if len(order) and np.any(order != np.arange(n)):
            self.start_us = self.start_us[order]
            self.end_us = self.end_us[order]
            self.kind = [self.kind[i] for i in order]
            self.process_group = [self.process_group[i] for i in order]
            self.step = self.step[order]

    def __len__(self) -> int:
        return len(self.start_us)

    def columns(self) -> RankColumns:
        """The same collectives as coded columns (for the matching)."""
        kinds = sorted(set(self.kind))
        groups = sorted(set(self.process_group))
        k_of = {k: j for j, k in enumerate(kinds)}
        g_of = {g: j for j, g in enumerate(groups)}
        return RankColumns(
            rank=self.rank,
            start_us=self.start_us,
            end_us=self.end_us,
            kind=np.fromiter((k_of[k] for k in self.kind), np.int64, len(self)),
            kinds=kinds,
            group=np.fromiter((g_of[g] for g in self.process_group), np.int64, len(self)),
            groups=groups,
            step=self.step,
            ends_align=self.ends_align,
        )


def rank_collectives(trace: RankTrace, windows: StepWindows | None = None) -> RankCollectives:
    """A rank's collectives (`collectives_of(trace)`) with their steps."""
    col = collectives_of(trace)
    idx = np.asarray(col.event, dtype=np.int64)
    start = np.asarray(trace.ts_us, dtype=np.float64)[idx]
    end = start + np.asarray(trace.dur_us, dtype=np.float64)[idx]
    kinds = [col.kinds[int(k)] for k in col.kind]
    if windows is not None and len(windows):
        pos = windows.index_of(start)
        step = np.where(pos >= 0, windows.step[np.clip(pos, 0, None)], -1).astype(np.int64)
    else:
        step = np.full(len(idx), -1, dtype=np.int64)
    return RankCollectives(
        rank=trace.rank,
        start_us=start,
        end_us=end,
        kind=kinds,
        process_group=list(col.process_group),
        step=step,
        ends_align=trace.device != "cpu",
    )
