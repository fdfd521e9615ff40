"""What recording each gloo group's threads (`collectors/group_threads.py`) adds to a group's
creation, the only time it runs (nothing is added to a collective).

    python bench/group_threads_cost.py [--groups 64]

In one process (a 1-rank gloo world), `new_group([0])` created `--groups` times, the recorder
off and on alternately (its wrapper stays installed; off, it passes straight through), then one
thread listing and the thread-name reads at the thread count reached. Prints markdown for
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist

from zdiag.collectors.group_threads import GroupThreads, thread_ids, thread_name


def main() -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--groups", type=int, default=64)
    args = parser.parse_args()
    recorder = GroupThreads().install()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.groups):
        recorder.active = i % 2 == 1
        start = time.perf_counter()
        dist.new_group([0])
        times[recorder.active].append((time.perf_counter() - start) * 1e3)
    recorder.active = True
    tids = thread_ids()
    listing, names = [], []
    for _ in range(200):
        start = time.perf_counter()
        thread_ids()
        listing.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        for t in list(tids)[:2]:
            thread_name(t)
        names.append((time.perf_counter() - start) * 1e3)
    recorded = recorder.recorded() or {}
    dist.destroy_process_group()
    recorder.uninstall()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{len(recorded)} groups recorded, {len(tids)} threads in the process at the end")
    print("| what | recorder off | recorder on | added |")
    print("|---|---|---|---|")
    print(f"| `new_group` (gloo), per group | {off:.2f} ms | {on:.2f} ms | {on - off:+.2f} ms |")
    listed = statistics.median(listing)
    print(f"| one thread listing ({len(tids)} threads) | - | {listed:.3f} ms | - |")
    print(f"| reading 2 thread names | - | {statistics.median(names):.3f} ms | - |")


if __name__ == "__main__":
    main()
