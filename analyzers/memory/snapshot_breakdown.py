"""Where a CUDA memory snapshot's memory went: by category now and at the peak, reserved versus
allocated, top allocation sites, and the peak replayed from the allocator's event history.

Input: the dict `torch.cuda.memory._snapshot()` returns (what `_dump_snapshot()` pickles; read
with `inputs/cuda_snapshot.load_snapshot_data`, never torch). Tolerant of torch-version differences:

- `segments[*].blocks[*]`: `state` is `active_allocated`, `active_pending_free` or `inactive`;
  the allocation stack is `frames` (torch >= 2.1) or the last `history` entry's `frames` (older);
  a frame is a dict with `filename`, `line`, `name`. Missing fields count as absent, not errors;
  damaged ones (a NaN or negative size, a double free, times running backwards) are read around
  and counted (`Damage`: one warning per snapshot, the fallback in docs/memory.md).
- `device_traces[d]`: the allocator's ring buffer of events, oldest first. `alloc` adds a block
  (with its stack), `free_completed` removes it (`free_requested` is used when a trace has no
  `free_completed`, as older torch wrote `free`); `segment_alloc`/`segment_free` (and
  `segment_map`/`segment_unmap` for expandable segments) change the reserved bytes; `oom` marks
  the failure. Other actions (`snapshot`, ...) are ignored.

Categories (first match wins; the stack rules of `categories.py`):
`OPTIMIZER_STATE`, `PARAMETER_UNSHARDED` (FSDP gathers), `GRADIENT` (FSDP reduce),
`COMM_BUFFER` (c10d collectives' own allocations, DDP's gradient buckets), `ACTIVATION`,
`AUTOGRAD_DETAIL` (backward temporaries, activation gradients), `MODEL_STATE` (sharded
parameters made after the history started), `UNKNOWN` (stack that matches no rule), and
`PREEXISTING`: blocks with no stack, i.e. allocated before the history started (`zdiag run`
starts it at the first forward, so the sharded model is here).

The peak: allocated bytes at the end of the history are what the segments hold; walking the
events backwards gives the bytes before each event, so the peak of the recorded window and the
blocks live at it are exact for the window the ring buffer kept (what happened before the first
kept event is unknown, and said so).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..inputs.memory_timeline import peak_preserving
from ..report import AllocationSite, MemoryBreakdown, MemoryTimeline, WhatIf
from .categories import PREEXISTING, STACK_CATEGORIES
from .snapshot_replay import Damage, DeviceState, Live, Replay, device_states, replay
from .snapshot_whatif import predict
from .stack_categorizer import Categorizer

MAX_TIMELINE_POINTS = 2000
MAX_SITES = 10


def _sum_by(items: Iterable[Live], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in items:
        k = getattr(b, key)
        out[k] = out.get(k, 0) + b.size
    return out


def _sites(items: Iterable[Live]) -> list[AllocationSite]:
    by: dict[str, list[int]] = {}
    cats: dict[str, dict[str, int]] = {}
    for b in items:
        if not b.site:
            continue
        e = by.setdefault(b.site, [0, 0])
        e[0] += b.size
        e[1] += 1
        c = cats.setdefault(b.site, {})
        c[b.category] = c.get(b.category, 0) + b.size
    top = sorted(by.items(), key=lambda kv: -kv[1][0])[:MAX_SITES]
    return [
        AllocationSite(
            site=s, bytes=v[0], blocks=v[1], category=max(cats[s].items(), key=lambda kv: kv[1])[0]
        )
        for s, v in top
    ]


def _timeline(rp: Replay, rank: int, capacity: int | None, oom: bool) -> MemoryTimeline:
    after = rp.start_bytes + np.cumsum(rp.delta)
    keep = peak_preserving(after, MAX_TIMELINE_POINTS)
    t0 = float(rp.time_us[0]) if len(rp.time_us) else 0.0
    by_cat: dict[str, list[int]] = {}
    peak_cat: dict[str, int] = {}
    peak_at = int(np.argmax(after))
    for j, name in enumerate(STACK_CATEGORIES):
        mask = rp.category == j
        if not mask.any() and name != PREEXISTING:
            continue
        cum = np.cumsum(np.where(mask, rp.delta, 0))
        if name == PREEXISTING:
            # Bytes from before the window: the start state less what the window freed of it.
            cum = cum + rp.start_bytes
        series = cum[keep]
        if series.any():
            by_cat[name] = [int(v) for v in series]
            if cum[peak_at]:
                peak_cat[name] = int(cum[peak_at])
    scale = 1000.0 if rp.has_times else 1.0
    return MemoryTimeline(
        rank=rank,
        source="snapshot" if rp.has_times else "snapshot (event order)",
        times_ms=[round((float(rp.time_us[k]) - t0) / scale, 6) for k in keep],
        bytes_by_category=by_cat,
        peak_bytes=int(after[peak_at]),
        peak_category_bytes=peak_cat,
        capacity_bytes=capacity,
        oom=oom,
    )


def _pick_device(
    devices: dict[int, DeviceState], traces: list[Any], device: int | None
) -> tuple[DeviceState, list[Any]]:
    """The end state and event history of `device` (default, or when absent: the device with
    the most memory in use; without segments, the first device with a history)."""
    if device is None or device not in devices:
        if devices:
            device = max(devices.values(), key=lambda s: s.allocated).device
        else:  # no segments: the first device with a history (the list may repeat one millions
            # of times by reference: no state is made per entry)
            device = next((i for i, t in enumerate(traces) if isinstance(t, list) and t), 0)
    end = devices.get(device) or DeviceState(device=device)
    entries = traces[device] if device < len(traces) and isinstance(traces[device], list) else []
    return end, entries


def _oom_request(entries: list[Any], damage: Damage) -> int | None:
    """The size of the history's last `oom` event's request (None without one)."""
    for e in reversed(entries):
        if isinstance(e, dict) and e.get("action") == "oom":
            return damage.size(e.get("size"))
    return None


def analyze_snapshot(
    data: dict[str, Any],
    rank: int,
    *,
    device: int | None = None,
    capacity_bytes: int | None = None,
    world_size: int | None = None,
    source: str = "",
    warnings: list[str] | None = None,
) -> tuple[MemoryBreakdown, MemoryTimeline | None]:
    """One rank's snapshot -> its breakdown (now and at the peak) and, when the snapshot holds
    an allocator history, its memory timeline. `device`: the CUDA index the rank used (default:
    the device with the most memory in use). What was damaged in it, and how it was read, is
    appended to `warnings` (one sentence each, without the file's name). InputError when it is
    beyond the bounds of a snapshot (MAX_SNAPSHOT_ITEMS, sizes beyond any device)."""
    cat = Categorizer()
    damage = Damage()
    devices = device_states(data, cat, damage)
    traces = data.get("device_traces")
    end, entries = _pick_device(devices, traces if isinstance(traces, list) else [], device)
    rp = replay(entries, end, cat, damage)
    breakdown = _breakdown(
        end, rp, len(entries), _oom_request(entries, damage), rank, source, world_size
    )
    breakdown.capacity_bytes = capacity_bytes
    breakdown.what_if = _what_if(end, rp, breakdown, capacity_bytes, world_size)
    timeline = (
        _timeline(rp, rank, capacity_bytes, breakdown.oom)
        if rp is not None and rp.delta.any()
        else None
    )
    damage.truncated_stacks = cat.truncated
    if warnings is not None:
        warnings.extend(damage.warnings())
    return breakdown, timeline


def _peak_live(end: DeviceState, rp: Replay | None) -> list[Live]:
    """The blocks live at the peak (the end state's when the history has no higher peak)."""
    return rp.peak_live if rp is not None and rp.peak_index >= 0 else list(end.live.values())


def _breakdown(
    end: DeviceState,
    rp: Replay | None,
    history_events: int,
    oom_request: int | None,
    rank: int,
    source: str,
    world_size: int | None,
) -> MemoryBreakdown:
    """The breakdown of one device's end state and replayed peak (without the what-ifs)."""
    peak_live = _peak_live(end, rp)
    peak_bytes = sum(b.size for b in peak_live)
    return MemoryBreakdown(
        rank=rank,
        source=source or "snapshot",
        device=end.device,
        allocated_bytes=end.allocated,
        reserved_bytes=end.reserved,
        pending_free_bytes=end.pending_free,
        largest_free_block_bytes=end.largest_free,
        fragmented_bytes=end.fragmented if end.segments else None,
        segments=end.segments,
        blocks=end.blocks,
        blocks_with_stacks=end.frames_seen,
        category_bytes=_sum_by(end.live.values(), "category"),
        peak_bytes=peak_bytes,
        peak_category_bytes=_sum_by(peak_live, "category"),
        peak_reserved_bytes=_reserved_at_peak(rp, end, peak_bytes),
        peak_at="end of history" if rp is None or rp.peak_index < 0 else "replayed",
        peak_time_ms=(
            round((float(rp.time_us[rp.peak_index]) - float(rp.time_us[0])) / 1000.0, 3)
            if rp is not None and rp.peak_index >= 0 and rp.has_times
            else None
        ),
        history_events=history_events,
        top_sites=_sites(peak_live),
        peak_activation_by_module=_top(
            _sum_by((b for b in peak_live if b.category == "ACTIVATION"), "module")
        ),
        peak_unsharded_by_module=_top(
            _sum_by((b for b in peak_live if b.category == "PARAMETER_UNSHARDED"), "module")
        ),
        oom=oom_request is not None or bool(rp and rp.oom),
        oom_request_bytes=oom_request,
    )


def _what_if(
    end: DeviceState,
    rp: Replay | None,
    breakdown: MemoryBreakdown,
    capacity_bytes: int | None,
    world_size: int | None,
) -> list[WhatIf]:
    """The what-if predictions at the peak (none when no block has a stack)."""
    if not end.frames_seen:
        return []
    return predict(
        _peak_live(end, rp),
        breakdown.peak_bytes or 0,
        breakdown.peak_category_bytes,
        rp.gather_bytes if rp is not None and rp.gather_bytes else None,
        capacity_bytes=capacity_bytes,
        world_size=world_size,
    )


def _reserved_at_peak(rp: Replay | None, end: DeviceState, peak_bytes: int) -> int | None:
    """Reserved bytes at the peak; None when the history lacks the segment events that would
    tell (a replayed reserve below what was allocated then)."""
    reserved = rp.peak_reserved if rp is not None else (end.reserved if end.segments else None)
    return reserved if reserved is not None and reserved >= peak_bytes else None


def _top(by: dict[str, int]) -> dict[str, int]:
    return dict(
        sorted(((k or "(outside any module)", v) for k, v in by.items()), key=lambda kv: -kv[1])[
            :MAX_SITES
        ]
    )
