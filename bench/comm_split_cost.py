"""What the live comm split (`collectors/comm_split.py`) adds to a collective and to a step end.

    python bench/comm_split_cost.py [--rounds 12] [--calls 5000]

On a 1-rank gloo group (the collective itself is then cheapest, so the added time shows most),
timer off and on interleaved: the median time of a blocking `all_reduce` and of an
`async_op=True` one followed by `wait()`, and the time `CommTimer.take()` needs at a step end
after 30 blocking collectives. Prints markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from zdiag.collectors.comm_split import CommTimer


def _per_call_us(fn: object, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - start) / calls * 1e6


def _wait(work: object) -> None:
    """Wait on an async collective's Work (typed loosely: its stub differs across torch versions)."""
    wait = getattr(work, "wait", None)
    if wait is not None:
        wait()


def main() -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    x = torch.ones(256)
    cases = {
        "blocking all_reduce": lambda: dist.all_reduce(x),
        "async all_reduce + wait()": lambda: _wait(dist.all_reduce(x, async_op=True)),
    }
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for setting in ("off", "on"):
            timer = CommTimer().install() if setting == "on" else None
            for name, fn in cases.items():
                times.setdefault((name, setting), []).append(_per_call_us(fn, args.calls))
            if timer is not None:
                now = time.perf_counter()
                timer.take(now - 1e3, now)
                timer.uninstall()
    timer = CommTimer().install()
    takes = []
    for _ in range(2000):
        for _ in range(30):
            dist.all_reduce(x)
        now = time.perf_counter()
        timer.take(now - 1.0, now)
        takes.append((time.perf_counter() - now) * 1e6)
    timer.uninstall()
    dist.destroy_process_group()
    print("| what | timer off | timer on | added |")
    print("|---|---|---|---|")
    for name in cases:
        off, on = (statistics.median(times[(name, s)]) for s in ("off", "on"))
        print(f"| {name}, per call | {off:.1f} µs | {on:.1f} µs | {on - off:+.1f} µs |")
    print(
        f"| `take()` at a step end after 30 collectives | - | {statistics.median(takes):.1f} µs | - |"
    )


if __name__ == "__main__":
    main()
