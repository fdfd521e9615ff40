"""The CPU time of a rank's child processes (collectors/child_cpu.py): a real child burning CPU
is counted once, and a platform without /proc gives None without raising."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from zdiag.collectors import child_cpu
from zdiag.collectors.child_cpu import ChildCpu

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"

NEEDS_PROC_CHILDREN = pytest.mark.skipif(
    not os.path.exists(f"/proc/self/task/{os.getpid()}/children"),
    reason="the kernel lists no children in /proc",
)


@contextlib.contextmanager
def burning_child(seconds: float, then: str = "") -> Iterator[subprocess.Popen[bytes]]:
    """A child process that burns `seconds` of CPU, then runs `then`; killed on the way out."""
    child = subprocess.Popen([sys.executable, "-c", BURN.format(s=seconds) + then])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow  # it starts a program
@NEEDS_PROC_CHILDREN
def test_a_childs_cpu_is_counted_in_the_step_it_is_spent() -> None:
    clock = ChildCpu()
    assert clock.step_ms(time.perf_counter()) == 0.0  # no child yet
    with burning_child(0.3, then="time.sleep(30)"):
        deadline = time.monotonic() + 20
        spent = 0.0
        while spent < 250 and time.monotonic() < deadline:  # its burn, read across steps
            time.sleep(child_cpu.MIN_INTERVAL_S)
            step = clock.step_ms(time.perf_counter())
            assert step is not None
            spent += step
        assert 250 <= spent < 1000  # 0.3 s burnt (and its interpreter's start-up)
        time.sleep(0.2)
        now = time.perf_counter()
        assert (clock.step_ms(now) or 0.0) < 50  # sleeping now: counted once, not again
        assert clock.step_ms(now + child_cpu.MIN_INTERVAL_S / 2) is None  # too soon to read


def test_without_proc_it_says_nothing_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(child_cpu, "_TICKS_PER_S", 0.0)
    assert ChildCpu().step_ms(time.perf_counter()) is None
    clock = ChildCpu.__new__(ChildCpu)
    clock._last, clock._off, clock._read_at = {}, False, -1.0

    def gone() -> list[int]:
        raise FileNotFoundError("/proc/1/task/1/children")

    monkeypatch.setattr(clock, "_children", gone)
    assert clock.step_ms(time.perf_counter()) is None and clock._off  # off from now on


@pytest.mark.slow  # it starts a program
@NEEDS_PROC_CHILDREN
def test_zdiags_own_children_are_left_out() -> None:
    """The in-job trace summary is zdiag's CPU, not the training's."""
    clock = ChildCpu()
    clock.step_ms(time.perf_counter())
    with burning_child(0.3) as child:
        child_cpu.ignore_child(child.pid)
        time.sleep(0.6)
        assert clock.step_ms(time.perf_counter()) == 0.0
