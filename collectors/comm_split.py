"""Each step's compute/communication split, measured inside the rank for the live monitor.

`CommTimer.install()` wraps the collectives of ``torch.distributed`` (the names in `COLLECTIVES`,
on ``torch.distributed`` and ``distributed_c10d``, which FSDP2, FSDP1 and DeepSpeed call through)
and ``Work.wait``. It records, with the host's clock:

- each collective's time in flight: from its call to its completion, which is the call's return
  for a blocking collective and its ``Work``'s future completing for an ``async_op`` one (a done
  callback, run by the backend's thread), or, for a ``Work`` without a future (FSDP2's gathers on
  gloo), the return of its ``wait()``;
- the training thread's waits: the time it is blocked in a blocking collective or in
  ``Work.wait()``.

`CommTimer.take(start, end)` at each step end gives ``comm_ms`` (the union of the in-flight
times and the waits within the step, so exposed never exceeds it), ``exposed_comm_ms`` (the
union of the waits), ``compute_ms`` (the step
minus its waits) and ``last_collective``. What this sees: collectives called from Python. DDP's
gradient all-reduces run inside its C++ reducer and are not seen. On CUDA a collective returns
once queued on its stream, so the figures are the host's waits, not the kernels' times; analyze a
profiled window (`zdiag analyze`) for the device's split.

It must never slow or break training: nothing is installed unless the monitor is on; the
wrappers do two clock reads and one append per call, and their own errors are caught and switch
the timer off (the collective's own exceptions pass through untouched); at most
`MAX_INTERVALS` intervals are held between two step ends (further ones are counted in
`overflow`, not kept).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
)
"""The ``torch.distributed`` functions timed (those a torch version lacks are skipped)."""
MAX_INTERVALS = 4096
"""Intervals held between two step ends (a step of a 1000-unit FSDP model issues ~3000)."""
_WRAPPED = "__zdiag_comm_timer_original__"


class StepSplit(NamedTuple):
    """One step's split: host-measured milliseconds and the last collective issued."""

    compute_ms: float
    comm_ms: float
    exposed_comm_ms: float
    last_collective: str | None


def union_ms(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Milliseconds of [start, end] covered by the union of `intervals` (perf_counter seconds)."""
    covered = 0.0
    reach = start
    for lo, hi in sorted(intervals):
        lo, hi = max(lo, reach), min(hi, end)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered * 1000.0


def _size_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The bytes of a collective's first argument when it is a tensor (no reference is kept)."""
    tensor = args[0] if args else next(iter(kwargs.values()), None)
    try:
        return int(tensor.numel()) * int(tensor.element_size())  # type: ignore[union-attr]
    except Exception:
        return None


def _describe(name: str, size_bytes: int | None) -> str:
    """ "all_gather_single 4.0 MiB": the collective and its first tensor argument's size."""
    return name if size_bytes is None else f"{name} {size_bytes / 2**20:.1f} MiB"


class CommTimer:
    """Times the collectives of the thread that installs it; `take` once per step."""

    def __init__(self) -> None:
        """A timer that records nothing until `install`."""
        self.active = False
        self.error: str | None = None  # the first error of the timing code (the timer then stops)
        self.overflow = 0
        self._thread = threading.get_ident()
        # Appended by the training thread (calls, waits) and the backend's (completions): deque
        # appends are atomic; only the training thread pops.
        self._flight: deque[tuple[float, float]] = deque()
        self._waits: deque[tuple[float, float]] = deque()
        self._last: tuple[str, int | None] | None = None
        self._pending: dict[int, float] = {}  # id(Work) -> issue time, for Works without a future
        self._patched: list[tuple[Any, str, Any]] = []  # (owner, name, original)

    def install(self) -> CommTimer:
        """Wrap the collectives and ``Work.wait`` (on the calling thread's behalf); on an error,
        put everything back and raise."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        self._thread = threading.get_ident()
        try:
            for name in COLLECTIVES:
                fn = getattr(distributed_c10d, name, None)
                if fn is None or hasattr(fn, _WRAPPED):
                    continue
                timed = self._timed_collective(name, fn)
                for owner in (distributed_c10d, dist):
                    if getattr(owner, name, None) is fn:
                        setattr(owner, name, timed)
                        self._patched.append((owner, name, fn))
            wait = dist.Work.wait
            if not hasattr(wait, _WRAPPED):
                dist.Work.wait = self._timed_wait(wait)  # type: ignore[method-assign]
                self._patched.append((dist.Work, "wait", wait))
        except Exception:
            self.uninstall()
            raise
        self.active = True
        return self

    def uninstall(self) -> None:
        """Put the originals back (where nobody replaced our wrappers since)."""
        self.active = False
        for owner, name, original in reversed(self._patched):
            if getattr(getattr(owner, name, None), _WRAPPED, None) is original:
                setattr(owner, name, original)
        self._patched.clear()

    def take(self, start: float, end: float) -> StepSplit | None:
        """The split of the step [start, end] (perf_counter seconds); None when switched off.

        Intervals that ended by `end` are consumed; a collective still in flight is counted in
        the step in which it completes, from that step's start.
        """
        if not self.active:
            return None
        try:
            flight = _drain(self._flight)
            waits = _drain(self._waits)
            exposed = union_ms(waits, start, end)
            last = self._last
            return StepSplit(
                compute_ms=max(0.0, (end - start) * 1000.0 - exposed),
                # a wait is communication too: the done callback that ends a collective's flight
                # runs on the backend's thread and can be scheduled after the wait returns
                comm_ms=union_ms(flight + waits, start, end),
                exposed_comm_ms=exposed,
                last_collective=_describe(*last) if last else None,
            )
        except Exception as exc:
            self._fail(exc)
            return None

    # -- wrappers ------------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        self.active = False
        if self.error is None:
            self.error = f"{type(exc).__name__}: {exc}"

    def _add(self, lane: deque[tuple[float, float]], interval: tuple[float, float]) -> None:
        if len(lane) >= MAX_INTERVALS:
            self.overflow += 1
        else:
            lane.append(interval)

    def _timed_collective(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        timer = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not timer.active:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            timer._issued(name, _size_bytes(args, kwargs), start, result)
            return result

        setattr(timed, _WRAPPED, fn)
        return timed

    def _issued(self, name: str, size_bytes: int | None, start: float, work: Any) -> None:
        try:
            self._last = (name, size_bytes)
            if work is None or not hasattr(work, "get_future"):  # blocking: done on return
                interval = (start, time.perf_counter())
                self._add(self._flight, interval)
                if threading.get_ident() == self._thread:
                    self._add(self._waits, interval)
                return
            try:
                future = work.get_future()
            except (
                RuntimeError
            ):  # this Work has no future: it completes by its wait() at the latest
                if len(self._pending) >= MAX_INTERVALS:
                    self._pending.clear()  # Works nobody waited for
                self._pending[id(work)] = start
                return
            future.add_done_callback(lambda _f: self._completed(start))
        except Exception as exc:
            self._fail(exc)

    def _waited(self, start: float, issued: float | None) -> None:
        """Record a wait that began at `start` (and the flight of its Work, issued then)."""
        try:
            end = time.perf_counter()
            self._add(self._waits, (start, end))
            if issued is not None:
                self._add(self._flight, (issued, end))
        except Exception as exc:
            self._fail(exc)

    def _completed(self, start: float) -> None:
        """A future's done callback (the backend's thread): the flight issued at `start` ended."""
        try:
            self._add(self._flight, (start, time.perf_counter()))
        except Exception as exc:
            self._fail(exc)

    def _timed_wait(self, wait: Callable[..., Any]) -> Callable[..., Any]:
        timer = self

        @functools.wraps(wait)
        def timed_wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            if not timer.active or threading.get_ident() != timer._thread:
                return wait(work, *args, **kwargs)
            issued = timer._pending.pop(id(work), None)
            start = time.perf_counter()
            try:
                return wait(work, *args, **kwargs)
            finally:
                timer._waited(start, issued)

        setattr(timed_wait, _WRAPPED, wait)
        return timed_wait


def _drain(lane: deque[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for _ in range(len(lane)):
        out.append(lane.popleft())
    return out
