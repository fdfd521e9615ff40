"""Triggered captures on real processes (issue 29): a 4-rank gloo job whose rank 2 becomes 300 ms
slower from step 30 of 60, followed by `zdiag monitor --headless --json`. The monitor must name
a chronic straggler on rank 2 within 60 s of the slowdown, every rank must record the capture it
asks for, and the capture's own analysis must name rank 2 with `straggler`. The healthy twin
takes no capture and raises no warning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT
from support.live import free_port_pair

SCRIPT = REPO_ROOT / "tests" / "scripts" / "late_straggler.py"
SLOW_RANK, SLOW_FROM, STEPS = 2, 30, 60


def _job(tmp_path: Path, slow: bool) -> tuple[dict[str, Any], Path]:
    port = free_port_pair()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    zdiag = [sys.executable, "-m", "zdiag"]
    monitor = subprocess.Popen(
        [*zdiag, "monitor", "--listen", f"127.0.0.1:{port}", "--headless", "--duration", "300",
         "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    run_dir = tmp_path / ("slow" if slow else "healthy")
    args = ["--steps", str(STEPS)]
    if slow:
        args += ["--slow-rank", str(SLOW_RANK), "--slow-from", str(SLOW_FROM), "--slow-ms", "300"]
    try:
        time.sleep(1.0)
        job = subprocess.run(
            [*zdiag, "run", "--nproc-per-node", "4", "--monitor", f"127.0.0.1:{port}",
             "--out", str(run_dir), str(SCRIPT), *args],
            capture_output=True, text=True, env=env, timeout=240,
        )  # fmt: skip
        assert job.returncode == 0, job.stderr[-2000:]
        time.sleep(2.0)  # the last records, and the capture's analysis
    finally:
        monitor.send_signal(signal.SIGTERM)
        out, err = monitor.communicate(timeout=60)
    assert monitor.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1]), run_dir


def _slowdown_time(run_dir: Path) -> float:
    """When the slow rank's step 30 ended, from its own step log."""
    for line in (run_dir / "steps" / f"rank-{SLOW_RANK}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] == SLOW_FROM:
            return float(rec["time_unix"])
    raise AssertionError("no step 30 in the slow rank's step log")


@pytest.mark.dist
def test_a_late_straggler_is_named_chronic_and_captured_on_every_rank(tmp_path: Path) -> None:
    out, run_dir = _job(tmp_path, slow=True)
    straggler = next(f for f in out["findings"] if f["id"] == "straggler")
    assert straggler["ranks"] == [SLOW_RANK]
    assert straggler["evidence"]["persistence"] == "chronic", straggler["evidence"]
    capture = out["captures"][0]
    assert capture["ranks"] == [0, 1, 2, 3]
    assert set(capture["states"].values()) == {"done"}, capture
    assert capture["requested_at"] - _slowdown_time(run_dir) < 60
    traces = sorted((run_dir / "captures" / f"capture-{capture['id']}").glob("rank-*.json.gz"))
    assert len(traces) == 4
    found = {f["id"]: f for f in capture["findings"]}
    assert found["straggler"]["ranks"] == [SLOW_RANK], capture["findings"]


@pytest.mark.dist
def test_a_healthy_job_takes_no_capture_and_raises_no_warning(tmp_path: Path) -> None:
    out, run_dir = _job(tmp_path, slow=False)
    assert out["captures"] == []
    assert not [f for f in out["findings"] if f["severity"] in ("warning", "critical")], out[
        "findings"
    ]
    assert not (run_dir / "captures").exists()
