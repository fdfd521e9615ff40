"""Interval unions and set operations with numpy (sort + merge; no Python loop over events).

An interval set is a pair of float arrays (starts, ends), sorted, disjoint and non-empty
(`start < end`). `union` builds one from arbitrary intervals; `join`, `intersect`, `subtract`
and `clip` combine sets; `total` is the summed length.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Arr = npt.NDArray[np.float64]
IntervalSet = tuple[Arr, Arr]

EMPTY: IntervalSet = (np.zeros(0), np.zeros(0))


def union(starts: Arr, ends: Arr) -> IntervalSet:
    """The union of intervals [starts[i], ends[i]) as a sorted disjoint set."""
    starts = np.asarray(starts, dtype=np.float64)
    ends = np.asarray(ends, dtype=np.float64)
    keep = ends > starts
    if not keep.all():
        starts, ends = starts[keep], ends[keep]
    if starts.size == 0:
        return EMPTY
    order = np.argsort(starts, kind="stable")
    return _merge_sorted(starts[order], ends[order])


def join(*sets: IntervalSet) -> IntervalSet:
    """The union of several interval sets."""
    return union(np.concatenate([a[0] for a in sets]), np.concatenate([a[1] for a in sets]))


def total(a: IntervalSet) -> float:
    """Summed length of a disjoint set."""
    return float((a[1] - a[0]).sum())


def intersect(a: IntervalSet, b: IntervalSet) -> IntervalSet:
    """a ∩ b for two disjoint sorted sets."""
    if a[0].size == 0 or b[0].size == 0:
        return EMPTY
    return _combine(a, b, keep_b=True)


def subtract(a: IntervalSet, b: IntervalSet) -> IntervalSet:
    """a − b for two disjoint sorted sets."""
    if a[0].size == 0 or b[0].size == 0:
        return a
    return _combine(a, b, keep_b=False)


def _combine(a: IntervalSet, b: IntervalSet, keep_b: bool) -> IntervalSet:
    """The part of a inside b (keep_b) or outside it: cut both sets at every boundary into
    elementary segments and keep those whose midpoint a covers and b covers (or not)."""
    pts = np.unique(np.concatenate([a[0], a[1], b[0], b[1]]))
    lo, hi = pts[:-1], pts[1:]
    mid = (lo + hi) / 2
    keep = covers(a, mid) & (covers(b, mid) == keep_b)
    return _merge_sorted(lo[keep], hi[keep])


def clip(a: IntervalSet, start: float, end: float) -> IntervalSet:
    """The part of a inside [start, end)."""
    if a[0].size == 0 or end <= start:
        return EMPTY
    i = int(np.searchsorted(a[1], start, side="right"))
    j = int(np.searchsorted(a[0], end, side="left"))
    if j <= i:
        return EMPTY
    s = a[0][i:j].copy()
    e = a[1][i:j].copy()
    s[0] = max(s[0], start)
    e[-1] = min(e[-1], end)
    return s, e


def clipped_totals(a: IntervalSet, starts: Arr, ends: Arr) -> Arr:
    """For each window [starts[k], ends[k]), the length of a inside it (vectorized).

    Windows must be sorted by start and not overlap each other.
    """
    if a[0].size == 0 or len(starts) == 0:
        return np.zeros(len(starts))
    # Cumulative covered length up to time t: C(t) = sum over blocks of overlap with (-inf, t).
    cum = np.concatenate([[0.0], np.cumsum(a[1] - a[0])])

    def covered_until(t: Arr) -> Arr:
        k = np.searchsorted(a[0], t, side="right")  # blocks starting at or before t
        inside = np.where(
            k > 0, np.minimum(t, a[1][np.maximum(k - 1, 0)]) - a[0][np.maximum(k - 1, 0)], 0.0
        )
        return cum[np.maximum(k - 1, 0)] * (k > 0) + np.maximum(inside, 0.0)

    return covered_until(np.asarray(ends, float)) - covered_until(np.asarray(starts, float))


def covers(a: IntervalSet, t: Arr) -> npt.NDArray[np.bool_]:
    """For each time in `t`, whether it lies in one of `a`'s intervals [start, end)."""
    if not len(a[0]):
        return np.zeros(np.shape(t), dtype=bool)
    k = np.searchsorted(a[0], t, side="right") - 1
    ok = k >= 0
    kk = np.maximum(k, 0)
    return ok & (t < a[1][kk])


def _merge_sorted(starts: Arr, ends: Arr) -> IntervalSet:
    """Merge intervals sorted by start (overlapping or touching ones join) into a disjoint set."""
    if starts.size == 0:
        return EMPTY
    running_end = np.maximum.accumulate(ends)
    # A new block starts where the start lies after every earlier end.
    new_block = np.empty(starts.size, dtype=bool)
    new_block[0] = True
    new_block[1:] = starts[1:] > running_end[:-1]
    first = np.flatnonzero(new_block)
    last = np.append(first[1:] - 1, starts.size - 1)
    return starts[first], running_end[last]
