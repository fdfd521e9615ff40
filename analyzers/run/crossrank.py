"""Across ranks: match collectives, measure arrival skew, rank the stragglers.

A collective (all-reduce, all-gather, ...) cannot finish on any rank before every rank of its
process group has started it, so the rank that *arrives* last makes the others wait: their
kernels (or gloo ops) start early and sit idle until it arrives. This module

1. **matches** the same collective across ranks: by process group + kind + step + sequence number
   (the i-th collective of that kind on that group in that `ProfilerStep`), a group being an
   *instance*: its name and, where the trace header lists them, its member ranks (on a 2-D mesh
   the shard groups {0,1} and {2,3} are two groups, never matched against each other; calls
   that name no group on a rank belonging to groups of different members, as on gloo, are not
   matched at all); when a rank holds a
   different count (sampled or truncated traces, different profiler windows), or the sequence
   pairs disagree on when the collective ended, it falls back to **end-time matching**: a
   blocking collective ends on all its ranks at (nearly) the same moment, so pairs whose
   (clock-aligned) end times agree within a tolerance are the same collective, taken in order.
   Traces without process-group args use one default group; without steps, the whole trace.
2. **aligns clocks**: ranks on different hosts have clocks that disagree by up to milliseconds;
   a rank's offset is the median difference of its matched collectives' end times (which should
   coincide) against the reference rank.
3. **measures arrival skew** per matched collective (start of each rank), the **last arriver**,
   the **waiting** it causes (sum over the other ranks of how long before it they arrived) and
   its **lead** over the second-to-last arrival (what the collective, and the step, would gain if
   it arrived with the others).
4. ranks them into `StragglerStat`s (Report.stragglers) and, past its thresholds, a
   `straggler` Finding (`stragglers.py`).

Everything here is a pure function of values: `rank_collectives(trace, windows)` is the map's
per-rank input (kept in the rank's summary), `crossrank_match.match_collectives(ranks)` returns
the matching (ranks are consumed one at a time and the matches kept as columns, a
`MatchTable`, so memory stays O(ranks x collectives) in numpy arrays),
and `stragglers.py` ranks it: `straggler_stats(result)` the Report's per-rank table, and
`find_stragglers(result, breakdowns)` the `straggler` finding (called by the straggler detector
on the reduce's matching); both read the table's columns. This module holds the matching's
thresholds and its result types (`MatchedCollective`, `MatchTable`, `CrossRankResult`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# --- thresholds of the matching (named, with their reasoning; reported in Report.thresholds) ---

SKEW_NOISE_US = 50.0
"""Arrivals closer than this are a tie: nobody counts as last. Kernel-launch jitter is a few us
and the clock alignment (median of end-time differences) leaves tens of us of error; 50 us is
above both and far below a step-relevant delay."""

END_MATCH_MIN_TOL_US = 100.0
END_MATCH_REL_TOL = 0.05
"""Two ranks' ends of one collective agree within max(100 us, 5% of the shorter of the two
kernels). Ranks finish a ring/tree collective a data-transfer tail apart (the last chunks travel
the ring), which grows with the transfer itself; the shorter kernel (the last arriver's) is
about the pure transfer time. 100 us covers small collectives' tail plus clock-alignment error."""

SEQUENCE_AGREEMENT = 0.8
"""Sequence-number pairs are trusted outright when at least 80% of them end together (within
the end tolerance). Otherwise, when the two ranks' ends are reliable (a clock offset was
measured from them, see OFFSET_MIN_SUPPORT), end-time matching replaces the sequence: the
sequence was broken by dropped events, and collectives whose ends find no partner are left
unmatched. When ends are not reliable (CPU/gloo collectives, whose ranks finish milliseconds
apart; loosely synchronized hosts), the sequence number, or for unequal counts the order, is the
better evidence and is kept."""

OFFSET_MIN_SUPPORT = 3
OFFSET_MIN_SUPPORT_SHARE = 0.25
"""A clock offset is measured (and the ranks' ends called reliable) only when at least 3
collective pairs, and 25% of the smaller rank's collectives in the shared groups, agree on it
within END_MATCH_MIN_TOL_US; otherwise the clocks are taken as synchronized."""


# --- inputs ---------------------------------------------------------------------------------

OFFSET_INDEX_WINDOW = 3
"""Clock-offset candidates pair each collective with the other rank's collectives up to 3
places away in the same (group, kind, step) sequence: enough to bridge a few dropped events."""


# --- outputs --------------------------------------------------------------------------------


@dataclass
class MatchedCollective:
    """One collective seen on two or more ranks; starts/ends are clock-aligned, in `ranks` order."""

    process_group: str
    kind: str
    step: int  # -1 when the traces have no steps
    seq: int  # index among the reference rank's (group, kind, step) collectives
    ranks: list[int]
    start_us: list[float]
    end_us: list[float]
    method: Literal["sequence", "end-time"] = "sequence"
    members: tuple[int, ...] | None = None  # the group instance's member ranks (None: unknown)

    @property
    def skew_us(self) -> float:
        """Last arrival minus first arrival."""
        return max(self.start_us) - min(self.start_us)

    @property
    def last_rank(self) -> int:
        """The rank that arrived last (lowest rank on exact ties)."""
        return self.ranks[int(np.argmax(self.start_us))]

    @property
    def wait_caused_us(self) -> float:
        """Sum over the other ranks of how long they waited for the last arrival."""
        last = max(self.start_us)
        return float(sum(last - s for s in self.start_us))

    @property
    def lead_us(self) -> float:
        """Last arrival minus second-to-last: what the collective gains if the last one is on time."""
        s = sorted(self.start_us)
        return s[-1] - s[-2]


@dataclass(frozen=True)
class MatchTable:
    """The matched collectives as columns, one row per match, in order of first arrival (ties:
    by step, group, kind, sequence number): what the straggler ranking and the views read.

    `group`/`kind` are codes into `groups`/`kinds`; arrivals are clock-aligned starts;
    `before_last_arrival_us` is the second-to-last arrival (equal to the last on a tie);
    `last_rank` the last arrival's rank (lowest on exact ties); `end_time` whether end times
    paired the match (else sequence numbers); `wait_caused_us` the sum over its ranks of how long
    each arrived before the last one. `group_members[g]` are the member ranks of group instance
    `g` (None: unknown); two instances can share a name (`groups` then repeats it).
    """

    groups: tuple[str, ...]
    kinds: tuple[str, ...]
    group: IntArray
    kind: IntArray
    step: IntArray
    seq: IntArray
    first_arrival_us: FloatArray
    last_arrival_us: FloatArray
    before_last_arrival_us: FloatArray
    last_rank: IntArray
    n_ranks: IntArray
    end_time: npt.NDArray[np.bool_]
    wait_caused_us: FloatArray
    group_members: tuple[tuple[int, ...] | None, ...] = ()

    def __len__(self) -> int:
        return len(self.step)

    def members_of(self, g: int) -> tuple[int, ...] | None:
        """The member ranks of group instance `g` (None when unknown)."""
        return self.group_members[g] if g < len(self.group_members) else None

    @property
    def skew_us(self) -> FloatArray:
        """Last arrival minus first arrival, per match."""
        return self.last_arrival_us - self.first_arrival_us

    @property
    def lead_us(self) -> FloatArray:
        """Last arrival minus second-to-last, per match (the gain if the last were on time)."""
        return self.last_arrival_us - self.before_last_arrival_us

    @staticmethod
    def empty() -> MatchTable:
        """No matches."""
        return MatchTable.of([])

    @staticmethod
    def of(matched: Sequence[MatchedCollective]) -> MatchTable:
        """The columns of matches held as objects (kept in their order)."""
        instances = tuple(dict.fromkeys((m.process_group, m.members) for m in matched))
        kinds = tuple(dict.fromkeys(m.kind for m in matched))
        g_of = {g: i for i, g in enumerate(instances)}
        k_of = {k: i for i, k in enumerate(kinds)}

        def ints(values: Iterable[int]) -> IntArray:
            return np.fromiter(values, np.int64, len(matched))

        def floats(values: Iterable[float]) -> FloatArray:
            return np.fromiter(values, np.float64, len(matched))

        return MatchTable(
            groups=tuple(name for name, _ in instances),
            kinds=kinds,
            group=ints(g_of[m.process_group, m.members] for m in matched),
            kind=ints(k_of[m.kind] for m in matched),
            step=ints(m.step for m in matched),
            seq=ints(m.seq for m in matched),
            first_arrival_us=floats(min(m.start_us) for m in matched),
            last_arrival_us=floats(max(m.start_us) for m in matched),
            before_last_arrival_us=floats(sorted(m.start_us)[-2] for m in matched),
            last_rank=ints(m.last_rank for m in matched),
            n_ranks=ints(len(m.ranks) for m in matched),
            end_time=np.fromiter((m.method == "end-time" for m in matched), bool, len(matched)),
            wait_caused_us=floats(m.wait_caused_us for m in matched),
            group_members=tuple(members for _, members in instances),
        )


@dataclass
class CrossRankResult:
    """The matched collectives of a run and how they were matched.

    `table` holds the matches as columns (crossrank_match.py builds it streaming);
    `late_us_per_rank` is, per rank, the sum over its matches of how long after the first
    arrival it arrived. `matched` gives the matches as `MatchedCollective` objects (with every
    rank's aligned start and end), built on each access: for tests and small runs, not for the
    reduce of a large one.
    """

    ranks: list[int]
    table: MatchTable = field(default_factory=MatchTable.empty)
    clock_offset_us: dict[int, float] = field(default_factory=dict)  # add to a rank's times
    collectives_per_rank: dict[int, int] = field(default_factory=dict)
    matched_per_rank: dict[int, int] = field(default_factory=dict)
    late_us_per_rank: dict[int, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    member_detail: Callable[[], list[MatchedCollective]] | None = None

    @property
    def matched(self) -> list[MatchedCollective]:
        """The matches as objects, in the table's order (see the class docstring)."""
        return self.member_detail() if self.member_detail is not None else []

    @property
    def steps(self) -> list[int]:
        """Distinct step numbers of the matched collectives (-1 when there are no steps)."""
        return [int(s) for s in np.unique(self.table.step)]

    @staticmethod
    def from_matched(ranks: list[int], matched: list[MatchedCollective]) -> CrossRankResult:
        """A result from matches held as objects (ordered by first arrival, as the matcher
        orders them), with the per-rank counters they imply."""
        matched = sorted(matched, key=lambda m: min(m.start_us))
        per_rank: dict[int, int] = dict.fromkeys(ranks, 0)
        late: dict[int, float] = dict.fromkeys(ranks, 0.0)
        for m in matched:
            first = min(m.start_us)
            for r, s in zip(m.ranks, m.start_us, strict=True):
                per_rank[r] = per_rank.get(r, 0) + 1
                late[r] = late.get(r, 0.0) + (s - first)
        return CrossRankResult(
            ranks=ranks,
            table=MatchTable.of(matched),
            matched_per_rank=per_rank,
            late_us_per_rank=late,
            member_detail=lambda: list(matched),
        )
