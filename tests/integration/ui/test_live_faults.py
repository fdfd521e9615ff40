"""Faults: the monitor absent at start, killed and restarted, a rank killed, a slow link.

Training must go on (publish() returns at once, nothing raises), the monitor must mark silent
ranks stale, and nothing may crash. Real processes, loopback only, every process reaped.
"""

from __future__ import annotations

import signal
import time

import pytest
import zmq

from support.live import finish, free_port, reap, record, start_monitor, start_rank
from zdiag.live.publisher import StepPublisher

pytestmark = pytest.mark.slow


# A stand-in training rank: sleeps `dt` per step ("compute"), publishes one record per step,
# and prints its publish() cost and wall time as JSON.
def test_monitor_absent_then_killed_then_restarted() -> None:
    target = f"127.0.0.1:{free_port()}"
    rank = start_rank(0, steps=140, dt=0.05, target=target)  # ~7 s of "training"
    first = second = None
    try:
        time.sleep(1.0)  # no monitor yet
        first = start_monitor(target, 30)
        time.sleep(1.5)
        first.send_signal(signal.SIGKILL)  # killed mid-run
        first.communicate()
        time.sleep(0.5)
        second = start_monitor(target, 30)  # restarted on the same port
        stats = finish(rank)
        time.sleep(0.3)
        second.send_signal(signal.SIGTERM)  # the headless monitor still prints its summary
        seen = finish(second)
    finally:
        reap(rank, *(p for p in (first, second) if p is not None))
    assert stats["steps"] == 140
    assert stats["dropped"] > 0  # records sent while no monitor listened were counted
    # publish() never waited for the network: a blocking call would take >= 200 ms (reconnect)
    assert stats["max_us"] < 50_000, stats
    (row,) = seen["rows"]
    assert row["rank"] == 0 and row["step"] == 139  # the restarted monitor follows to the end
    assert row["dropped"] > 0


def test_killed_rank_is_marked_stale() -> None:
    target = f"127.0.0.1:{free_port()}"
    monitor = start_monitor(target, 8.5)
    time.sleep(0.5)
    alive = start_rank(0, steps=85, dt=0.1, target=target)
    doomed = start_rank(1, steps=85, dt=0.1, target=target)
    try:
        time.sleep(2.5)  # the doomed rank has started and reported
        doomed.send_signal(signal.SIGKILL)
        doomed.communicate()
        seen = finish(monitor)
        finish(alive)
    finally:
        reap(monitor, alive, doomed)
    status = {r["rank"]: r["status"] for r in seen["rows"]}
    assert status == {0: "ok", 1: "stale"}


def test_slow_link_drops_and_counts_without_blocking() -> None:
    """A receiver that never reads: zmq's buffers fill, then records are dropped and counted."""
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    sink.setsockopt(zmq.RCVHWM, 1)
    sink.setsockopt(zmq.RCVBUF, 4096)
    sink.setsockopt(zmq.LINGER, 0)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    pub = StepPublisher(f"127.0.0.1:{port}", rank=0, host="h", queue_size=64, send_hwm=4)
    try:
        deadline = time.monotonic() + 5
        while pub.sent == 0 and time.monotonic() < deadline:  # wait for the connection
            pub.publish(record())
            time.sleep(0.01)
        worst = 0.0
        for step in range(20_000):
            t = time.perf_counter()
            pub.publish(record(0, step))
            worst = max(worst, time.perf_counter() - t)
            if step % 1000 == 0:
                time.sleep(0.005)  # let the sender thread run, as a training step would
        time.sleep(0.2)
        assert pub.dropped > 0
        assert worst < 0.05
    finally:
        pub.close()
        sink.close()
        ctx.term()
