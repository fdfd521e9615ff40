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

It also wraps the functional collectives (``torch.distributed._functional_collectives``, which
DTensor and tensor parallelism call): a call's flight runs from the call to the end of the
``wait_tensor`` that waits for its result, and that wait is the training thread's.

`CommTimer.take(start, end)` at each step end gives ``comm_ms`` (the union of the in-flight
times and the waits within the step, so exposed never exceeds it), ``exposed_comm_ms`` (the
union of the waits), ``compute_ms`` (the step
minus its waits), ``last_collective`` and, when the step's calls ran on groups of more than one
mesh dimension, ``comm_by_dim``: per dimension label (`group_label`: "dp", "tp", "pp", ...
from the DeviceMesh dimension names, "world" for the default group), its ``[comm_ms,
exposed_comm_ms]``. What this sees: collectives called from Python. DDP's gradient all-reduces
run inside its C++ reducer and are not seen. On CUDA a collective returns once queued on its
stream, so the figures are the host's waits, not the kernels' times; analyze a profiled window
(`zdiag analyze`) for the device's split.

It must never slow or break training: nothing is installed unless the monitor is on; the
wrappers do two clock reads and one append per call, and their own errors are caught and switch
the timer off (the collective's own exceptions pass through untouched); at most
`MAX_INTERVALS` intervals are held between two step ends (further ones are counted in
`overflow`, not kept).
"""

from __future__ import annotations

import functools
import inspect
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
    "isend",
    "irecv",
    "batch_isend_irecv",
)
"""The ``torch.distributed`` functions timed (those a torch version lacks are skipped)."""
MAX_INTERVALS = 4096
"""Intervals held between two step ends (a step of a 1000-unit FSDP model issues ~3000)."""
MAX_DIMS = 8
"""Dimension labels kept per run; calls on further ones count under "other"."""
_WRAPPED = "__zdiag_comm_timer_original__"

Interval = tuple[float, float, str]
"""(start, end, dimension label), perf_counter seconds."""


class StepSplit(NamedTuple):
    """One step's split: host-measured milliseconds, the last collective issued, and per
    dimension label ``[comm_ms, exposed_comm_ms]`` (None unless 2+ dimensions were seen)."""

    compute_ms: float
    comm_ms: float
    exposed_comm_ms: float
    last_collective: str | None
    comm_by_dim: dict[str, list[float]] | None = None


def group_label(group: Any) -> str:
    """The mesh dimension a collective's `group` argument names: a DeviceMesh dimension's name
    (from a ``(mesh, dim)`` pair, a 1-D mesh, or the group's ``mesh_<name>`` description, which
    DeviceMesh gives its groups), "world" for the default group, else the group's description
    or "other". Cut to 32 characters."""
    if group is None:
        return "world"
    if isinstance(group, tuple) and len(group) == 2:
        names = getattr(group[0], "mesh_dim_names", None)
        dim = group[1]
        if names and isinstance(dim, int) and 0 <= dim < len(names):
            return str(names[dim])[:32]
        return str(dim)[:32] if isinstance(dim, str) else "other"
    names = getattr(group, "mesh_dim_names", None)
    if names and len(names) == 1:
        return str(names[0])[:32]
    desc = getattr(group, "group_desc", None)
    if isinstance(desc, str) and desc:
        if desc == "default_pg":
            return "world"
        return desc.removeprefix("mesh_")[:32]
    return "other"


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


def _by_dim(
    flight: list[Interval], waits: list[Interval], start: float, end: float
) -> dict[str, list[float]] | None:
    """Per dimension label, [comm_ms, exposed_comm_ms] in [start, end]; None for one label."""
    labels = {iv[2] for iv in flight} | {iv[2] for iv in waits}
    if len(labels) < 2:
        return None
    out = {}
    for label in sorted(labels):
        mine = [iv[:2] for iv in waits if iv[2] == label]
        comm = union_ms([iv[:2] for iv in flight if iv[2] == label] + mine, start, end)
        out[label] = [round(comm, 3), round(union_ms(mine, start, end), 3)]
    return out


def _group_of(args: tuple[Any, ...], kwargs: dict[str, Any], position: int | None) -> Any:
    """A call's `group` argument (keyword, else at its position; None when not passed)."""
    if "group" in kwargs:
        return kwargs["group"]
    if position is not None and position < len(args):
        return args[position]
    return None


def _p2p_group(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The group of `batch_isend_irecv`'s first P2POp."""
    ops = args[0] if args else kwargs.get("p2p_op_list")
    try:
        return ops[0].group  # type: ignore[index]
    except Exception:
        return None


def _group_position(fn: Callable[..., Any]) -> int | None:
    """The positional index of `fn`'s `group` parameter (None when it has none)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("group") if "group" in names else None


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
        self._flight: deque[Interval] = deque()
        self._waits: deque[Interval] = deque()
        self._last: tuple[str, int | None] | None = None
        # id(Work) -> (issue time, label), for Works without a future (their wait ends them)
        self._pending: dict[int, tuple[float, str]] = {}
        self._work_dim: dict[int, str] = {}  # id(Work) -> its label, for the wait
        # id(result tensor) -> (issue time, label) of a functional collective, until its wait
        self._tensors: dict[int, tuple[float, str]] = {}
        self._labels: set[str] = set()  # the dimension labels seen (at most MAX_DIMS)
        self._calling: str | None = None  # the label of the c10d call the thread is inside
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
            self._install_functional()
        except Exception:
            self.uninstall()
            raise
        self.active = True
        return self

    def _install_functional(self) -> None:
        """Wrap the public functional collectives (those taking a `group`) and `wait_tensor`."""
        try:
            from torch.distributed import _functional_collectives as funcol
        except ImportError:  # a torch without them
            return
        for name in sorted(vars(funcol)):
            fn = getattr(funcol, name)
            if (
                name.startswith("_")
                or not inspect.isfunction(fn)
                or fn.__module__ != funcol.__name__
                or hasattr(fn, _WRAPPED)
            ):
                continue
            position = _group_position(fn)
            if position is not None:
                setattr(funcol, name, self._timed_functional(name, fn, position))
                self._patched.append((funcol, name, fn))
        wait = getattr(funcol, "wait_tensor", None)
        if wait is not None and not hasattr(wait, _WRAPPED):
            funcol.wait_tensor = self._timed_wait_tensor(wait)
            self._patched.append((funcol, "wait_tensor", wait))

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
            exposed = union_ms([iv[:2] for iv in waits], start, end)
            last = self._last
            return StepSplit(
                compute_ms=max(0.0, (end - start) * 1000.0 - exposed),
                # a wait is communication too: the done callback that ends a collective's flight
                # runs on the backend's thread and can be scheduled after the wait returns
                comm_ms=union_ms([iv[:2] for iv in flight + waits], start, end),
                exposed_comm_ms=exposed,
                last_collective=_describe(*last) if last else None,
                comm_by_dim=_by_dim(flight, waits, start, end),
            )
        except Exception as exc:
            self._fail(exc)
            return None

    # -- wrappers ------------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        self.active = False
        if self.error is None:
            self.error = f"{type(exc).__name__}: {exc}"

    def _add(self, lane: deque[Interval], interval: Interval) -> None:
        if len(lane) >= MAX_INTERVALS:
            self.overflow += 1
        else:
            lane.append(interval)

    def _label(self, group: Any) -> str:
        """`group_label`; past MAX_DIMS distinct labels in a run, "other"."""
        label = group_label(group)
        if label not in self._labels:
            if len(self._labels) >= MAX_DIMS:
                return "other"
            self._labels.add(label)
        return label

    def _timed_collective(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        timer = self
        position = _group_position(fn)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not timer.active:
                return fn(*args, **kwargs)
            label = timer._call_label(name, args, kwargs, position)
            outer, timer._calling = timer._calling, label
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                timer._calling = outer
            timer._issued(name, args, kwargs, label, start, result)
            return result

        setattr(timed, _WRAPPED, fn)
        return timed

    def _call_label(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], position: int | None
    ) -> str:
        """The dimension label of a c10d call's group ("other" if that fails)."""
        try:
            group = (
                _p2p_group(args, kwargs)
                if name == "batch_isend_irecv"
                else _group_of(args, kwargs, position)
            )
            return self._label(group)
        except Exception as exc:
            self._fail(exc)
            return "other"

    def _issued(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        label: str,
        start: float,
        work: Any,
    ) -> None:
        try:
            self._last = (name, _size_bytes(args, kwargs))
            if isinstance(work, list):  # batch_isend_irecv: one Work per op, waited in turn
                for item in work:
                    self._track(item, start, label)
                return
            if work is None or not hasattr(work, "get_future"):  # blocking: done on return
                interval = (start, time.perf_counter(), label)
                self._add(self._flight, interval)
                if threading.get_ident() == self._thread:
                    self._add(self._waits, interval)
                return
            self._track(work, start, label)
        except Exception as exc:
            self._fail(exc)

    def _track(self, work: Any, start: float, label: str) -> None:
        """Follow an async Work: its future's completion ends its flight, else its wait."""
        if len(self._work_dim) >= MAX_INTERVALS:
            self._work_dim.clear()  # Works nobody waited for
        self._work_dim[id(work)] = label
        try:
            future = work.get_future()
        except RuntimeError:  # this Work has no future: it completes by its wait() at the latest
            if len(self._pending) >= MAX_INTERVALS:
                self._pending.clear()
            self._pending[id(work)] = (start, label)
            return
        future.add_done_callback(lambda _f: self._completed(start, label))

    def _waited(self, start: float, issued: float | None, label: str) -> None:
        """Record a wait that began at `start` (and the flight of its call, issued then)."""
        try:
            end = time.perf_counter()
            self._add(self._waits, (start, end, label))
            if issued is not None:
                self._add(self._flight, (issued, end, label))
        except Exception as exc:
            self._fail(exc)

    def _completed(self, start: float, label: str) -> None:
        """A future's done callback (the backend's thread): the flight issued at `start` ended."""
        try:
            self._add(self._flight, (start, time.perf_counter(), label))
        except Exception as exc:
            self._fail(exc)

    def _timed_wait(self, wait: Callable[..., Any]) -> Callable[..., Any]:
        timer = self

        @functools.wraps(wait)
        def timed_wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            if not timer.active or threading.get_ident() != timer._thread:
                return wait(work, *args, **kwargs)
            issued, label = timer._pending.pop(id(work), (None, ""))
            # a wait inside a blocking collective's own call belongs to that call's dimension
            label = timer._work_dim.pop(id(work), label or timer._calling or "other")
            start = time.perf_counter()
            try:
                return wait(work, *args, **kwargs)
            finally:
                timer._waited(start, issued, label)

        setattr(timed_wait, _WRAPPED, wait)
        return timed_wait

    def _timed_functional(
        self, name: str, fn: Callable[..., Any], position: int
    ) -> Callable[..., Any]:
        """A functional collective: issued now, in flight until `wait_tensor` of its result."""
        timer = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not timer.active:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            timer._functional_issued(name, args, kwargs, position, start, result)
            return result

        setattr(timed, _WRAPPED, fn)
        return timed

    def _functional_issued(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        position: int,
        start: float,
        result: Any,
    ) -> None:
        try:
            self._last = (name, _size_bytes(args, kwargs))
            label = self._label(_group_of(args, kwargs, position))
            if len(self._tensors) >= MAX_INTERVALS:
                self._tensors.clear()  # results nobody waited for
            for item in result if isinstance(result, list | tuple) else (result,):
                # an AsyncCollectiveTensor is waited by `wait_tensor(self.elem)`
                self._tensors[id(getattr(item, "elem", item))] = (start, label)
        except Exception as exc:
            self._fail(exc)

    def _timed_wait_tensor(self, wait: Callable[..., Any]) -> Callable[..., Any]:
        timer = self

        @functools.wraps(wait)
        def timed_wait_tensor(tensor: Any) -> Any:
            if not timer.active or threading.get_ident() != timer._thread:
                return wait(tensor)
            issued = timer._tensors.pop(id(tensor), None)
            if issued is None:  # not a call this timer saw
                return wait(tensor)
            start = time.perf_counter()
            try:
                return wait(tensor)
            finally:
                timer._waited(start, issued[0], issued[1])

        setattr(timed_wait_tensor, _WRAPPED, wait)
        return timed_wait_tensor


def _drain(lane: deque[Interval]) -> list[Interval]:
    out = []
    for _ in range(len(lane)):
        out.append(lane.popleft())
    return out
