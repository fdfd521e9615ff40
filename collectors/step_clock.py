"""Where the rank is in its training: the steps finished and when the current one began."""

from __future__ import annotations

import time

from .child_cpu import ChildCpu


class StepClock:
    """Counts the finished steps; `perf_counter` seconds mark the current step's start."""

    def __init__(self) -> None:
        self.step_index = 0  # steps finished so far, so also the index of the current one
        self.step_start = time.perf_counter()
        self._cpu_start = (time.process_time(), time.thread_time())
        self.cpu_ms: tuple[float, float] = (0.0, 0.0)  # the last finished step's CPU time
        self._children = ChildCpu()
        self.children_cpu_ms: float | None = None  # ... of the live child processes

    def restart(self) -> None:
        """The current step starts now (at the session's start)."""
        self.step_start = time.perf_counter()
        self._cpu_start = (time.process_time(), time.thread_time())
        self._children.step_ms(self.step_start)  # the children's CPU counts from here

    def tick(self) -> tuple[int, float, float]:
        """End the current step: (its index, its start, its end); the next one starts now.
        `cpu_ms` then holds the step's CPU time: (every thread of the process, this thread);
        `children_cpu_ms` its live child processes' since their previous reading (child_cpu.py;
        None between readings and where /proc does not say)."""
        now = time.perf_counter()
        cpu = (time.process_time(), time.thread_time())
        self.cpu_ms = ((cpu[0] - self._cpu_start[0]) * 1e3, (cpu[1] - self._cpu_start[1]) * 1e3)
        self.children_cpu_ms = self._children.step_ms(now)
        self._cpu_start = cpu
        step, start = self.step_index, self.step_start
        self.step_index += 1
        self.step_start = now
        return step, start, now

    def since_step_start(self) -> float:
        """Seconds since the current step began."""
        return time.perf_counter() - self.step_start
