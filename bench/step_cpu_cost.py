"""What the step clock's CPU readings cost per step: `StepClock.tick()` with the children's CPU
(collectors/child_cpu.py) read from /proc, against the same tick without it, with 0 and 4 live
child processes (sleeping, as idle DataLoader workers would be).

    PYTHONPATH=. .venv/bin/python bench/step_cpu_cost.py

Prints one Markdown row per case: the best of REPEATS runs of TICKS ticks, in µs per tick.
"""

from __future__ import annotations

import subprocess
import sys
import time

from zdiag.collectors.step_clock import StepClock

TICKS = 2000
REPEATS = 7


def per_tick_us(clock: StepClock, reading_every_tick: bool) -> float:
    """Best of REPEATS: µs per `tick()` (`reading_every_tick`: the children read at every tick,
    as on steps of 0.1 s or more, the interval check defeated)."""
    best = float("inf")
    for _ in range(REPEATS):
        t = time.perf_counter()
        for _ in range(TICKS):
            if reading_every_tick:
                clock._children._read_at = -1.0
            clock.tick()
        best = min(best, (time.perf_counter() - t) / TICKS * 1e6)
    return best


def main() -> None:
    print(
        "| live children | tick without children's CPU (µs) | tick reading them (µs) | added "
        "(µs) | tick between readings (µs) |"
    )
    print("|---:|---:|---:|---:|---:|")
    for n in (0, 4):
        kids = [
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            for _ in range(n)
        ]
        try:
            time.sleep(0.5)
            plain = StepClock()
            plain._children._off = True  # the reading switched off
            with_kids = StepClock()
            assert with_kids._children.step_ms(time.perf_counter() + 1.0) is not None
            off, on = per_tick_us(plain, False), per_tick_us(with_kids, True)
            between = per_tick_us(with_kids, False)
            print(f"| {n} | {off:.1f} | {on:.1f} | {on - off:+.1f} | {between:.1f} |")
        finally:
            for k in kids:
                k.kill()
                k.wait()


if __name__ == "__main__":
    main()
