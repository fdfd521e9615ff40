"""Always on (issue 29.1): what `zdiag run --no-profile --monitor` costs a training run, and how
long a late straggler takes to be named and captured.

1. **Cost.** The built-in harness (1 CPU rank, bench/run_overhead.py's shape) bare, against
   `zdiag run --no-profile --monitor HOST:PORT` with a headless `zdiag monitor` listening: step
   records, the comm split, the capture check, all on. Runs interleaved; per run the median step
   time (first `--skip` steps left out); then the median and IQR over the repeats.
2. **Latency.** tests/scripts/late_straggler.py on 4 gloo ranks, rank 2 300 ms slower from step
   30 of 60, followed by a headless monitor: the seconds from the slow rank's step 30 (its step
   log) to the capture request (the monitor's JSON), and the capture's own finding.

    python bench/always_on_cost.py [--repeats 5] [--steps 40]

It runs on a shared machine; the cost figure is only as good as the machine is quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from run_overhead import HARNESS, median_iqr, run  # noqa: E402


def _port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def _monitor(port: int, seconds: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "zdiag", "monitor", "--listen", f"127.0.0.1:{port}",
           "--headless", "--duration", str(seconds), "--json"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _stop(monitor: subprocess.Popen[str]) -> dict[str, object]:
    monitor.send_signal(signal.SIGTERM)
    out, _ = monitor.communicate(timeout=60)
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


def cost(repeats: int, steps: int, skip: int) -> dict[str, tuple[float, float]]:
    """Median step time per run: bare harness vs `zdiag run --no-profile --monitor`."""
    harness = [*HARNESS, "--steps", str(steps)]
    bare: list[float] = []
    on: list[float] = []
    port = _port_pair()
    monitor = _monitor(port, 3600)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(repeats):
                times, _ = run([sys.executable, "-m", "zdiag.harness", *harness])
                bare.append(statistics.median(t for s, t in times.items() if s > skip))
                times, _ = run([
                    sys.executable, "-m", "zdiag", "run", "--no-profile", "--monitor",
                    f"127.0.0.1:{port}", "--out", str(Path(tmp) / f"on-{i}"), "--harness",
                    *harness,
                ])  # fmt: skip
                on.append(statistics.median(t for s, t in times.items() if s > skip))
    finally:
        records = _stop(monitor).get("records")
    print(f"(the monitor received {records} records)")
    return {"bare": median_iqr(bare), "always on": median_iqr(on)}


def latency() -> dict[str, object]:
    """Seconds from a rank's slowdown to the capture request, and the capture's findings."""
    port = _port_pair()
    monitor = _monitor(port, 600)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            time.sleep(1)
            job = subprocess.run(
                [sys.executable, "-m", "zdiag", "run", "--nproc-per-node", "4", "--monitor",
                 f"127.0.0.1:{port}", "--out", f"{tmp}/run",
                 str(ROOT / "tests" / "scripts" / "late_straggler.py"), "--slow-rank", "2"],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            time.sleep(3)
        finally:
            out = _stop(monitor)
        if job.returncode != 0:
            return {"error": job.stderr[-500:]}
        steps = [json.loads(line) for line in Path(f"{tmp}/run/steps/rank-2.jsonl").open()]
        slowed = next(s["time_unix"] for s in steps if s["step"] == 30)
        captures = out.get("captures") or []
        if not isinstance(captures, list) or not captures:
            return {"captures": 0}
        c = captures[0]
        return {
            "seconds_to_request": round(c["requested_at"] - slowed, 2),
            "start_step": c["start_step"],
            "states": c["states"],
            "findings": [(f["id"], f["ranks"]) for f in c["findings"] or []],
        }


def main() -> int:
    """Both measurements, printed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5)
    a = p.parse_args()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.node()}: "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    for name, (median, iqr) in cost(a.repeats, a.steps, a.skip).items():
        print(f"{name}: median step {median:.3f} ms (IQR {iqr:.3f}) over {a.repeats} runs")
    print(json.dumps(latency()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
