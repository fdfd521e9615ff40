"""Failed, killed and hung runs on 2 real gloo ranks leave an analyzable run directory.

The script is `tests/scripts/fail_train.py` (FSDP2, written as a user writes one): a crash in
every rank, a crash in one rank (torchrun then SIGTERMs the other), a rank stuck before its
forward while the other waits in the next all-gather (the job killed by `timeout`), and SIGTERM
in the middle of the profiler window.
"""

from __future__ import annotations

import gzip
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT
from support.live import finish, free_port, reap, start_monitor

pytestmark = pytest.mark.dist

SCRIPT = str(REPO_ROOT / "tests" / "scripts" / "fail_train.py")
TIMEOUT_S = 240


def zdiag(
    *args: str, kill_after_s: float | None = None, kill_when: Callable[[], bool] | None = None
) -> subprocess.CompletedProcess[str]:
    """`zdiag ARGS` in a fresh interpreter; with `kill_after_s`, SIGTERM it then (as `timeout`
    does to a hung job), or as soon as `kill_when()` holds (polled; a second's grace first),
    and collect what it printed."""
    cmd = [sys.executable, "-m", "zdiag", *args]
    if kill_after_s is None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + kill_after_s
    while proc.poll() is None and time.monotonic() < deadline:
        if kill_when is not None and kill_when():
            time.sleep(1.0)
            break
        time.sleep(0.25)
    try:
        out, err = proc.communicate(timeout=0.1)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def hang_written(run_dir: Path, ranks: int = 2) -> Callable[[], bool]:
    """Whether every rank's part of the manifest records its hang dump (the watchdog wrote the
    dump, then the window and the part): what a `timeout` after it would find."""

    def written() -> bool:
        for r in range(ranks):
            part = run_dir / "manifest.d" / f"rank-{r}.json"
            try:
                if not json.loads(part.read_text()).get("hang"):
                    return False
            except (OSError, ValueError):
                return False
        return True

    return written


def steps_logged(run_dir: Path, steps: int, ranks: int = 2) -> Callable[[], bool]:
    """Whether every rank's step log holds at least `steps` lines."""

    def logged() -> bool:
        for r in range(ranks):
            try:
                text = (run_dir / "steps" / f"rank-{r}.jsonl").read_text()
            except OSError:
                return False
            if text.count("\n") < steps:
                return False
        return True

    return logged


def manifest_ranks(run_dir: Path) -> dict[int, dict[str, Any]]:
    data = json.loads((run_dir / "manifest.json").read_text())
    return {r["rank"]: r for r in data["ranks"]}


def profiler_steps(run_dir: Path, rank: int) -> list[int]:
    with gzip.open(run_dir / "traces" / f"rank-{rank}.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    names = {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    return sorted(int(n.split("#")[1]) for n in names)


def no_leftovers(run_dir: Path) -> None:
    left = [
        p
        for p in run_dir.rglob("*")
        if p.is_file() and (".tmp-" in p.name or p.stat().st_size == 0)
    ]
    assert not left, f"unfinished or empty files left: {left}"


def finding(report: dict[str, Any], fid: str) -> dict[str, Any]:
    found = [f for f in report["findings"] if f["id"] == fid]
    assert len(found) == 1, [f["id"] for f in report["findings"]]
    return found[0]


def analyzed_steps(report: dict[str, Any], rank: int) -> list[int]:
    (entry,) = [r for r in report["ranks"] if r["rank"] == rank]
    return [s["step"] for s in entry["steps"]]


def analyzes(run_dir: Path) -> dict[str, Any]:
    out = run_dir.parent / f"{run_dir.name}.report.json"
    res = zdiag("analyze", str(run_dir), "--json", "-o", str(out))
    assert res.returncode == 0, res.stderr
    return dict(json.loads(out.read_text()))


def test_crash_in_every_rank_keeps_both_windows(tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = zdiag("run", "--nproc-per-node", "2", "--out", str(run), SCRIPT, "--crash-at-step", "3")
    assert res.returncode == 1, res.stderr
    ranks = manifest_ranks(run)
    for r in (0, 1):
        assert "injected failure on rank" in ranks[r]["error"]
        assert ranks[r]["trace"] == f"traces/rank-{r}.json.gz"
        assert 3 in profiler_steps(run, r)  # the failing step's events were kept
        assert ranks[r]["error_source"]["file"] == SCRIPT
        assert ranks[r]["error_source"]["code"].startswith("raise RuntimeError")
    no_leftovers(run)
    report = analyzes(run)
    crash = finding(report, "crash")
    assert crash["ranks"] == [0, 1] and crash["steps"] == [3]
    assert crash["evidence"]["torn_down"] == []
    for r in (0, 1):  # the half-finished step 3 is not a step
        assert analyzed_steps(report, r) == [2]
    # the user sees their script and their own traceback, not zdiag's wrapper (issue 30)
    assert "fail_train.py FAILED" in res.stderr and "collectors.bootstrap FAILED" not in res.stderr
    text = re.sub(r"(?m)^\[rank\d+\]: ", "", res.stderr)  # torch's per-rank prefixes
    tracebacks = text.split("Traceback (most recent call last):")[1:]
    assert len(tracebacks) == 2, text[-3000:]  # one per rank: none from the launcher
    assert all("injected failure on rank" in t for t in tracebacks)
    assert all("bootstrap.py" not in t and "runpy" not in t for t in tracebacks)
    assert all(t.lstrip().startswith(f'File "{SCRIPT}"') for t in tracebacks)


def test_crash_in_one_rank_keeps_the_torn_down_peer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = zdiag(
        "run", "--nproc-per-node", "2", "--out", str(run), SCRIPT,
        "--crash-at-step", "3", "--crash-rank", "1",
    )  # fmt: skip
    assert res.returncode != 0
    # the launcher's last line names the culprit, not the torn-down peer
    assert "rank 1 raised " in res.stderr and f"'zdiag analyze {run}'" in res.stderr
    ranks = manifest_ranks(run)
    assert "injected failure on rank 1" in ranks[1]["error"]
    # rank 0 ended by the peer's failure or torchrun's SIGTERM, and wrote what it had
    assert ranks[0]["trace"] == "traces/rank-0.json.gz"
    assert ranks[0]["steps"] >= 3
    assert ranks[0]["error"] is not None or ranks[0].get("ended_by") == "SIGTERM"
    no_leftovers(run)
    report = analyzes(run)
    assert {r["rank"] for r in report["ranks"]} == {0, 1}
    crash = finding(report, "crash")
    assert crash["ranks"] == [1]  # the culprit, not the torn-down peer
    assert crash["evidence"]["torn_down"] == [0]
    (raised,) = crash["evidence"]["raised"]
    assert (raised["rank"], raised["step"]) == (1, 3)
    assert raised["file"] == SCRIPT and "injected failure" in raised["error"]
    assert 3 not in analyzed_steps(report, 1)


def test_hang_dumps_stacks_collective_and_partial_traces(tmp_path: Path) -> None:
    run = tmp_path / "run"
    zdiag(
        "run", "--nproc-per-node", "2", "--out", str(run), "--hang-timeout", "4", SCRIPT,
        "--steps", "12", "--hang-at-step", "3", "--hang-rank", "1",
        kill_after_s=60, kill_when=hang_written(run),
    )  # fmt: skip
    ranks = manifest_ranks(run)
    waiting, stuck = ranks[0]["hang"], ranks[1]["hang"]
    # the waiting rank is in an all-gather of the world group, one sequence number ahead
    assert waiting["op"] is not None and "gather" in waiting["op"]
    assert waiting["group_ranks"] == [0, 1]
    assert waiting["user_code"].startswith("loss = model(x)")
    # the stuck rank is in no collective, and its own frame is the sleep loop
    assert stuck["op"] is None
    assert stuck["user_code"] == "time.sleep(0.5)"
    assert stuck["user_file"].endswith("fail_train.py")
    for r in (0, 1):
        assert ranks[r]["steps"] == 3
        assert ranks[r]["trace"] == f"traces/rank-{r}.json.gz"
        dump = json.loads((run / ranks[r]["hang"]["dump"]).read_text())
        assert any(t["training_thread"] for t in dump["threads"])
    fr = json.loads((run / waiting["dump"]).read_text())["flight_recorder"]
    if fr is not None:  # gloo keeps flight-recorder entries on torch >= 2.7
        last = fr["entries"][-1]
        assert last["collective_seq_id"] == waiting["sequence_number"]
    no_leftovers(run)
    report = analyzes(run)
    hang = finding(report, "hang")
    assert hang["ranks"] == [1]  # the rank that never arrived, not the waiting one
    assert hang["evidence"]["waiting_ranks"] == [0]
    assert hang["evidence"]["sequence_number"] == waiting["sequence_number"]
    assert "time.sleep(0.5)" in hang["title"]
    for r in (0, 1):
        assert 3 not in analyzed_steps(report, r)


def test_sigterm_mid_window_keeps_the_steps_so_far(tmp_path: Path) -> None:
    run = tmp_path / "run"
    zdiag(
        "run", "--nproc-per-node", "2", "--out", str(run), "--profile-steps", "1:1:500", SCRIPT,
        "--steps", "2000", "--step-sleep", "0.05",
        kill_after_s=25, kill_when=steps_logged(run, 8),
    )  # fmt: skip
    ranks = manifest_ranks(run)
    for r in (0, 1):
        assert ranks[r]["ended_by"] is not None and ranks[r]["ended_by"].startswith("SIGTERM")
        steps = profiler_steps(run, r)
        assert len(steps) >= 2 and steps[0] == 2  # the window from its first step on
        lines = (run / "steps" / f"rank-{r}.jsonl").read_text().splitlines()
        assert len(lines) >= steps[-1]  # the step log was flushed up to the signal
    no_leftovers(run)
    analyzes(run)


def test_the_monitor_shows_the_hung_rank_within_seconds_of_the_dump(tmp_path: Path) -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    monitor = start_monitor(target, duration_s=45)
    run = tmp_path / "run"
    try:
        zdiag(
            "run", "--nproc-per-node", "2", "--out", str(run), "--monitor", target,
            "--hang-timeout", "4", SCRIPT, "--steps", "12", "--hang-at-step", "3",
            kill_after_s=35, kill_when=hang_written(run),
        )  # fmt: skip
        time.sleep(1.0)  # the hang records reach the monitor right after the dump
        monitor.send_signal(signal.SIGTERM)  # a headless monitor prints its summary and exits
        summary = finish(monitor, timeout_s=60)
    finally:
        reap(monitor)
    rows = {r["rank"]: r for r in summary["rows"]}
    for rank in (0, 1):  # both ranks stopped finishing steps: both show where they are
        assert rows[rank]["status"] == "hung", rows[rank]
    assert "gather" in rows[0]["hung_in"] and "fail_train.py" in rows[0]["hung_in"]
    assert rows[1]["hung_in"] == "at fail_train.py:66"
    # every record, the hang records included (sent right after the dump), arrived within 5 s
    assert summary["lag_max_ms"] is not None and summary["lag_max_ms"] < 5000
