"""The CPU time of a rank's child processes (DataLoader workers), read from /proc at each step.

`time.process_time()` counts the rank's own threads only: a DataLoader's worker processes, which
can fill a host's cores, are not in it. At each step end the step clock asks `ChildCpu.step_ms()`
for the CPU time (user + system) the live children of the training thread (and of the main
thread) spent since its previous reading, at most one reading per MIN_INTERVAL_S:
`/proc/<pid>/task/<tid>/children` lists them, and each child's `/proc/<child>/stat` gives its
utime and stime (in clock ticks, 10 ms on most kernels: a single reading is coarse, their sum
over a run is not).

zdiag's own children (`ignore_child`: the in-job trace summary) are left out. Bounded and
contained: at most MAX_CHILDREN children are read per reading, a child that ends
between two reads loses only its last interval, and the first error (no /proc: macOS, Windows,
or a kernel without the `children` file) switches the reading off for the rest of the run, so it
never raises into the training step. Its cost per step is in docs/benchmarks.md.
"""

from __future__ import annotations

import os
import threading

MAX_CHILDREN = 64
"""At most this many children are read per reading."""

MIN_INTERVAL_S = 0.1
"""At most one reading per this many seconds: a step shorter than that gets no reading (None),
and the next reading holds the CPU of every step since the last (the analysis sums them)."""

_ZDIAG_CHILDREN: set[int] = set()
"""zdiag's own child processes (the in-job trace summary): their CPU is zdiag's, not the
training's, and is left out."""


def ignore_child(pid: int) -> None:
    """Leave child `pid` out of the readings (a process zdiag itself started)."""
    _ZDIAG_CHILDREN.add(pid)


try:
    _TICKS_PER_S = float(os.sysconf("SC_CLK_TCK"))
except (AttributeError, ValueError, OSError):  # no sysconf: no /proc either
    _TICKS_PER_S = 0.0


def _read(path: str, size: int) -> bytes:
    """The first `size` bytes of a /proc file (os.open: a third of `open()`'s cost)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def _ticks(pid: int) -> int:
    """utime + stime of process `pid`, in clock ticks (OSError / ValueError when unreadable)."""
    data = _read(f"/proc/{pid}/stat", 1024)
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


class ChildCpu:
    """Per-step CPU time of the rank's live child processes; None once unavailable."""

    def __init__(self) -> None:
        self._last: dict[int, int] = {}
        self._read_at = -MIN_INTERVAL_S
        self._off = _TICKS_PER_S <= 0 or not os.path.isdir("/proc/self/task")

    def _children(self) -> list[int]:
        """The pids of the children of the calling thread and of the main thread."""
        pid = os.getpid()
        tids = {pid, threading.get_native_id()}
        found: list[int] = []
        for tid in sorted(tids):
            found += [int(p) for p in _read(f"/proc/{pid}/task/{tid}/children", 4096).split()]
        return [p for p in found if p not in _ZDIAG_CHILDREN][:MAX_CHILDREN]

    def step_ms(self, now: float) -> float | None:
        """CPU ms the live children spent since the previous reading (a child first seen:
        since it started), `now` being `time.perf_counter()`; None when the previous reading is
        under MIN_INTERVAL_S old, and where /proc does not say (then always None)."""
        if self._off or now - self._read_at < MIN_INTERVAL_S:
            return None
        self._read_at = now
        try:
            ticks: dict[int, int] = {}
            for child in self._children():
                try:
                    ticks[child] = _ticks(child)
                except (OSError, ValueError, IndexError):
                    continue  # it ended meanwhile
        except (OSError, ValueError):
            self._off = True
            return None
        spent = sum(max(0, t - self._last.get(p, 0)) for p, t in ticks.items())
        self._last = ticks
        return spent * 1e3 / _TICKS_PER_S
