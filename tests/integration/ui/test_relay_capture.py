"""Triggered captures through a per-node relay, on real processes (issue 29): 4 gloo ranks
publish to `zdiag monitor --relay`, which forwards to `zdiag monitor --headless --json`, all
with a token (CURVE on every hop). Rank 0 is 250 ms slower than the others from the first step:
the monitor names it a chronic straggler and asks for a capture, the request comes back down
through the relay, every rank records it, and the capture's analysis names rank 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from support.live import free_port_pair, reap

SCRIPT = REPO_ROOT / "tests" / "scripts" / "late_straggler.py"
RANKS, STEPS, SLOW_RANK = 4, 24, 0


@pytest.mark.dist
def test_a_capture_reaches_every_rank_through_a_relay(tmp_path: Path) -> None:
    monitor_at = f"127.0.0.1:{free_port_pair()}"
    relay_at = f"127.0.0.1:{free_port_pair()}"  # its control port: the next one
    env = dict(os.environ, PYTHONUNBUFFERED="1", ZDIAG_MONITOR_TOKEN="relay-test-token")
    zdiag = [sys.executable, "-m", "zdiag"]
    monitor = subprocess.Popen(
        [*zdiag, "monitor", "--listen", monitor_at, "--headless", "--duration", "120", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    relay = subprocess.Popen(
        [*zdiag, "monitor", "--relay", "--listen", relay_at, "--forward", monitor_at],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    run_dir = tmp_path / "run"
    try:
        job = subprocess.run(
            [*zdiag, "run", "--nproc-per-node", str(RANKS), "--monitor", relay_at,
             "--out", str(run_dir), str(SCRIPT), "--steps", str(STEPS),
             "--slow-rank", str(SLOW_RANK), "--slow-from", "0", "--slow-ms", "250"],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert job.returncode == 0, job.stderr[-2000:]
        relay.send_signal(signal.SIGTERM)
        _, relay_err = relay.communicate(timeout=10)
        monitor.send_signal(signal.SIGTERM)
        out, err = monitor.communicate(timeout=60)
    finally:
        reap(relay, monitor)
    assert relay.returncode == 0 and monitor.returncode == 0, err[-2000:]
    counts = re.search(r"forwarded (\d+), .*capture requests forwarded (\d+)", relay_err)
    assert counts and int(counts[1]) > 0 and int(counts[2]) > 0, relay_err[-2000:]
    capture = json.loads(out.strip().splitlines()[-1])["captures"][0]
    assert capture["reason"].startswith("straggler"), capture
    assert capture["ranks"] == list(range(RANKS))
    assert set(capture["states"].values()) == {"done"}, capture
    traces = sorted((run_dir / "captures" / f"capture-{capture['id']}").glob("rank-*.json.gz"))
    assert len(traces) == RANKS
    found = {f["id"]: f for f in capture["findings"]}
    assert found["straggler"]["ranks"] == [SLOW_RANK], capture["findings"]
