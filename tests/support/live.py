"""Live-stream test helpers: step records, a collecting loop, free ports (and port pairs), and
real rank and monitor processes (a fake rank publishing records, `zdiag monitor --headless
--json`)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Any

from zdiag.live.receiver import LiveReceiver


def record(rank: int = 0, step: int = 0, host: str = "node0") -> dict[str, Any]:
    """A step record with the fields the collectors send."""
    return {
        "rank": rank,
        "host": host,
        "step": step,
        "step_time_ms": 100.0,
        "mem_allocated_bytes": 1 << 30,
        "mem_reserved_bytes": 2 << 30,
        "mem_peak_bytes": 3 << 30,
        "samples_per_s": 80.0,
    }


def collect(receiver: LiveReceiver, want: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Poll `receiver` until `want` records arrived or `timeout_s` passed."""
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += receiver.poll(timeout_ms=100)
    return got


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1."""
    r = LiveReceiver("127.0.0.1:0")
    port = r.endpoint.port
    r.close()
    return port


def free_port_pair() -> int:
    """A port on 127.0.0.1 whose next one was free a moment ago too: a monitor's or a relay's
    data and control ports (`wire.control_endpoint`)."""
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


RANK = r"""
import json, os, sys, time
from zdiag.live.publisher import publisher_from_env
rank, steps, dt = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
pub = publisher_from_env(rank, "node0")
costs = []
start = time.perf_counter()
for step in range(steps):
    time.sleep(dt)
    t = time.perf_counter()
    pub.publish({"rank": rank, "host": "node0", "step": step, "step_time_ms": dt * 1000,
                 "mem_allocated_bytes": 1e9, "mem_reserved_bytes": 2e9, "mem_peak_bytes": 3e9,
                 "samples_per_s": 8 / dt})
    costs.append(time.perf_counter() - t)
wall = time.perf_counter() - start
pub.close()
costs.sort()
print(json.dumps({"wall_s": wall, "steps": steps, "p50_us": costs[len(costs) // 2] * 1e6,
                  "max_us": costs[-1] * 1e6, "sent": pub.sent, "dropped": pub.dropped}))
"""


def start_rank(rank: int, steps: int, dt: float, target: str) -> subprocess.Popen[str]:
    env = {"ZDIAG_MONITOR": target, "PATH": "/usr/bin:/bin"}
    return subprocess.Popen(
        [sys.executable, "-c", RANK, str(rank), str(steps), str(dt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def start_monitor(target: str, duration_s: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "zdiag", "monitor", "--headless", "--json"),
            *("--listen", target, "--duration", str(duration_s)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout_s: float = 30) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


def reap(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()
