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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zdiag.errors import InputError

from ..inputs.cuda_snapshot import MAX_DEVICE_BYTES, MAX_SNAPSHOT_ITEMS, MAX_STACK_FRAMES
from ..inputs.memory_timeline import peak_preserving
from ..report import AllocationSite, MemoryBreakdown, MemoryTimeline
from .categories import (
    PREEXISTING,
    STACK_CATEGORIES,
    STACK_RULES,
    stack_category,
    stack_rule_rank,
)
from .snapshot_whatif import predict

MAX_TIMELINE_POINTS = 2000
MAX_SITES = 10
MAX_MODULE_DEPTH = 32
"""User `forward` calls kept in a module path (outermost first; deeper ones end in "...")."""
MAX_LABEL_CHARS = 200
"""Characters of a file name or function name kept in a site label."""
MAX_DEVICE_INDEX = 1 << 16
"""A segment's `device` beyond this is damaged (read as 0)."""

_NOT_USER = ("/torch/", "/site-packages/", "/dist-packages/", "<frozen", "/lib/python3")
_CPP_SUFFIXES = (".cpp", ".h", ".cc", ".cu", ".hpp")


def _is_user(filename: str) -> bool:
    return (
        bool(filename)
        and filename != "??"
        and not filename.endswith(_CPP_SUFFIXES)
        and not any(p in filename for p in _NOT_USER)
    )


Described = tuple[str, str, str]
"""(category, site, module path) of one stack."""

MAX_STACK_CACHE = 500_000
"""Stacks remembered by frame identity (torch shares frame dicts between stacks)."""


FrameInfo = tuple[int, bool, str, str]
"""(rule rank, user code?, site label, module call line or "") of one frame."""

_NOT_A_FRAME: FrameInfo = (len(STACK_RULES), False, "", "")


class Categorizer:
    """Categories, sites and module paths of allocation stacks, within the snapshot's bounds.

    Memoized three times: per stack by the identities of its frame dicts (torch builds every
    stack from one shared table of frames, so a pickle's stacks reuse the same dict objects and
    a stack seen before costs one tuple hash), per frame dict by identity, and per frame by
    (filename, name, line) for the rules and labels (a long file name shared by many frames is
    searched once). A stack is read up to MAX_STACK_FRAMES frames (`truncated` counts the longer
    ones); the frames read, with `charge`'s other items, are bounded by MAX_SNAPSHOT_ITEMS.
    """

    def __init__(self) -> None:
        self._rank: dict[tuple[str, str], int] = {}
        self._stacks: dict[tuple[int, ...], Described] = {}
        self._lists: dict[int, Described] = {}  # by the stack list's own identity
        self._keep: list[list[Any]] = []  # the frames behind cached ids stay alive
        self._frame_ids: dict[int, FrameInfo] = {}
        self._frame_keys: dict[tuple[str, str, int], FrameInfo] = {}
        self.items = 0
        self.truncated = 0

    def charge(self, n: int) -> None:
        """Count `n` more items read (InputError beyond MAX_SNAPSHOT_ITEMS)."""
        self.items += n
        if self.items > MAX_SNAPSHOT_ITEMS:
            raise InputError(
                f"the CUDA memory snapshot holds more than {MAX_SNAPSHOT_ITEMS:,} events, blocks "
                "and stack frames, more than a snapshot is read for (a damaged or hostile file)."
            )

    def describe(self, frames: list[Any]) -> Described:
        """(category, site, module path) of a stack; PREEXISTING without frames."""
        if not frames:
            return (PREEXISTING, "", "")
        got = self._lists.get(id(frames))
        if got is not None:
            return got
        stack = frames
        if len(frames) > MAX_STACK_FRAMES:
            self.truncated += 1
            stack = frames[:MAX_STACK_FRAMES]
        self.charge(len(stack))
        key = tuple(map(id, stack))
        got = self._stacks.get(key)
        if got is None:
            infos = [self._info(f) for f in stack]
            got = (self._category(infos), self._site(infos), self._module_path(infos))
            if len(self._stacks) >= MAX_STACK_CACHE:
                self._stacks.clear()
                self._lists.clear()
                self._keep.clear()
                self._frame_ids.clear()
            self._stacks[key] = got
        self._lists[id(frames)] = got
        self._keep.append(frames)
        return got

    def _info(self, f: Any) -> FrameInfo:
        """One frame's rule rank, user-ness, label and module line (memoized)."""
        got = self._frame_ids.get(id(f))
        if got is not None:
            return got
        if not isinstance(f, dict):
            return _NOT_A_FRAME
        filename, name, line = f.get("filename", ""), f.get("name", "?"), f.get("line", 0)
        # Not str() of a damaged field: a list nested 100k deep would recurse without end.
        filename = filename if isinstance(filename, str) else ""
        name = name if isinstance(name, str) else "?"
        line = line if line.__class__ is int and 0 <= line < _LIMIT else 0
        key = (filename, name, line)
        got = self._frame_keys.get(key)
        if got is None:
            user = _is_user(filename)
            where = f"{_short(filename)}:{line}"
            got = (
                self._frame_rank(filename, "" if name == "?" else name),
                user,
                f"{where} in {_clip(name)}",
                where if user and name == "forward" else "",
            )
            self._frame_keys[key] = got
        self._frame_ids[id(f)] = got
        return got

    def _frame_rank(self, filename: str, name: str) -> int:
        key = (filename, name)
        r = self._rank.get(key)
        if r is None:
            r = self._rank[key] = stack_rule_rank(filename, name)
        return r

    @staticmethod
    def _category(infos: list[FrameInfo]) -> str:
        return stack_category(min((i[0] for i in infos), default=len(STACK_RULES)))

    @staticmethod
    def _site(infos: list[FrameInfo]) -> str:
        first = ""
        for _rank, user, label, _ in infos:
            if not label:
                continue
            if user:
                return label
            first = first or label
        return first

    @staticmethod
    def _module_path(infos: list[FrameInfo]) -> str:
        chain = [i[3] for i in reversed(infos) if i[3]]
        if len(chain) > MAX_MODULE_DEPTH:
            return " > ".join(chain[:MAX_MODULE_DEPTH]) + " > ..."
        return " > ".join(chain)

    def category(self, frames: list[Any]) -> str:
        """The block's category (PREEXISTING without frames)."""
        if not frames:
            return PREEXISTING
        return self._category([self._info(f) for f in frames[:MAX_STACK_FRAMES]])

    def site(self, frames: list[Any]) -> str:
        """The innermost user frame, `file:line in name` (the stack's innermost frame when no
        frame is user code; "" without frames)."""
        return self._site([self._info(f) for f in frames[:MAX_STACK_FRAMES]])

    def module_path(self, frames: list[Any]) -> str:
        """The chain of user `forward` call lines, outermost first (`model.py:120 >
        model.py:88`): the module call an activation was made under ("" when none); at most
        MAX_MODULE_DEPTH calls."""
        return self._module_path([self._info(f) for f in frames[:MAX_STACK_FRAMES]])


def _clip(text: str) -> str:
    """`text`, its last MAX_LABEL_CHARS characters when longer."""
    return text if len(text) <= MAX_LABEL_CHARS else "..." + text[-MAX_LABEL_CHARS:]


def _short(filename: str) -> str:
    parts = filename[-4 * MAX_LABEL_CHARS :].replace("\\", "/").rsplit("/", 2)
    return _clip("/".join(parts[-2:]) if len(parts) > 1 else parts[0])


def block_frames(block: dict[str, Any]) -> list[Any]:
    """A block's allocation stack: `frames`, else the last `history` entry's (older torch)."""
    frames = block.get("frames")
    if isinstance(frames, list) and frames:
        return frames
    history = block.get("history")
    if isinstance(history, list) and history and isinstance(history[-1], dict):
        old = history[-1].get("frames")
        if isinstance(old, list):
            return old
    return []


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
class _Live:
    """One live block: size, category, site, module path."""

    size: int
    category: str
    site: str
    module: str


@dataclass
class _DeviceState:
    device: int
    reserved: int = 0
    allocated: int = 0
    pending_free: int = 0
    largest_free: int = 0
    fragmented: int = 0
    segments: int = 0
    live: dict[int, _Live] = field(default_factory=dict)
    frames_seen: int = 0
    blocks: int = 0


def _devices(data: dict[str, Any], cat: Categorizer, damage: Damage) -> dict[int, _DeviceState]:
    out: dict[int, _DeviceState] = {}
    seen: set[int] = set()  # a segment, blocks list or block referenced twice counts once
    segments = data.get("segments")
    segments = segments if isinstance(segments, list) else []
    cat.charge(len(segments))
    for seg in segments:
        if not isinstance(seg, dict) or id(seg) in seen:
            continue
        seen.add(id(seg))
        dev = damage.address(seg.get("device"), MAX_DEVICE_INDEX)
        st = out.setdefault(dev, _DeviceState(device=dev))
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
            st.live[key] = _Live(size, *cat.describe(frames))
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


def _sum_by(items: Iterable[_Live], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in items:
        k = getattr(b, key)
        out[k] = out.get(k, 0) + b.size
    return out


def _sites(items: Iterable[_Live]) -> list[AllocationSite]:
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
    peak_live: list[_Live]
    has_times: bool
    oom: bool
    gather_bytes: int = 0  # the largest run of consecutive unsharded-parameter allocations
    peak_reserved: int | None = None  # reserved bytes at the peak (segment events replayed)


_CAT_INDEX = {c: i for i, c in enumerate(STACK_CATEGORIES)}
_SEGMENT_SIGN = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def replay(
    entries: list[Any], end: _DeviceState, cat: Categorizer, damage: Damage | None = None
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
    n = len(events)
    if n == 0:
        return None
    free_action = _free_action(events)
    delta = np.zeros(n, np.int64)
    seg = np.zeros(n, np.int64)
    cats = np.full(n, _CAT_INDEX["UNKNOWN"], np.int16)
    times = np.zeros(n, np.float64)
    has_times = True
    oom = False
    open_alloc: dict[int, int] = {}  # addr -> index of its alloc event
    freed: set[int] = set()  # addresses freed and not allocated again since
    described: dict[int, Described] = {}  # alloc index -> its stack's description
    freed_at: dict[int, int] = {}  # alloc index -> index of its free
    early_free: list[int] = []  # frees of blocks allocated before the window
    pre = _CAT_INDEX[PREEXISTING]
    describe = cat.describe
    cat_index = _CAT_INDEX
    gathered = _CAT_INDEX["PARAMETER_UNSHARDED"]
    size_of = damage.size
    address = damage.address
    burst = largest_burst = 0
    for i, e in enumerate(events):
        t = e.get("time_us")
        if (t.__class__ is int or t.__class__ is float) and -_LIMIT < t < _LIMIT:
            times[i] = t  # (NaN and infinities fail the comparison)
        else:
            has_times = False
        action = e.get("action")
        if action == "alloc":
            frames = e.get("frames")
            d = describe(frames if frames.__class__ is list else [])
            a = e.get("addr")
            addr = a if a.__class__ is int and 0 <= a < _LIMIT else address(a)
            if addr in open_alloc:
                damage.realloc_live += 1
            open_alloc[addr] = i
            freed.discard(addr)
            described[i] = d
            z = e.get("size")
            delta[i] = z if z.__class__ is int and 0 <= z <= MAX_DEVICE_BYTES else size_of(z)
            c = cats[i] = cat_index[d[0]]
            # one unit's gather: its allocations come one after the other
            burst = burst + int(delta[i]) if c == gathered else 0
            largest_burst = max(largest_burst, burst)
        elif action == free_action:
            a = e.get("addr")
            addr = a if a.__class__ is int and 0 <= a < _LIMIT else address(a)
            j = open_alloc.pop(addr, -1)
            if j < 0 and addr in freed:
                damage.double_frees += 1  # the block is gone already: nothing to free
                continue
            freed.add(addr)
            z = e.get("size")
            size = z if z.__class__ is int and 0 <= z <= MAX_DEVICE_BYTES else size_of(z)
            if j < 0:
                delta[i] = -size
                early_free.append(i)
                cats[i] = pre
            else:
                if size != delta[j]:
                    damage.size_mismatches += 1
                delta[i] = -delta[j]
                freed_at[j] = i
                cats[i] = cats[j]
        elif action.__class__ is str and action in _SEGMENT_SIGN:
            z = e.get("size")
            seg[i] = _SEGMENT_SIGN[action] * (
                z if z.__class__ is int and 0 <= z <= MAX_DEVICE_BYTES else size_of(z)
            )
        elif action == "oom":
            oom = True
    if has_times and n > 1:
        backwards = int(np.count_nonzero(np.diff(times) < 0))
        if backwards:
            damage.times_backwards += backwards
            has_times = False
    if not has_times:
        times = np.arange(n, dtype=np.float64)
    # Totals in float first: a hostile history's sums could overflow int64.
    moved = float(np.abs(delta.astype(np.float64)).sum())
    if end.allocated + end.pending_free + moved > MAX_DEVICE_BYTES:
        damage.replay_dropped = "its allocations and frees add up to more than any device holds"
        return None
    start = end.allocated - int(delta.sum())
    after = start + np.cumsum(delta)
    # Every other category's bytes are its allocs less their own frees (never below 0); the
    # blocks from before the window, less their frees, must not go below 0 either.
    before = start + np.cumsum(np.where(cats == pre, delta, 0))
    low = min(start, int(before.min()))
    if low < 0:
        # Blocks freed (requested) but not yet completed are not in `end.allocated` while
        # their allocs are in the history: up to their bytes, the deficit is theirs.
        if free_action == "free_completed" and -low <= end.pending_free:
            start -= low
            after -= low  # (`before` is not used again)
        else:
            damage.replay_dropped = (
                f"the snapshot's blocks hold {-low:,} bytes less than its events leave allocated"
            )
            return None
    peak_i = int(np.argmax(after))
    live: list[_Live] = []
    peak_index = -1
    if int(after[peak_i]) > end.allocated:
        peak_index = peak_i
        for j, d in described.items():
            if j <= peak_i and freed_at.get(j, n) > peak_i:
                live.append(_Live(int(delta[j]), *d))
        live += [_Live(-int(delta[i]), PREEXISTING, "", "") for i in early_free if i > peak_i]
        window = set(open_alloc)
        live += [b for a, b in end.live.items() if a not in window]
    return Replay(
        time_us=times,
        delta=delta,
        category=cats,
        start_bytes=start,
        peak_index=peak_index,
        peak_live=live,
        has_times=has_times,
        oom=oom,
        gather_bytes=largest_burst,
        # reserved after event i = the end's reserved less the segment changes after it
        peak_reserved=(
            end.reserved - int(seg[peak_index + 1 :].sum()) if peak_index >= 0 else end.reserved
        )
        if end.segments
        else None,
    )


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
    devices = _devices(data, cat, damage)
    traces = data.get("device_traces")
    traces = traces if isinstance(traces, list) else []
    if device is None or device not in devices:
        if devices:
            device = max(devices.values(), key=lambda s: s.allocated).device
        else:  # no segments: the first device with a history (the list may repeat one millions
            # of times by reference: no state is made per entry)
            device = next((i for i, t in enumerate(traces) if isinstance(t, list) and t), 0)
    end = devices.get(device) or _DeviceState(device=device)
    entries = traces[device] if device < len(traces) and isinstance(traces[device], list) else []
    now = _sum_by(end.live.values(), "category")
    rp = replay(entries, end, cat, damage)
    oom_request = None
    for e in reversed(entries):
        if isinstance(e, dict) and e.get("action") == "oom":
            oom_request = damage.size(e.get("size"))
            break
    peak_live = rp.peak_live if rp is not None and rp.peak_index >= 0 else list(end.live.values())
    peak_bytes = sum(b.size for b in peak_live)
    peak_cats = _sum_by(peak_live, "category")
    unsharded_by_module = _top(
        _sum_by((b for b in peak_live if b.category == "PARAMETER_UNSHARDED"), "module")
    )
    breakdown = MemoryBreakdown(
        rank=rank,
        source=source or "snapshot",
        device=device,
        allocated_bytes=end.allocated,
        reserved_bytes=end.reserved,
        pending_free_bytes=end.pending_free,
        largest_free_block_bytes=end.largest_free,
        fragmented_bytes=end.fragmented if end.segments else None,
        segments=end.segments,
        blocks=end.blocks,
        blocks_with_stacks=end.frames_seen,
        category_bytes=now,
        peak_bytes=peak_bytes,
        peak_category_bytes=peak_cats,
        peak_reserved_bytes=_reserved_at_peak(rp, end, peak_bytes),
        peak_at="end of history" if rp is None or rp.peak_index < 0 else "replayed",
        peak_time_ms=(
            round((float(rp.time_us[rp.peak_index]) - float(rp.time_us[0])) / 1000.0, 3)
            if rp is not None and rp.peak_index >= 0 and rp.has_times
            else None
        ),
        history_events=len(entries),
        top_sites=_sites(peak_live),
        peak_activation_by_module=_top(
            _sum_by((b for b in peak_live if b.category == "ACTIVATION"), "module")
        ),
        peak_unsharded_by_module=unsharded_by_module,
        oom=oom_request is not None or bool(rp and rp.oom),
        oom_request_bytes=oom_request,
        capacity_bytes=capacity_bytes,
        what_if=predict(
            peak_live,
            peak_bytes,
            peak_cats,
            rp.gather_bytes if rp is not None and rp.gather_bytes else None,
            capacity_bytes=capacity_bytes,
            world_size=world_size,
        )
        if end.frames_seen
        else [],
    )
    timeline = (
        _timeline(rp, rank, capacity_bytes, breakdown.oom)
        if rp is not None and rp.delta.any()
        else None
    )
    damage.truncated_stacks = cat.truncated
    if warnings is not None:
        warnings.extend(damage.warnings())
    return breakdown, timeline


def _reserved_at_peak(rp: Replay | None, end: _DeviceState, peak_bytes: int) -> int | None:
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
