"""Memory by category from Kineto's `[memory]` instant events (traces recorded with
`profile_memory=True`), for runs without a CUDA snapshot.

Each event is one allocation (`Bytes` > 0) or free (`Bytes` < 0) of the caching allocator, with
the allocator's `Total Allocated` and `Total Reserved` after it, on a thread at a time. There is
no stack, so the category comes from the host ranges around the event on its thread, by the
range rules of the one category table (`categories.py`), first match wins:

1. `OPTIMIZER_STATE`: inside `Optimizer.step` / `Optimizer.zero_grad` ranges;
2. `PARAMETER_UNSHARDED`: inside FSDP ranges that gather (`all_gather`, `unshard`, FSDP2's
   `pre_forward` / `pre_backward`);
3. `GRADIENT`: inside `AccumulateGrad` or FSDP's reduce ranges (`post_backward`, `reduce`);
4. `COMM_BUFFER`: inside a collective's host op (`nccl:*`, `gloo:*`, `c10d::*`,
   `record_param_comms`) outside the above;
5. `AUTOGRAD_DETAIL`: inside the autograd engine's `evaluate_function` ranges (backward);
6. `ACTIVATION`: inside a `ProfilerStep` otherwise (the forward pass and loss);
7. `UNKNOWN`: outside any step.

A free takes the category of its allocation (matched by address); a free of a block allocated
before the recording started is `PREEXISTING`, as are the bytes allocated before the first
event (`Total Allocated` before it). The total is the allocator's own `Total Allocated`; the
replayed sum of `Bytes` is checked against it and a disagreement is a warning. The what-ifs
that need only categories (micro-batch, optimizer state, bf16) are predicted as for snapshots.

HTA (the anchor for memory analysis) reads the memory profiler's timeline export, not these
events (`hta/memory_analysis.py`); docs/memory.md compares both on the same categories.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ..inputs.events import EventKind, MemoryEvents, RankTrace
from ..inputs.memory_timeline import peak_preserving
from ..report import MemoryBreakdown, MemoryTimeline
from .categories import RANGE_CATEGORIES, RANGE_RULES
from .snapshot_whatif import predict

MAX_TIMELINE_POINTS = 2000
REPLAY_TOLERANCE = 0.01
"""Replayed `Bytes` may differ from `Total Allocated` by this share before a warning."""


def _lane_index(trace: RankTrace) -> dict[tuple[object, object], int]:
    return {(lane.pid, lane.tid): i for i, lane in enumerate(trace.lanes)}


def _inside(
    trace: RankTrace,
    event_lane: npt.NDArray[np.int64],
    ts: npt.NDArray[np.float64],
    kinds: Sequence[EventKind],
    parts: Sequence[str],
) -> npt.NDArray[np.bool_]:
    """For each memory event, whether a matching range on its lane covers its time."""
    names = np.array(
        [any(p in n for p in parts) for n in trace.names] if trace.names else [], dtype=bool
    )
    sel = np.isin(trace.kind, np.asarray([int(k) for k in kinds], dtype=np.uint8))
    if names.size:
        sel &= names[trace.name_id]
    out = np.zeros(len(ts), dtype=bool)
    idx = np.flatnonzero(sel)
    if not idx.size:
        return out
    lanes = trace.lane_id[idx]
    for lane in np.unique(lanes):
        rows = idx[lanes == lane]
        starts = trace.ts_us[rows]
        ends = starts + trace.dur_us[rows]
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], np.maximum.accumulate(ends[order])
        mine = np.flatnonzero(event_lane == lane)
        if not mine.size:
            continue
        pos = np.searchsorted(starts, ts[mine], side="right") - 1
        ok = pos >= 0
        out[mine[ok]] = ts[mine[ok]] <= ends[pos[ok]]
    return out


def _device(mem: MemoryEvents) -> tuple[npt.NDArray[np.int64], int | None]:
    """The events of the device with the most events: CUDA first, else the CPU."""
    cuda = mem.device_type == 1
    if cuda.any():
        ids, counts = np.unique(mem.device_id[cuda], return_counts=True)
        dev = int(ids[np.argmax(counts)])
        return np.flatnonzero(cuda & (mem.device_id == dev)), dev
    return np.flatnonzero(mem.device_type == 0), None


def _categories(
    trace: RankTrace,
    mem: MemoryEvents,
    rows: npt.NDArray[np.int64],
    ts: npt.NDArray[np.float64],
    delta: npt.NDArray[np.int64],
) -> npt.NDArray[np.int16]:
    """Each event's index into RANGE_CATEGORIES: the first range rule that covers an
    allocation; a free takes its allocation's category (PREEXISTING without one)."""
    lane_of = _lane_index(trace)
    event_lane = np.fromiter(
        (lane_of.get((mem.pid[r], mem.tid[r]), -1) for r in rows.tolist()), np.int64, len(rows)
    )
    cat = np.full(len(rows), RANGE_CATEGORIES.index("UNKNOWN"), dtype=np.int16)
    decided = np.zeros(len(rows), dtype=bool)
    for name, kinds, parts in RANGE_RULES:
        hit = _inside(trace, event_lane, ts, kinds, parts) & ~decided
        cat[hit] = RANGE_CATEGORIES.index(name)
        decided |= hit
    # frees take their allocation's category
    pre = RANGE_CATEGORIES.index("PREEXISTING")
    open_alloc: dict[int, int] = {}
    addrs = mem.addr[rows].tolist()
    for i, (a, d) in enumerate(zip(addrs, delta.tolist(), strict=True)):
        if d > 0:
            open_alloc[a] = int(cat[i])
        elif d < 0:
            cat[i] = open_alloc.pop(a, pre)
    return cat


def _by_category(
    cat: npt.NDArray[np.int16],
    delta: npt.NDArray[np.int64],
    start: int,
    keep: npt.NDArray[np.int64],
    peak_at: int,
) -> tuple[dict[str, list[int]], dict[str, int], dict[str, int]]:
    """Bytes by category: the kept points of the series, at the peak, and at the end (the
    bytes from before the first event are PREEXISTING's)."""
    by_cat: dict[str, list[int]] = {}
    peak_cat: dict[str, int] = {}
    now_cat: dict[str, int] = {}
    for j, name in enumerate(RANGE_CATEGORIES):
        mask = cat == j
        if not mask.any() and name != "PREEXISTING":
            continue
        cum = np.cumsum(np.where(mask, delta, 0)) + (start if name == "PREEXISTING" else 0)
        if cum[keep].any():
            by_cat[name] = [int(v) for v in cum[keep]]
        if cum[peak_at]:
            peak_cat[name] = int(cum[peak_at])
        if cum[-1]:
            now_cat[name] = int(cum[-1])
    return by_cat, peak_cat, now_cat


def kineto_memory(
    trace: RankTrace, capacity_bytes: int | None = None
) -> tuple[MemoryBreakdown | None, MemoryTimeline | None, list[str]]:
    """The rank's memory breakdown and timeline from its `[memory]` events (None, None when it
    has none), and warnings."""
    mem = trace.memory_events
    if mem is None or not len(mem):
        return None, None, []
    rows, dev = _device(mem)
    rows = rows[np.isfinite(mem.ts_us[rows])]
    if not rows.size:
        return None, None, []
    rows = rows[np.argsort(mem.ts_us[rows], kind="stable")]
    ts = mem.ts_us[rows]
    delta = mem.nbytes[rows]
    total = mem.total_allocated[rows]
    reserved = mem.total_reserved[rows]
    cat = _categories(trace, mem, rows, ts, delta)
    have_total = bool((total >= 0).all())
    start = int(total[0] - delta[0]) if have_total else 0
    replayed = start + np.cumsum(delta)
    warnings = []
    series = total if have_total else replayed
    if have_total:
        worst = int(np.max(np.abs(replayed - total)))
        if worst > REPLAY_TOLERANCE * max(1, int(total.max())):
            warnings.append(
                f"memory events: the replayed allocations differ from the allocator's 'Total "
                f"Allocated' by up to {worst} bytes (events lost?); totals are the allocator's"
            )
    peak_at = int(np.argmax(series))
    keep = peak_preserving(series, MAX_TIMELINE_POINTS)
    by_cat, peak_cat, now_cat = _by_category(cat, delta, start, keep, peak_at)
    origin = trace.trace_start_us
    timeline = MemoryTimeline(
        rank=trace.rank,
        source="kineto memory events",
        times_ms=[round((float(t) - origin) / 1000.0, 6) for t in ts[keep]],
        bytes_by_category=by_cat,
        peak_bytes=int(series[peak_at]),
        peak_category_bytes=peak_cat,
        capacity_bytes=capacity_bytes if dev is not None else None,
    )
    breakdown = MemoryBreakdown(
        rank=trace.rank,
        source="kineto memory events",
        device=dev,
        allocated_bytes=int(series[-1]),
        reserved_bytes=int(reserved[-1]) if reserved[-1] >= 0 else None,
        category_bytes=now_cat,
        peak_bytes=int(series[peak_at]),
        peak_reserved_bytes=int(reserved.max()) if (reserved >= 0).any() else None,
        peak_category_bytes=peak_cat,
        peak_at="replayed",
        peak_time_ms=round((float(ts[peak_at]) - float(ts[0])) / 1000.0, 3),
        history_events=len(rows),
        capacity_bytes=capacity_bytes if dev is not None else None,
        # by category only: no stacks, so no checkpointing or per-unit prediction
        what_if=[
            w
            for w in predict(
                [],
                int(series[peak_at]),
                peak_cat,
                None,
                capacity_bytes=capacity_bytes if dev is not None else None,
                world_size=trace.world_size,
            )
            if w.predicted_peak_bytes is not None
        ],
    )
    return breakdown, timeline, warnings
