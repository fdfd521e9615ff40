"""The hang watchdog and the signal flush in one process (the multi-rank runs: test_failed_runs.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from zdiag.collectors import hang
from zdiag.collectors.rundir import make_run_dir, remove_unfinished_writes


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_watchdog_fires_once_per_stall_and_rearms_after_a_step() -> None:
    clock = FakeClock()
    fired: list[tuple[float, float]] = []
    dog = hang.HangWatchdog(lambda s, t: fired.append((s, t)), timeout_s=10.0, clock=clock)
    dog.beat(0.5)
    clock.now += 9.9
    assert not dog.check()
    clock.now += 0.2
    assert dog.check() and len(fired) == 1
    assert fired[0][0] > 10.0 and fired[0][1] == 10.0
    clock.now += 100
    assert not dog.check()  # once per stall
    dog.beat(0.5)
    clock.now += 11
    assert dog.check() and len(fired) == 2


def test_default_timeout_follows_the_median_step_with_a_floor() -> None:
    assert hang.default_timeout_s([]) == hang.HANG_FIRST_STEP_S
    assert hang.default_timeout_s([1.0, 1.0]) == hang.HANG_FIRST_STEP_S  # too few steps timed
    assert hang.default_timeout_s([0.1] * 10) == hang.HANG_FLOOR_S
    assert hang.default_timeout_s([10.0, 10.0, 10.0, 500.0]) == 10.0 * hang.HANG_MEDIAN_MULTIPLE


class FakeGroup:
    group_name = "7"
    group_desc = "dp_shard"

    def size(self) -> int:
        return 4

    def _get_sequence_number_for_group(self) -> int:
        return 42


def _blocked_in_fake_collective(release: threading.Event, unit: Any) -> None:
    """Run a function whose code claims to live in torch/distributed (so its frames look like a
    collective inside FSDP) until `release` is set."""
    c10d = "/x/site-packages/torch/distributed/distributed_c10d.py"
    fsdp = "/x/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py"
    ns: dict[str, Any] = {}
    exec(
        compile("def all_gather_into_tensor(group, release):\n    release.wait()\n", c10d, "exec"),
        ns,
    )
    exec(
        compile(
            "def unshard(self, gather, group, release):\n    gather(group, release)\n", fsdp, "exec"
        ),
        ns,
    )
    ns["unshard"](unit, ns["all_gather_into_tensor"], FakeGroup(), release)


def test_describe_hang_names_the_collective_group_unit_and_user_frame() -> None:
    class Unit:
        _module_fqn = "encoder.stages.3"

    release = threading.Event()
    t = threading.Thread(target=_blocked_in_fake_collective, args=(release, Unit()), daemon=True)
    t.start()
    time.sleep(0.2)
    try:
        dump = hang.describe_hang(main_thread_id=t.ident)
    finally:
        release.set()
        t.join(5)
    coll = dump["collective"]
    assert coll["op"] == "all_gather_into_tensor"
    assert coll["process_group"]["name"] == "7"
    assert coll["process_group"]["sequence_number"] == 42
    assert coll["process_group"]["size"] == 4
    assert coll["fsdp_unit"] == "encoder.stages.3"
    # the innermost frame of the user's code is this test module's function
    assert dump["user_frame"]["function"] == "_blocked_in_fake_collective"
    assert dump["user_frame"]["file"].endswith("test_failsafe_units.py")
    assert any(th["training_thread"] for th in dump["threads"])
    record = hang.hang_record(dump, 5, 12.5, 10.0, "hang/rank-0.json")
    assert (record.op, record.sequence_number, record.fsdp_unit) == (
        "all_gather_into_tensor",
        42,
        "encoder.stages.3",
    )


def test_user_frames_exclude_zdiag_and_libraries() -> None:
    assert not hang.is_user_file(hang.__file__)
    assert not hang.is_user_file("/usr/lib/python3/site-packages/torch/nn/modules/module.py")
    assert not hang.is_user_file(threading.__file__)
    assert hang.is_user_file("/home/me/project/train.py")


def _run(script: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.Popen([sys.executable, str(path), str(tmp_path / "flushed")])


@pytest.mark.slow  # starts a program
def test_sigterm_flushes_then_ends_the_process_by_sigterm(tmp_path: Path) -> None:
    proc = _run(
        """
        import sys, time
        from pathlib import Path
        from zdiag.collectors.signals import SignalFlush
        out = Path(sys.argv[1])
        SignalFlush(lambda why: out.write_text(why)).install()
        Path(str(out) + ".ready").write_text("")
        while True:
            time.sleep(0.05)
        """,
        tmp_path,
    )
    ready = tmp_path / "flushed.ready"
    for _ in range(200):
        if ready.exists():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == -signal.SIGTERM  # still "killed by SIGTERM" for torchrun
    assert (tmp_path / "flushed").read_text() == "SIGTERM"


@pytest.mark.slow  # starts a program
def test_sigterm_while_the_session_finishes_waits_for_it_then_ends(tmp_path: Path) -> None:
    proc = _run(
        """
        import os, signal, sys, time
        from pathlib import Path
        from zdiag.collectors.signals import SignalFlush
        out = Path(sys.argv[1])
        flush = SignalFlush(lambda why: out.write_text("flushed: " + why))
        flush.install()
        flush.defer()               # the session starts writing its data itself
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)             # its writes go on undisturbed
        out.write_text("finished")
        flush.end_deferral()        # then the SIGTERM ends the process
        out.write_text("not reached")
        """,
        tmp_path,
    )
    assert proc.wait(20) == -signal.SIGTERM
    assert (tmp_path / "flushed").read_text() == "finished"


def test_sigkill_leftovers_are_removed_by_the_launcher(tmp_path: Path) -> None:
    """A rank killed mid-write leaves `.NAME.tmp-*`; `zdiag run` removes it when the job ends."""
    run = make_run_dir(tmp_path / "run")
    (run / "traces" / ".rank-0.json.gz.tmp-abc.json.gz").write_bytes(b"")
    (run / "traces" / "rank-1.json.gz").write_bytes(b"x")
    assert remove_unfinished_writes(run) == 1
    assert [p.name for p in (run / "traces").iterdir()] == ["rank-1.json.gz"]


def test_a_second_sigterm_right_as_the_flush_starts_does_not_wait_for_itself() -> None:
    """The handler re-entered on the flushing thread between "the flush started" and the flush
    itself returns at once (it used to wait for its own flush: a hang when `timeout` or Slurm
    and `zdiag run` both sent SIGTERM)."""
    from zdiag.collectors.signals import SignalFlush

    flushed: list[str] = []
    sf = SignalFlush(flushed.append)
    started_set = sf._started.set

    def set_then_reenter() -> None:
        started_set()
        sf.flush_once("second SIGTERM")  # what a handler run at this point does

    sf._started.set = set_then_reenter  # type: ignore[method-assign]
    worker = threading.Thread(target=sf.flush_once, args=("SIGTERM",), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the re-entered flush waited for itself"
    assert flushed == ["SIGTERM"]
