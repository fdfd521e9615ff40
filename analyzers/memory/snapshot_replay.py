"""The allocator history of a CUDA snapshot replayed: the end state, the events, the peak.

`device_states` reads the segments into each device's end state (live blocks with their
category, site and module; reserved, pending-free and fragmented bytes). `replay` walks one
device's event history (`device_traces[d]`, oldest first) against that end state: allocated
bytes before each event, the category each event changes, and the blocks live at the peak.
What is damaged in the snapshot is read around and counted in `Damage`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zdiag.errors import InputError

from ..inputs.cuda_snapshot import MAX_DEVICE_BYTES, MAX_STACK_FRAMES
from .categories import PREEXISTING, STACK_CATEGORIES
from .stack_categorizer import Categorizer, Described, block_frames

MAX_DEVICE_INDEX = 1 << 16
"""A segment's `device` beyond this is damaged (read as 0)."""

_LIMIT = 2**62


@dataclass
class Damage:
    """What in a snapshot was not as torch writes it, and how it was read (warnings)."""

    values: int = 0  # sizes, addresses, devices: not a number in range, read as 0
    truncated_stacks: int = 0  # stacks longer than MAX_STACK_FRAMES, read in part
    double_frees: int = 0  # frees of a block the history had already freed: ignored
    size_mismatches: int = 0  # frees whose size differs from their alloc's: the alloc's used
    realloc_live: int = 0  # allocs of an address still live in the history
    times_backwards: int = 0  # events whose time_us is before the previous event's
    replay_dropped: str = ""  # why the history could not be replayed (peak = end state)

    def size(self, v: Any) -> int:
        """A byte count (0 when absent; anything negative, NaN, infinite, not a number or
        beyond MAX_DEVICE_BYTES is counted and read as 0)."""
        if v is None:
            return 0
        if v.__class__ is int and 0 <= v <= MAX_DEVICE_BYTES:
            return v
        if v.__class__ is float and 0 <= v <= MAX_DEVICE_BYTES:  # NaN fails both
            return int(v)
        self.values += 1
        return 0

    def address(self, v: Any, limit: int = _LIMIT) -> int:
        """An address or index (0 when absent; anything else out of [0, limit) is counted and
        read as 0)."""
        if v is None:
            return 0
        if v.__class__ is int and 0 <= v < limit:
            return v
        if v.__class__ is float and 0 <= v < limit and v == int(v):
            return int(v)
        self.values += 1
        return 0

    def warnings(self) -> list[str]:
        """One sentence per kind of damage found."""
        out = []
        if self.values:
            out.append(
                f"{self.values} size, address or device value(s) were not numbers in range "
                "(negative, NaN, infinite or beyond 1 PiB) and were read as 0"
            )
        if self.truncated_stacks:
            out.append(
                f"{self.truncated_stacks} allocation stack(s) had more than {MAX_STACK_FRAMES} "
                "frames; only their innermost frames were read"
            )
        if self.double_frees:
            out.append(
                f"{self.double_frees} free event(s) freed a block already freed; they were ignored"
            )
        if self.size_mismatches:
            out.append(
                f"{self.size_mismatches} free event(s) gave another size than their "
                "allocation; the allocation's size was used"
            )
        if self.realloc_live:
            out.append(
                f"{self.realloc_live} alloc event(s) reused the address of a block still live "
                "in the history"
            )
        if self.times_backwards:
            out.append(
                f"{self.times_backwards} event(s) are timed before the event preceding them; "
                "the timeline is in event order"
            )
        if self.replay_dropped:
            out.append(
                f"the allocator history does not add up ({self.replay_dropped}); the peak is "
                "the end state"
            )
        return out


@dataclass(slots=True)
class Live:
    """One live block: size, category, site, module path."""

    size: int
    category: str
    site: str
    module: str


@dataclass
class DeviceState:
    device: int
    reserved: int = 0
    allocated: int = 0
    pending_free: int = 0
    largest_free: int = 0
    fragmented: int = 0
    segments: int = 0
    live: dict[int, Live] = field(default_factory=dict)
    frames_seen: int = 0
    blocks: int = 0


def device_states(data: dict[str, Any], cat: Categorizer, damage: Damage) -> dict[int, DeviceState]:
    out: dict[int, DeviceState] = {}
    seen: set[int] = set()  # a segment, blocks list or block referenced twice counts once
    segments = data.get("segments")
    segments = segments if isinstance(segments, list) else []
    cat.charge(len(segments))
    for seg in segments:
        if not isinstance(seg, dict) or id(seg) in seen:
            continue
        seen.add(id(seg))
        dev = damage.address(seg.get("device"), MAX_DEVICE_INDEX)
        st = out.setdefault(dev, DeviceState(device=dev))
        st.reserved += damage.size(seg.get("total_size"))
        st.segments += 1
        addr = damage.address(seg.get("address"))
        seg_free = 0
        seg_active = False
        blocks = seg.get("blocks")
        if not isinstance(blocks, list) or id(blocks) in seen:
            continue
        seen.add(id(blocks))
        cat.charge(len(blocks))
        for block in blocks:
            if not isinstance(block, dict) or id(block) in seen:
                continue
            seen.add(id(block))
            size = damage.size(block.get("size"))
            state = block.get("state")
            baddr = damage.address(block.get("address")) if "address" in block else addr
            addr = baddr + size
            if state == "inactive":
                st.largest_free = max(st.largest_free, size)
                seg_free += size
                continue
            seg_active = True
            if state == "active_pending_free":
                st.pending_free += size
                continue
            if state != "active_allocated":
                continue
            frames = block_frames(block)
            st.blocks += 1
            st.frames_seen += 1 if frames else 0
            st.allocated += size
            key = baddr if baddr not in st.live else -(len(st.live) + 1)
            st.live[key] = Live(size, *cat.describe(frames))
        if seg_active:
            st.fragmented += seg_free
    for st in out.values():
        if max(st.reserved, st.allocated + st.pending_free) > MAX_DEVICE_BYTES:
            raise InputError(
                f"the CUDA memory snapshot's segments on cuda:{st.device} add up to "
                f"{max(st.reserved, st.allocated + st.pending_free):,} bytes, more than any "
                "device holds, so it is damaged; re-create it or remove the file."
            )
    return out


def _free_action(entries: list[dict[str, Any]]) -> str:
    """The action that frees a block in this history (the first kind present, in torch's
    order of preference; the scan stops at the first match, usually within the first step)."""
    for a in ("free_completed", "free_requested", "free"):
        if any(e.get("action") == a for e in entries):
            return a
    return "free_completed"


@dataclass
class Replay:
    """The allocator history replayed: per event, allocated bytes and the category changed."""

    time_us: np.ndarray  # float64 per event (event index when the trace has no times)
    delta: np.ndarray  # int64 allocated-bytes change per event
    category: np.ndarray  # int16 into STACK_CATEGORIES
    start_bytes: int  # allocated before the first kept event
    peak_index: int  # -1: the peak is the end state (the snapshot itself)
    peak_live: list[Live]
    has_times: bool
    oom: bool
    gather_bytes: int = 0  # the largest run of consecutive unsharded-parameter allocations
    peak_reserved: int | None = None  # reserved bytes at the peak (segment events replayed)


_CAT_INDEX = {c: i for i, c in enumerate(STACK_CATEGORIES)}
_SEGMENT_SIGN = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


@dataclass
class _Walk:
    """One pass over a device's events: per event the allocated-bytes change, the reserved
    change and the category, with the allocs and frees matched by address."""

    n: int
    free_action: str
    delta: np.ndarray
    seg: np.ndarray
    cats: np.ndarray
    times: np.ndarray
    has_times: bool = True
    oom: bool = False
    open_alloc: dict[int, int] = field(default_factory=dict)  # addr -> index of its alloc
    freed: set[int] = field(default_factory=set)  # addresses freed, not allocated again since
    described: dict[int, Described] = field(default_factory=dict)  # alloc index -> its stack's
    freed_at: dict[int, int] = field(default_factory=dict)  # alloc index -> index of its free
    early_free: list[int] = field(default_factory=list)  # frees of blocks from before the window
    largest_burst: int = 0  # the largest run of consecutive unsharded-parameter allocations


def _walk(events: list[dict[str, Any]], cat: Categorizer, damage: Damage) -> _Walk:
    """Read every event once (see `replay`)."""
    n = len(events)
    w = _Walk(
        n=n,
        free_action=_free_action(events),
        delta=np.zeros(n, np.int64),
        seg=np.zeros(n, np.int64),
        cats=np.full(n, _CAT_INDEX["UNKNOWN"], np.int16),
        times=np.zeros(n, np.float64),
    )
    gathered = _CAT_INDEX["PARAMETER_UNSHARDED"]
    burst = 0
    for i, e in enumerate(events):
        t = e.get("time_us")
        if (t.__class__ is int or t.__class__ is float) and -_LIMIT < t < _LIMIT:
            w.times[i] = t  # (NaN and infinities fail the comparison)
        else:
            w.has_times = False
        action = e.get("action")
        if action == "alloc":
            _alloc(w, i, e, cat, damage)
            # one unit's gather: its allocations come one after the other
            burst = burst + int(w.delta[i]) if w.cats[i] == gathered else 0
            w.largest_burst = max(w.largest_burst, burst)
        elif action == w.free_action:
            _free(w, i, e, damage)
        elif action.__class__ is str and action in _SEGMENT_SIGN:
            w.seg[i] = _SEGMENT_SIGN[action] * _size(e.get("size"), damage)
        elif action == "oom":
            w.oom = True
    return w


def _size(z: Any, damage: Damage) -> int:
    """An event's size (the common case inline, `Damage.size` otherwise)."""
    return z if z.__class__ is int and 0 <= z <= MAX_DEVICE_BYTES else damage.size(z)


def _addr(a: Any, damage: Damage) -> int:
    """An event's address (the common case inline, `Damage.address` otherwise)."""
    return a if a.__class__ is int and 0 <= a < _LIMIT else damage.address(a)


def _alloc(w: _Walk, i: int, e: dict[str, Any], cat: Categorizer, damage: Damage) -> None:
    """Event i allocates: describe its stack, remember it by address."""
    frames = e.get("frames")
    d = cat.describe(frames if frames.__class__ is list else [])
    addr = _addr(e.get("addr"), damage)
    if addr in w.open_alloc:
        damage.realloc_live += 1
    w.open_alloc[addr] = i
    w.freed.discard(addr)
    w.described[i] = d
    w.delta[i] = _size(e.get("size"), damage)
    w.cats[i] = _CAT_INDEX[d[0]]


def _free(w: _Walk, i: int, e: dict[str, Any], damage: Damage) -> None:
    """Event i frees: match it to its alloc (none: a block from before the window)."""
    addr = _addr(e.get("addr"), damage)
    j = w.open_alloc.pop(addr, -1)
    if j < 0 and addr in w.freed:
        damage.double_frees += 1  # the block is gone already: nothing to free
        return
    w.freed.add(addr)
    size = _size(e.get("size"), damage)
    if j < 0:
        w.delta[i] = -size
        w.early_free.append(i)
        w.cats[i] = _CAT_INDEX[PREEXISTING]
    else:
        if size != w.delta[j]:
            damage.size_mismatches += 1
        w.delta[i] = -w.delta[j]
        w.freed_at[j] = i
        w.cats[i] = w.cats[j]


def _start_bytes(w: _Walk, end: DeviceState, damage: Damage) -> int | None:
    """The allocated bytes before the first event (None, with `damage.replay_dropped` set,
    when the history does not add up)."""
    # Totals in float first: a hostile history's sums could overflow int64.
    moved = float(np.abs(w.delta.astype(np.float64)).sum())
    if end.allocated + end.pending_free + moved > MAX_DEVICE_BYTES:
        damage.replay_dropped = "its allocations and frees add up to more than any device holds"
        return None
    start = end.allocated - int(w.delta.sum())
    # Every other category's bytes are its allocs less their own frees (never below 0); the
    # blocks from before the window, less their frees, must not go below 0 either.
    before = start + np.cumsum(np.where(w.cats == _CAT_INDEX[PREEXISTING], w.delta, 0))
    low = min(start, int(before.min()))
    if low < 0:
        # Blocks freed (requested) but not yet completed are not in `end.allocated` while
        # their allocs are in the history: up to their bytes, the deficit is theirs.
        if w.free_action == "free_completed" and -low <= end.pending_free:
            return start - low
        damage.replay_dropped = (
            f"the snapshot's blocks hold {-low:,} bytes less than its events leave allocated"
        )
        return None
    return start


def _live_at(w: _Walk, end: DeviceState, peak_i: int) -> list[Live]:
    """The blocks live after event `peak_i`: the window's allocs not yet freed then, the
    earlier blocks freed after it, and the end state's blocks the window never allocated."""
    live = [
        Live(int(w.delta[j]), *d)
        for j, d in w.described.items()
        if j <= peak_i and w.freed_at.get(j, w.n) > peak_i
    ]
    live += [Live(-int(w.delta[i]), PREEXISTING, "", "") for i in w.early_free if i > peak_i]
    window = set(w.open_alloc)
    live += [b for a, b in end.live.items() if a not in window]
    return live


def replay(
    entries: list[Any], end: DeviceState, cat: Categorizer, damage: Damage | None = None
) -> Replay | None:
    """Replay one device's trace from the end state `end` backwards (None without events, or
    when the history does not add up: `damage.replay_dropped` says why).

    One pass: each `alloc` is described (category, site, module) and remembered by address;
    each free is matched to its alloc (a free with none freed a block from before the window:
    PREEXISTING; a second free of a block is ignored; a free's size is its alloc's). The
    allocated bytes before the first event are the end state's minus the window's net change;
    the blocks live at the peak are the window's allocs not yet freed then, the earlier blocks
    freed after it, and the end state's blocks the window never allocated. Times that run
    backwards make the timeline one in event order.
    """
    damage = damage if damage is not None else Damage()
    cat.charge(len(entries))
    events = [e for e in entries if isinstance(e, dict)]
    if not events:
        return None
    w = _walk(events, cat, damage)
    if w.has_times and w.n > 1:
        backwards = int(np.count_nonzero(np.diff(w.times) < 0))
        if backwards:
            damage.times_backwards += backwards
            w.has_times = False
    times = w.times if w.has_times else np.arange(w.n, dtype=np.float64)
    start = _start_bytes(w, end, damage)
    if start is None:
        return None
    after = start + np.cumsum(w.delta)
    peak_i = int(np.argmax(after))
    peaked = int(after[peak_i]) > end.allocated
    peak_index = peak_i if peaked else -1
    return Replay(
        time_us=times,
        delta=w.delta,
        category=w.cats,
        start_bytes=start,
        peak_index=peak_index,
        peak_live=_live_at(w, end, peak_i) if peaked else [],
        has_times=w.has_times,
        oom=w.oom,
        gather_bytes=w.largest_burst,
        # reserved after event i = the end's reserved less the segment changes after it
        peak_reserved=(
            end.reserved - int(w.seg[peak_index + 1 :].sum()) if peak_index >= 0 else end.reserved
        )
        if end.segments
        else None,
    )
