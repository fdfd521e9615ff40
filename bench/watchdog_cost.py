"""What the hang watchdog and the failure paths cost, and how fast a hang is dumped.

    python bench/watchdog_cost.py [--runs 3] [--steps 300]

1. The per-step work on the training thread: `HangWatchdog.beat()` plus the session lock
   (timeit, ns per call).
2. Whole runs of `tests/scripts/fail_train.py` (2 gloo ranks, `--no-profile`) with the watchdog
   off (`--hang-timeout 0`) and on (default), interleaved: the median step time from the step
   logs, each run's median, and the spread between runs of the same setting (the noise).
3. Time from hang to dump: a rank stuck at step 3 with `--hang-timeout 3`: how long after the
   timeout the dump was written (the watchdog polls every 0.5 s), from the manifest's hang record.
Prints markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "fail_train.py"


def per_call_ns() -> tuple[float, float]:
    """ns per `beat()` and per uncontended RLock acquire/release."""
    from zdiag.collectors.hang import HangWatchdog

    dog = HangWatchdog(lambda s, t: None, timeout_s=1e9)
    n = 200_000
    beat = min(timeit.repeat(lambda: dog.beat(0.01), number=n, repeat=5)) / n * 1e9
    lock = threading.RLock()

    def locked() -> None:
        with lock:
            pass

    lock_ns = min(timeit.repeat(locked, number=n, repeat=5)) / n * 1e9
    return beat, lock_ns


def run_steps(out: Path, hang_timeout: str, steps: int) -> list[float]:
    cmd = [sys.executable, "-m", "zdiag", "run", "--nproc-per-node", "2", "--no-profile"]
    cmd += ["--hang-timeout", hang_timeout, "--out", str(out), str(SCRIPT), "--steps", str(steps)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    lines = (out / "steps" / "rank-0.jsonl").read_text().splitlines()
    return [json.loads(x)["duration_ms"] for x in lines[10:]]  # past start-up


def hang_to_dump(tmp: Path) -> tuple[float, float]:
    """(stalled_s - timeout_s, timeout_s) of the waiting rank's hang record."""
    out = tmp / "hang"
    cmd = [sys.executable, "-m", "zdiag", "run", "--nproc-per-node", "2", "--hang-timeout", "3"]
    cmd += ["--out", str(out), str(SCRIPT), "--steps", "10", "--hang-at-step", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out / "hang" / "rank-0.json").exists():
        time.sleep(0.5)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    (rank0,) = [
        r for r in json.loads((out / "manifest.json").read_text())["ranks"] if r["rank"] == 0
    ]
    h = rank0["hang"]
    return h["stalled_s"] - h["timeout_s"], h["timeout_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    beat_ns, lock_ns = per_call_ns()
    print(f"| per step on the training thread | beat() {beat_ns:.0f} ns + lock {lock_ns:.0f} ns |")
    medians: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for i in range(args.runs):
            for label, value in (("off", "0"), ("on", "300")):
                durations = run_steps(tmp / f"{label}{i}", value, args.steps)
                medians[label].append(statistics.median(durations))
        late_s, timeout_s = hang_to_dump(tmp)
    for label in ("off", "on"):
        m = medians[label]
        print(
            f"| watchdog {label} | median step {statistics.median(m):.3f} ms | runs "
            f"{', '.join(f'{x:.3f}' for x in m)} ms | spread {max(m) - min(m):.3f} ms |"
        )
    diff = statistics.median(medians["on"]) - statistics.median(medians["off"])
    print(f"| on - off | {diff:+.3f} ms per step |")
    print(f"| hang to dump | {late_s:.2f} s after the {timeout_s:.0f} s timeout |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
