"""torch.profiler memory timelines -> `MemoryTimeline` (Report.memory).

Two formats written by `prof.export_memory_timeline(path, device)`:

- coalesced (`.json` / `.json.gz`, what `zdiag run` writes to RUN_DIR/memory/rank-N.timeline.json.gz):
  `[times_us, sizes]` where `sizes[i]` is `[0, PARAMETER, OPTIMIZER_STATE, INPUT, TEMPORARY,
  ACTIVATION, GRADIENT, AUTOGRAD_DETAIL, unknown]` bytes at `times_us[i]`;
- raw (`.raw.json.gz`): a list of `[time_ns, action, bytes, category]` events, action 1..4 =
  PREEXISTING, CREATE, INCREMENT_VERSION, DESTROY (a version bump is written as a -bytes event
  in the old category and a +bytes event in the new one), category 0..7 in the order above.

Both give bytes per category over time. The series is reduced to at most MAX_MEMORY_POINTS
points, keeping in each bucket the moment of highest total, so the peak is never lost.
Times are ms from the rank's trace start. The memory profiler stamps Unix-epoch time while
Kineto's `ts` is epoch minus `baseTimeNanoseconds`; the clock that puts the timeline next to the
trace is used.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from zdiag.errors import InputError

from ..report import MemoryTimeline
from .decode_batches import not_utf8
from .loader import read_trace_bytes
from .reader import Reader

CATEGORIES = (
    "PARAMETER",
    "OPTIMIZER_STATE",
    "INPUT",
    "TEMPORARY",
    "ACTIVATION",
    "GRADIENT",
    "AUTOGRAD_DETAIL",
    "UNKNOWN",
)
"""torch.profiler._memory_profiler's category order (its `_CATEGORY_TO_INDEX`)."""

MAX_MEMORY_POINTS = 2000
"""Points kept per memory timeline (peak-preserving reduction)."""

_ACTION_PREEXISTING, _ACTION_CREATE, _ACTION_INCREMENT, _ACTION_DESTROY = 1, 2, 3, 4


def is_memory_timeline_name(path: str | Path) -> bool:
    """File names that `export_memory_timeline` outputs usually get (not Kineto traces)."""
    name = Path(path).name.lower()
    return "timeline" in name or name.endswith((".raw.json.gz", ".raw.gz", ".raw.json"))


def load_memory_timeline(
    path: Path,
    rank: int,
    origin_us: float | list[float] | None = None,
    capacity_bytes: int | None = None,
) -> MemoryTimeline:
    """Read a memory timeline file; InputError (one sentence) when it is not one.

    `origin_us`: the time that becomes 0 ms; given several candidates (the trace start on the
    trace clock, and on the Unix-epoch clock that the memory profiler uses), the one closest to
    the timeline's first point is taken.
    """
    raw = read_trace_bytes(path, "memory timeline")
    try:
        data: Any = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        problem = (
            "holds bytes that are not UTF-8 text"
            if not_utf8(exc)
            else "is nested deeper than the decoder's limit"
            if isinstance(exc, RecursionError)
            else f"is not valid JSON ({exc})"
        )
        raise InputError(
            f"{path}: the memory timeline {problem}; re-export it or leave it out."
        ) from None
    times_us, by_cat = _parse(data, path)
    return summarize(times_us, by_cat, rank, origin_us, capacity_bytes)


def _parse(data: Any, path: Path) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """(times_us, bytes[time, category]) from either format."""
    bad = InputError(
        f"{path}: is not a torch.profiler memory timeline (expected [times, sizes] or raw "
        "[time, action, bytes, category] events); re-export it with prof.export_memory_timeline."
    )
    if not isinstance(data, list):
        raise bad
    if len(data) == 2 and isinstance(data[0], list) and isinstance(data[1], list):
        try:
            times = np.asarray(data[0], dtype=np.float64)
            sizes = np.asarray(data[1], dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise bad from None
        bad_shape = sizes.ndim != 2 or times.ndim != 1 or len(sizes) != len(times)
        if bad_shape or sizes.shape[1] < 2 or not np.isfinite(times).all():
            raise bad
        cats = sizes[:, 1 : 1 + len(CATEGORIES)]
        if cats.shape[1] < len(CATEGORIES):
            cats = np.pad(cats, ((0, 0), (0, len(CATEGORIES) - cats.shape[1])))
        return times, cats
    try:
        ev = np.asarray(data, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise bad from None
    if ev.size == 0:
        return np.zeros(0), np.zeros((0, len(CATEGORIES)), dtype=np.int64)
    if ev.ndim != 2 or ev.shape[1] != 4:
        raise bad
    t, action, nbytes, cat = ev[:, 0], ev[:, 1], ev[:, 2], ev[:, 3]
    if ((cat < 0) | (cat >= len(CATEGORIES))).any() or ((action < 1) | (action > 4)).any():
        raise bad
    sign = np.where(action == _ACTION_DESTROY, -1, 1)
    # INCREMENT_VERSION rows already carry their sign in `bytes` (-old, +new).
    sign = np.where(action == _ACTION_INCREMENT, 1, sign)
    delta = sign * np.abs(nbytes)
    delta = np.where(action == _ACTION_INCREMENT, nbytes, delta)
    real = t[t > 0]
    t_min = float(real.min()) if real.size else 0.0
    t_us = np.where(t > 0, t / 1000.0, t_min / 1000.0)
    order = np.argsort(t_us, kind="stable")
    t_us, delta, cat = t_us[order], delta[order], cat[order]
    onehot = np.zeros((len(t_us), len(CATEGORIES)), dtype=np.int64)
    onehot[np.arange(len(t_us)), cat] = delta
    cum = np.cumsum(onehot, axis=0)
    # One point per distinct time: the state after its last event.
    last_of_time = np.append(t_us[1:] != t_us[:-1], True)
    return t_us[last_of_time], cum[last_of_time]


def summarize(
    times_us: npt.NDArray[np.float64],
    by_cat: npt.NDArray[np.int64],
    rank: int,
    origin_us: float | list[float] | None,
    capacity_bytes: int | None,
) -> MemoryTimeline:
    """A MemoryTimeline from per-category bytes over time (peak-preserving reduction)."""
    if len(times_us) == 0:
        return MemoryTimeline(rank=rank, source="memory_timeline", capacity_bytes=capacity_bytes)
    total = by_cat.sum(axis=1)
    peak_at = int(np.argmax(total))
    keep = peak_preserving(total, MAX_MEMORY_POINTS)
    if origin_us is None:
        origin = float(times_us[0])
    elif isinstance(origin_us, list):
        origin = min(origin_us, key=lambda o: abs(float(times_us[0]) - o))
    else:
        origin = origin_us
    return MemoryTimeline(
        rank=rank,
        source="memory_timeline",
        times_ms=[round((float(t) - origin) / 1000.0, 6) for t in times_us[keep]],
        bytes_by_category={
            name: [int(v) for v in by_cat[keep, j]]
            for j, name in enumerate(CATEGORIES)
            if by_cat[:, j].any()
        },
        peak_bytes=int(total[peak_at]),
        peak_category_bytes={
            name: int(by_cat[peak_at, j]) for j, name in enumerate(CATEGORIES) if by_cat[peak_at, j]
        },
        capacity_bytes=capacity_bytes,
    )


def peak_preserving(total: npt.NDArray[np.int64], limit: int) -> npt.NDArray[np.int64]:
    """Indices to keep: all when few, else the max of each of `limit` equal buckets."""
    n = len(total)
    if n <= limit:
        return np.arange(n)
    edges = np.linspace(0, n, limit + 1).astype(np.int64)
    keep = [
        int(lo + np.argmax(total[lo:hi]))
        for lo, hi in itertools.pairwise(edges.tolist())
        if hi > lo
    ]
    return np.asarray(keep, dtype=np.int64)


READER = Reader(
    name="memory-timeline",
    kind="memory-timeline",
    what="torch.profiler memory timeline (export_memory_timeline's JSON, coalesced or raw)",
    sniff=lambda path, head: is_memory_timeline_name(path),
    read=load_memory_timeline,
)
