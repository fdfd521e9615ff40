"""Does the in-job summary slow training down?  (issue 16.1; figures in docs/benchmarks.md)

`zdiag run` starts `nice -n 19 python -m zdiag.analyzers.engine.summarize_trace` right after a rank
exports its trace. This runs the built-in harness (1 CPU rank, OMP_NUM_THREADS=1) under
`zdiag run --profile-steps W:U:A` with the in-job summary on (default) and off
(`ZDIAG_INJOB_SUMMARY=0`), runs interleaved, and compares the step times of the steps after the
export (from the run's step log), while the summary process runs, plus how long that process
took (the summary file's mtime minus the trace's).

    python bench/injob_summary_cost.py [--repeats 5] [--steps 24]

It runs on a shared machine; run it when the machine is quiet and read the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ["--layers", "2", "--dim", "128", "--heads", "4", "--seq", "128", "--batch", "4"]
HARNESS += ["--vocab", "1024", "--device", "cpu"]
SCHEDULE = (1, 1, 3)  # wait, warmup, active: the trace is exported at the end of step 5


def one_run(summary_on: bool, steps: int, out: Path) -> tuple[list[float], float | None]:
    """Step times (ms) of the steps after the export, and the summary's delay after the trace
    (s; None when off or not written)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        ZDIAG_INJOB_SUMMARY="1" if summary_on else "0",
        PYTHONPATH=str(ROOT),
    )
    w, u, a = SCHEDULE
    cmd = [sys.executable, "-m", "zdiag", "run", "--out", str(out)]
    cmd += ["--profile-steps", f"{w}:{u}:{a}", "--harness", *HARNESS, "--steps", str(steps)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    export_step = w + u + a  # ProfilerStep numbering: steps 0..; exported after step w+u+a-1
    times = []
    for line in (out / "steps" / "rank-0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] >= export_step:
            times.append(float(rec["duration_ms"]))
    trace = out / "traces" / "rank-0.json.gz"
    summary = out / "traces" / "rank-0.summary.zds"
    delay = None
    if summary_on:
        for _ in range(100):  # the summary process may outlive the run
            if summary.exists():
                break
            subprocess.run(["sleep", "0.2"], check=True)
        if summary.exists():
            delay = summary.stat().st_mtime - trace.stat().st_mtime
    return times, delay


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=24)
    a = p.parse_args()
    medians: dict[bool, list[float]] = {True: [], False: []}
    delays: list[float] = []
    first_after: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="zdiag-injob-") as tmp:
        for i in range(a.repeats):
            for on in (True, False):
                times, delay = one_run(on, a.steps, Path(tmp) / f"run-{i}-{int(on)}")
                medians[on].append(statistics.median(times))
                first_after[on].append(statistics.median(times[:3]))
                if delay is not None:
                    delays.append(delay)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(f"harness: 1 CPU rank, {' '.join(HARNESS)}, --steps {a.steps}, schedule {SCHEDULE}")
    for on in (True, False):
        label = "in-job summary on " if on else "in-job summary off"
        m = statistics.median(medians[on])
        f = statistics.median(first_after[on])
        print(
            f"{label}: median step after export {m:.1f} ms (runs: "
            f"{', '.join(f'{x:.1f}' for x in medians[on])}); first 3 steps after export {f:.1f} ms"
        )
    ratio = statistics.median(medians[True]) / statistics.median(medians[False]) - 1
    first = statistics.median(first_after[True]) / statistics.median(first_after[False]) - 1
    print(f"slowdown: {ratio:+.1%} over the steps after export, {first:+.1%} over the first 3")
    if delays:
        print(f"summary written {statistics.median(delays):.2f} s after the trace (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
