"""`zdiag monitor` on the command line: one-line errors, headless summaries, the relay, and a real
2-rank harness run (`zdiag run --monitor`) followed by a real monitor process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.live import finish, free_port, reap, start_monitor, start_rank


def zdiag(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zdiag", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--listen", "0.0.0.0:5577"), "token"),
        (("--listen", "nonsense"), "HOST:PORT"),
        (("--json",), "--headless"),
        (("--relay",), "--forward"),
        (("--forward", "127.0.0.1:1"), "--relay"),
        (("--headless", "--duration", "0"), "--duration"),
        (("--every", "1"), "--headless"),
    ],
)
@pytest.mark.slow  # starts a program
def test_mistakes_are_one_line(args: tuple[str, ...], needle: str) -> None:
    res = zdiag("monitor", *args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr


@pytest.mark.slow  # starts a program
def test_tui_needs_a_terminal() -> None:
    res = zdiag("monitor", "--listen", f"127.0.0.1:{free_port()}")
    assert res.returncode == 2 and "--headless" in res.stderr


@pytest.mark.slow  # starts a program
def test_busy_port_is_one_line() -> None:
    port = free_port()
    first = start_monitor(f"127.0.0.1:{port}", 20)
    try:
        time.sleep(1.0)
        res = zdiag("monitor", "--headless", "--duration", "1", "--listen", f"127.0.0.1:{port}")
        assert res.returncode == 2 and "cannot listen" in res.stderr
    finally:
        reap(first)


@pytest.mark.slow  # starts a program
def test_headless_with_nothing_received() -> None:
    port = free_port()
    res = zdiag(
        *("monitor", "--headless", "--duration", "1", "--every", "0.4"),
        *("--listen", f"127.0.0.1:{port}"),
    )
    assert res.returncode == 0, res.stderr
    assert "0 ranks" in res.stdout and "no rank has reported yet" in res.stdout
    assert res.stdout.count("zdiag monitor (listening") == 3  # two periodic, one final


@pytest.mark.slow
def test_relay_process_forwards_ranks_to_the_monitor() -> None:
    monitor_at = f"127.0.0.1:{free_port()}"
    relay_at = f"127.0.0.1:{free_port()}"
    monitor = start_monitor(monitor_at, 30)
    relay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zdiag",
            "monitor",
            "--relay",
            "--listen",
            relay_at,
            "--forward",
            monitor_at,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ranks = []
    try:
        time.sleep(1.0)
        ranks = [start_rank(r, steps=30, dt=0.1, target=relay_at) for r in range(2)]
        for r in ranks:
            finish(r)
        time.sleep(2.5)  # one relay stats record
        monitor.send_signal(signal.SIGTERM)
        seen = finish(monitor)
        relay.send_signal(signal.SIGTERM)
        _, relay_err = relay.communicate(timeout=10)
    finally:
        reap(monitor, relay, *ranks)
    assert relay.returncode == 0
    assert "forwarded" in relay_err
    assert sorted(r["rank"] for r in seen["rows"]) == [0, 1]
    assert {r["step"] for r in seen["rows"]} == {29}
    assert seen["relays"] == 1


@pytest.mark.dist
@pytest.mark.slow
def test_real_harness_run_publishes_to_a_real_monitor(tmp_path: Path) -> None:
    """`zdiag run --monitor` on 2 gloo ranks of the built-in harness -> `zdiag monitor --headless`:
    every step arrives with its comm split, each rank ends "finished", and the healthy run raises
    no memory-creep (its first steps grow the process's memory, a rise that stops by itself)."""
    target = f"127.0.0.1:{free_port()}"
    monitor = start_monitor(target, 120)
    steps = 16
    try:
        time.sleep(0.5)
        run = zdiag(
            *("run", "--no-profile", "--out", str(tmp_path / "run"), "--monitor", target),
            *("--nproc-per-node", "2", "--harness", "--layers", "2", "--dim", "64"),
            *("--seq", "32", "--steps", str(steps)),
        )
        assert run.returncode == 0, run.stderr[-2000:]
        time.sleep(0.5)
        monitor.send_signal(signal.SIGTERM)
        seen = finish(monitor)
    finally:
        reap(monitor)
    rows = {r["rank"]: r for r in seen["rows"]}
    assert sorted(rows) == [0, 1]
    assert all(r["step"] == steps - 1 and r["step_time_ms"] > 0 for r in rows.values()), rows
    assert {r["status"] for r in rows.values()} == {"finished"}
    # FSDP2 on gloo waits for its gathers and reductions: the comm column has values
    assert all(r["exposed_comm_ms"] > 0 for r in rows.values()), rows
    # per rank, its steps and its end-of-run record: each arrived, or was counted as dropped
    assert seen["records"] + sum(r["dropped"] for r in rows.values()) == 2 * (steps + 1)
    assert seen["records"] >= 2 * steps and seen["rejected"] == 0
    assert "memory-creep" not in {f["id"] for f in seen["findings"]}
    assert json.dumps(seen)  # the summary is plain JSON
