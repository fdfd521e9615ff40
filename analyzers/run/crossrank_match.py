"""Cross-rank matching that streams: ranks go in one at a time, match columns come out.

`CrossRankMatcher.add(columns)` takes one rank's collectives (`RankColumns`, in ascending rank
order) and matches them at once against each (process group, kind, step) key's reference rank
(the lowest rank holding the key), by sequence number or end time as crossrank.py's docstring
says. A process group is an instance: its name and member ranks (`RankColumns.group_members`),
so same-named groups of different members never share a key; calls the rank cannot attribute to
a group (`RankColumns.unattributed`) are left out, with a warning. What it keeps, all in numpy arrays:

- per match slot (one per collective of a key's reference rank): how many ranks joined it, the
  first and the last arrival, the arrival before the last, the last rank, whether end times
  paired it (the straggler rule and the views need nothing else of a match);
- per key: the reference rank's aligned ends and durations (what later ranks are paired with);
- per rank: its collectives' key codes and slots (int32) and views of its start/end columns
  (from the summary, not copied): the clock-offset search reads earlier ranks' ends, and
  `finish()` makes one more pass over them for the waiting each match caused and each rank's
  lateness, summed in the same order as the per-match objects of earlier versions did.

So memory is O(ranks x collectives) in compact arrays (int32 key, key order, slot and match row
per rank-collective beyond the summaries' own columns: ~22 bytes at the peak, measured by
bench/crossrank_scale.py) and no Python object is made per match or per rank-collective.
`finish()` returns a `CrossRankResult` whose `table` holds the matches as columns; its
`matched` list of `MatchedCollective` objects is built only when asked (tests, small runs).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from ..rank.collective_columns import RankCollectives, RankColumns
from ..rank.declared_groups import Members
from .crossrank import (
    END_MATCH_MIN_TOL_US,
    END_MATCH_REL_TOL,
    OFFSET_INDEX_WINDOW,
    OFFSET_MIN_SUPPORT,
    OFFSET_MIN_SUPPORT_SHARE,
    SEQUENCE_AGREEMENT,
    CrossRankResult,
    MatchedCollective,
    MatchTable,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
I32Array = npt.NDArray[np.int32]

K = TypeVar("K")
_STEP_BIAS = 1 << 31  # steps are int32 (-1: none); biased to pack (group, kind, step) in int64


@dataclass
class _Rank:
    """What the matcher keeps of one rank (see the module docstring)."""

    rank: int
    ends_align: bool
    start_us: FloatArray  # a view of the rank's column, never written
    end_us: FloatArray
    key: I32Array  # global key code per collective
    order: I32Array  # collectives sorted by key (stable: start order within a key)
    ukeys: I32Array  # the rank's distinct key codes, ascending
    bounds: IntArray  # key ukeys[i] is order[bounds[i]:bounds[i + 1]]
    slot: I32Array  # match slot per collective, -1: unmatched
    offset_us: float = 0.0
    reliable: bool = False

    def __len__(self) -> int:
        return len(self.start_us)

    def key_rows(self, i: int) -> I32Array:
        """The rank's collectives of its i-th key, in start order."""
        return self.order[self.bounds[i] : self.bounds[i + 1]]


@dataclass
class _Key:
    """A (group, kind, step) key: its reference rank's collectives and their match slots."""

    ref: int  # index into the matcher's ranks
    slot_base: int
    end_us: FloatArray  # the reference rank's clock-aligned ends of the key's collectives
    dur_us: FloatArray


class _Slots:
    """Running per-slot aggregates in growable arrays."""

    def __init__(self) -> None:
        self.n = 0
        self.count = np.zeros(0, dtype=np.int32)
        self.first_us = np.zeros(0)
        self.last_us = np.zeros(0)
        self.second_us = np.zeros(0)
        self.last_rank = np.zeros(0, dtype=np.int64)
        self.end_time = np.zeros(0, dtype=bool)
        self.key = np.zeros(0, dtype=np.int32)
        self.seq = np.zeros(0, dtype=np.int32)

    def open(self, key: int, starts: FloatArray, rank: int) -> int:
        """New slots for a key's reference collectives (arriving at `starts`); the first index."""
        base, n = self.n, len(starts)
        if base + n > len(self.count):
            cap = max(2 * len(self.count), base + n, 1024)
            for name in (
                "count",
                "first_us",
                "last_us",
                "second_us",
                "last_rank",
                "end_time",
                "key",
                "seq",
            ):
                old = getattr(self, name)
                new = np.zeros(cap, dtype=old.dtype)
                new[:base] = old[:base]
                setattr(self, name, new)
        sl = slice(base, base + n)
        self.count[sl] = 1
        self.first_us[sl] = starts
        self.last_us[sl] = starts
        self.second_us[sl] = -np.inf
        self.last_rank[sl] = rank
        self.key[sl] = key
        self.seq[sl] = np.arange(n, dtype=np.int32)
        self.n = base + n
        return base

    def join(self, slots: IntArray, starts: FloatArray, rank: int) -> None:
        """Rank `rank` arrives at `slots` (distinct) at `starts`; ranks join in ascending order,
        so on a tie the earlier (lower) rank stays the last arrival."""
        self.count[slots] += 1
        self.first_us[slots] = np.minimum(self.first_us[slots], starts)
        top = self.last_us[slots]
        later = starts > top
        self.second_us[slots] = np.where(later, top, np.maximum(self.second_us[slots], starts))
        self.last_us[slots] = np.where(later, starts, top)
        self.last_rank[slots] = np.where(later, rank, self.last_rank[slots])


@dataclass
class _Counts:
    """How the (group, kind, step) comparisons were matched (for the warnings)."""

    sequence: int = 0
    end_time: int = 0
    order: int = 0
    loose: int = 0


def _end_tol(dur_a: FloatArray, dur_b: FloatArray) -> FloatArray:
    return np.maximum(END_MATCH_MIN_TOL_US, END_MATCH_REL_TOL * np.minimum(dur_a, dur_b))


def _end_time_pairs(
    ends_a: FloatArray, durs_a: FloatArray, ends_b: FloatArray, durs_b: FloatArray
) -> tuple[IntArray, IntArray]:
    """Monotone pairs (i, j) whose ends agree within the tolerance (two pointers, in end order)."""
    oa = np.argsort(ends_a, kind="stable")
    ob = np.argsort(ends_b, kind="stable")
    pa: list[int] = []
    pb: list[int] = []
    i = j = 0
    while i < len(oa) and j < len(ob):
        ia, jb = int(oa[i]), int(ob[j])
        d = ends_b[jb] - ends_a[ia]
        tol = max(END_MATCH_MIN_TOL_US, END_MATCH_REL_TOL * min(durs_a[ia], durs_b[jb]))
        if abs(d) <= tol:
            pa.append(ia)
            pb.append(jb)
            i += 1
            j += 1
        elif d < 0:
            j += 1
        else:
            i += 1
    return np.asarray(pa, dtype=np.int64), np.asarray(pb, dtype=np.int64)


def _estimate_offset(ref: _Rank, other: _Rank) -> float | None:
    """The clock offset (ref - other) that makes the most collective ends coincide.

    Candidates are end-time differences of nearby pairs (same group key, index distance <=
    OFFSET_INDEX_WINDOW); the offset is the candidate with the most others within
    END_MATCH_MIN_TOL_US of it (true pairs agree, wrong pairs scatter), refined by the median
    of those. None when the ranks share no group key or too few ends agree on any offset.
    """
    shared, ia, ib = np.intersect1d(ref.ukeys, other.ukeys, assume_unique=True, return_indices=True)
    if not len(shared):
        return None
    cands: list[FloatArray] = []
    n_shared = 0
    for i, j in zip(ia.tolist(), ib.tolist(), strict=True):
        ea, eb = ref.end_us[ref.key_rows(i)], other.end_us[other.key_rows(j)]
        n_shared += min(len(ea), len(eb))
        for shift in range(-OFFSET_INDEX_WINDOW, OFFSET_INDEX_WINDOW + 1):
            lo, hi = max(0, -shift), min(len(ea), len(eb) - shift)
            if hi > lo:
                cands.append(ea[lo:hi] - eb[lo + shift : hi + shift])
    if not cands:
        return None
    d = np.sort(np.concatenate(cands))
    support = np.searchsorted(d, d + END_MATCH_MIN_TOL_US, side="right") - np.searchsorted(
        d, d - END_MATCH_MIN_TOL_US, side="left"
    )
    best = support.max()
    if best < max(OFFSET_MIN_SUPPORT, OFFSET_MIN_SUPPORT_SHARE * n_shared):
        return None
    # among equally supported candidates prefer the one nearest zero (synchronized clocks)
    center = d[support == best][np.argmin(np.abs(d[support == best]))]
    near = d[np.abs(d - center) <= END_MATCH_MIN_TOL_US]
    return float(np.median(near))


@dataclass
class CrossRankMatcher:
    """Matches collectives across ranks fed one at a time in ascending rank order (see the
    module docstring); `finish()` gives the CrossRankResult."""

    ranks: list[int] = field(default_factory=list)  # as given, duplicates included
    _ranks: list[_Rank] = field(default_factory=list)
    _groups: dict[tuple[str, Members | None], int] = field(default_factory=dict)
    _kinds: dict[str, int] = field(default_factory=dict)
    _key_of: dict[tuple[int, int, int], int] = field(default_factory=dict)
    _key_names: list[tuple[int, int, int]] = field(default_factory=list)
    _keys: dict[int, _Key] = field(default_factory=dict)
    _slots: _Slots = field(default_factory=_Slots)
    _counts: _Counts = field(default_factory=_Counts)
    _shared: bool = False
    _any_step: bool = False
    _unattributed: dict[int, int] = field(default_factory=dict)  # rank -> calls left out

    def add(self, cols: RankColumns) -> None:
        """Match one rank's collectives against the ranks added before (lower ranks)."""
        if self._ranks and cols.rank <= self._ranks[-1].rank:
            raise ValueError(f"rank {cols.rank} added after rank {self._ranks[-1].rank}")
        self.ranks.append(cols.rank)
        r = self._prepare(cols)
        self._align(r)
        start_aligned = r.start_us + r.offset_us
        for i, code in enumerate(r.ukeys.tolist()):
            rows = r.key_rows(i)
            key = self._keys.get(code)
            if key is None:
                base = self._slots.open(code, start_aligned[rows], r.rank)
                r.slot[rows] = np.arange(base, base + len(rows), dtype=np.int32)
                ref_end = r.end_us[rows]
                self._keys[code] = _Key(
                    len(self._ranks), base, ref_end + r.offset_us, ref_end - r.start_us[rows]
                )
                continue
            self._shared = True
            ia, jb = self._pair(key, r, rows)
            picked = rows[jb]
            slots = key.slot_base + ia
            self._slots.join(slots, start_aligned[picked], r.rank)
            r.slot[picked] = slots.astype(np.int32)
        self._ranks.append(r)

    def _prepare(self, cols: RankColumns) -> _Rank:
        """The rank's columns in start order with global key codes."""
        start, end = cols.start_us, cols.end_us
        kind, group, step = cols.kind, cols.group, cols.step
        if cols.unattributed and len(start):
            keep = ~np.isin(np.asarray(group, dtype=np.int64), sorted(cols.unattributed))
            if not keep.all():
                self._unattributed[cols.rank] = int((~keep).sum())
                start, end, step = start[keep], end[keep], step[keep]
                kind, group = kind[keep], group[keep]
        if len(start) > 1 and bool(np.any(start[1:] < start[:-1])):
            o = np.argsort(start, kind="stable")
            start, end, kind, group, step = start[o], end[o], kind[o], group[o], step[o]
        if len(step) and bool((step >= 0).any()):
            self._any_step = True
        gmap = np.asarray(
            [self._code(self._groups, (g, cols.members_of(j))) for j, g in enumerate(cols.groups)],
            dtype=np.int64,
        )
        kmap = np.asarray([self._code(self._kinds, k) for k in cols.kinds], dtype=np.int64)
        packed = np.zeros(len(start), dtype=np.int64)
        if len(start):
            g = gmap[np.asarray(group, dtype=np.int64)]
            k = kmap[np.asarray(kind, dtype=np.int64)]
            packed = ((g << 16) | k) << 32 | (np.asarray(step, dtype=np.int64) + _STEP_BIAS)
        uniq, inverse = np.unique(packed, return_inverse=True)
        codes = np.asarray(
            [self._key_code(int(p)) for p in uniq.tolist()], dtype=np.int32
        )  # a few per rank
        key = codes[inverse.reshape(-1)] if len(start) else np.zeros(0, dtype=np.int32)
        order = np.argsort(key, kind="stable").astype(np.int32)
        ukeys, first = np.unique(key[order], return_index=True)
        return _Rank(
            rank=cols.rank,
            ends_align=cols.ends_align,
            start_us=np.asarray(start, dtype=np.float64),
            end_us=np.asarray(end, dtype=np.float64),
            key=key,
            order=order,
            ukeys=ukeys.astype(np.int32),
            bounds=np.append(first, len(key)).astype(np.int64),
            slot=np.full(len(start), -1, dtype=np.int32),
        )

    @staticmethod
    def _code(table: dict[K, int], name: K) -> int:
        return table.setdefault(name, len(table))

    def _key_code(self, packed: int) -> int:
        gk, step = packed >> 32, (packed & 0xFFFFFFFF) - _STEP_BIAS
        name = (gk >> 16, gk & 0xFFFF, step)
        code = self._key_of.get(name)
        if code is None:
            code = self._key_of[name] = len(self._key_names)
            self._key_names.append(name)
        return code

    def _align(self, r: _Rank) -> None:
        """The rank's clock offset against the lowest earlier rank whose ends measure one
        (host-thread collectives: none, ends not reliable; see RankCollectives.ends_align)."""
        if not self._ranks:
            r.reliable = r.ends_align
            return
        if r.ends_align:
            for ref in self._ranks:
                if not ref.ends_align:
                    continue
                delta = _estimate_offset(ref, r)
                if delta is not None:
                    r.offset_us = ref.offset_us + delta
                    r.reliable = ref.reliable
                    return
        r.offset_us = 0.0
        r.reliable = False

    def _pair(self, key: _Key, r: _Rank, rows: I32Array) -> tuple[IntArray, IntArray]:
        """Pairs (reference index, index into `rows`) of a key's collectives on rank `r`."""
        ref = self._ranks[key.ref]
        n_a, n_b = len(key.end_us), len(rows)
        n_pairs = min(n_a, n_b)
        ends_b = r.end_us[rows] + r.offset_us
        durs_b = r.end_us[rows] - r.start_us[rows]
        agreeing = 0
        if n_a == n_b:
            tol = _end_tol(key.dur_us, durs_b)
            agreeing = int((np.abs(key.end_us - ends_b) <= tol).sum())
        by_sequence = n_a == n_b and agreeing >= SEQUENCE_AGREEMENT * n_pairs
        if not by_sequence and ref.reliable and r.reliable:
            ia, jb = _end_time_pairs(key.end_us, key.dur_us, ends_b, durs_b)
            self._counts.end_time += 1
            self._slots.end_time[key.slot_base + ia] = True
            return ia, jb
        # sequence number (order when counts differ)
        self._counts.sequence += 1
        self._counts.loose += 0 if by_sequence else 1
        if n_a != n_b:
            self._counts.order += 1
        idx = np.arange(n_pairs, dtype=np.int64)
        return idx, idx

    def finish(self) -> CrossRankResult:
        """The matching of the ranks added (see crossrank.CrossRankResult)."""
        if len(self._ranks) < 2:
            return CrossRankResult(
                ranks=list(self.ranks),
                table=MatchTable.empty(),
                collectives_per_rank={r.rank: len(r) for r in self._ranks},
                matched_per_rank={r.rank: 0 for r in self._ranks},
            )
        if not self._shared and self._any_step:
            # step numbers share nothing (ranks segmented differently, or profiled different
            # windows): match over the whole trace instead of per step
            again = CrossRankMatcher()
            for r in self._ranks:
                again.add(self._without_steps(r))
            result = again.finish()
            result.ranks = list(self.ranks)
            result.warnings.insert(
                0,
                "the ranks' step numbers do not overlap: collectives were matched over the "
                "whole trace, not per step",
            )
            return result
        return self._result()

    def _without_steps(self, r: _Rank) -> RankColumns:
        names = np.asarray(self._key_names, dtype=np.int64).reshape(-1, 3)
        return RankColumns(
            rank=r.rank,
            start_us=r.start_us,
            end_us=r.end_us,
            kind=names[r.key, 1],
            kinds=list(self._kinds),
            group=names[r.key, 0],
            groups=[name for name, _ in self._groups],
            step=np.full(len(r), -1, dtype=np.int64),
            ends_align=r.ends_align,
            group_members=[members for _, members in self._groups],
        )

    def _result(self) -> CrossRankResult:
        s = self._slots
        n = s.n
        keep = np.flatnonzero(s.count[:n] >= 2)
        names = np.asarray(self._key_names, dtype=np.int64).reshape(-1, 3)
        kg, kk, kstep = (names[s.key[keep], c] for c in range(3))
        instances, kinds = list(self._groups), list(self._kinds)
        groups = [name for name, _ in instances]
        # group instances by name, then members (one name, several instances: a mesh dimension)
        by_name = sorted(range(len(instances)), key=lambda g: (groups[g], instances[g][1] or ()))
        g_rank = np.argsort(np.asarray(by_name, dtype=np.int64), kind="stable")
        k_rank = np.argsort(np.argsort(np.asarray(kinds, dtype=object), kind="stable"))
        # keys in (step, group, kind) order, then sequence; then by first arrival (stable)
        first = s.first_us[keep]
        order = np.lexsort((s.seq[keep], k_rank[kk], g_rank[kg], kstep, first))
        rows = keep[order]
        row_of = np.full(n, -1, dtype=np.int64)
        row_of[rows] = np.arange(len(rows))
        last = s.last_us[rows]
        wait = np.zeros(len(rows))
        first_of_row = s.first_us[rows]
        late: dict[int, float] = {}
        matched: dict[int, int] = {}
        members: list[tuple[int, I32Array]] = []
        for r in self._ranks:  # ascending rank: sums in the order of the per-match lists
            valid = r.slot >= 0
            mine = np.flatnonzero(valid)
            mine = mine[row_of[r.slot[mine]] >= 0]
            row = row_of[r.slot[mine]]
            start = r.start_us[mine] + r.offset_us
            np.add.at(wait, row, last[row] - start)
            by_row = np.argsort(row, kind="stable")
            lateness = start[by_row] - first_of_row[row[by_row]]
            late[r.rank] = float(np.cumsum(lateness)[-1]) if len(lateness) else 0.0
            matched[r.rank] = len(mine)
            member_row = np.full(len(r), -1, dtype=np.int32)
            member_row[mine] = row
            members.append((r.rank, member_row))
        table = MatchTable(
            groups=tuple(groups),
            kinds=tuple(kinds),
            group=kg[order],
            kind=kk[order],
            step=kstep[order],
            seq=s.seq[rows].astype(np.int64),
            first_arrival_us=s.first_us[rows],
            last_arrival_us=last,
            before_last_arrival_us=s.second_us[rows],
            last_rank=s.last_rank[rows],
            n_ranks=s.count[rows].astype(np.int64),
            end_time=s.end_time[rows],
            wait_caused_us=wait,
            group_members=tuple(members for _, members in instances),
        )
        result = CrossRankResult(
            ranks=list(self.ranks),
            table=table,
            clock_offset_us={r.rank: r.offset_us for r in self._ranks},
            collectives_per_rank={r.rank: len(r) for r in self._ranks},
            matched_per_rank=matched,
            late_us_per_rank=late,
            member_detail=_MemberDetail(
                table,
                [
                    (r.rank, row, r.start_us, r.end_us, r.offset_us)
                    for (_, row), r in zip(members, self._ranks, strict=True)
                ],
            ),
        )
        result.warnings.extend(self._warnings(len(table)))
        return result

    def _warnings(self, n_matched: int) -> list[str]:
        c = self._counts
        out = []
        if self._unattributed:
            out.append(
                f"rank(s) {', '.join(map(str, sorted(self._unattributed)))}: "
                f"{sum(self._unattributed.values())} collective(s) name no process group (gloo "
                "records none) while their ranks belong to process groups of different members: "
                "those were not matched across ranks (their group is unknown)"
            )
        loose = sorted(r.rank for r in self._ranks if not r.reliable and r.ends_align and len(r))
        if loose and c.loose:
            out.append(
                f"rank(s) {', '.join(map(str, loose))}: collective end times do not line up "
                "with the other ranks' (CPU/gloo collectives or loosely synchronized clocks): "
                "clocks were taken as synchronized and collectives matched by sequence number"
            )
        if c.order:
            out.append(
                f"in {c.order} (group, kind, step) comparisons the ranks hold different numbers "
                "of collectives and their end times do not line up: those were matched by "
                "order, which may pair different collectives"
            )
        if c.end_time:
            out.append(
                f"collective counts or sequences differ between ranks in {c.end_time} of "
                f"{c.end_time + c.sequence} (group, kind, step) comparisons (sampled or "
                "truncated traces?): those collectives were matched by their end times"
            )
        if any(len(r) for r in self._ranks) and not n_matched:
            out.append(
                "no collective could be matched across ranks: the traces may come from "
                "different runs or profiler windows"
            )
        return out


@dataclass(frozen=True)
class _MemberDetail:
    """Builds the per-match `MatchedCollective` objects on demand from each rank's match rows,
    its columns (the summaries' own, by reference) and its clock offset."""

    table: MatchTable
    ranks: list[tuple[int, I32Array, FloatArray, FloatArray, float]]

    def __call__(self) -> list[MatchedCollective]:
        t = self.table
        per_row: list[tuple[list[int], list[float], list[float]]] = [
            ([], [], []) for _ in range(len(t))
        ]
        for rank, row, start, end, offset_us in self.ranks:
            mine = np.flatnonzero(row >= 0)
            aligned_start = start[mine] + offset_us
            aligned_end = end[mine] + offset_us
            for j, i in enumerate(row[mine].tolist()):
                ranks, starts, ends = per_row[i]
                ranks.append(rank)
                starts.append(float(aligned_start[j]))
                ends.append(float(aligned_end[j]))
        return [
            MatchedCollective(
                process_group=t.groups[int(t.group[j])],
                kind=t.kinds[int(t.kind[j])],
                step=int(t.step[j]),
                seq=int(t.seq[j]),
                ranks=ranks,
                start_us=starts,
                end_us=ends,
                method="end-time" if t.end_time[j] else "sequence",
                members=t.members_of(int(t.group[j])),
            )
            for j, (ranks, starts, ends) in enumerate(per_row)
        ]


def match_collectives(ranks: Iterable[RankCollectives | RankColumns]) -> CrossRankResult:
    """Match collectives across ranks (crossrank.py's docstring); pure, any number of ranks,
    any order (a rank given twice: the later one is matched)."""
    given = [r.columns() if isinstance(r, RankCollectives) else r for r in ranks]
    by_rank = sorted(given, key=lambda r: r.rank)
    last = {r.rank: i for i, r in enumerate(by_rank)}
    matcher = CrossRankMatcher()
    for i, r in enumerate(by_rank):
        if last[r.rank] == i:
            matcher.add(r)
    result = matcher.finish()
    result.ranks = [r.rank for r in by_rank]
    return result
