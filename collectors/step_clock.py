"""Where the rank is in its training: the steps finished and when the current one began."""

from __future__ import annotations

import time


class StepClock:
    """Counts the finished steps; `perf_counter` seconds mark the current step's start."""

    def __init__(self) -> None:
        self.step_index = 0  # steps finished so far, so also the index of the current one
        self.step_start = time.perf_counter()

    def restart(self) -> None:
        """The current step starts now (at the session's start)."""
        self.step_start = time.perf_counter()

    def tick(self) -> tuple[int, float, float]:
        """End the current step: (its index, its start, its end); the next one starts now."""
        now = time.perf_counter()
        step, start = self.step_index, self.step_start
        self.step_index += 1
        self.step_start = now
        return step, start, now

    def since_step_start(self) -> float:
        """Seconds since the current step began."""
        return time.perf_counter() - self.step_start
