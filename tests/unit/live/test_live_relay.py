"""The per-node relay: many ranks in, one connection out, token enforced, counters reported."""

from __future__ import annotations

import time
from typing import Any

import pytest

from support.live import free_port, record
from zdiag.errors import ConfigError
from zdiag.live.publisher import StepPublisher, publisher_from_env
from zdiag.live.receiver import LiveReceiver, Relay


def test_relay_fans_in_ranks_and_reports_its_counters() -> None:
    monitor = LiveReceiver("127.0.0.1:0", token="tok")
    relay = Relay("127.0.0.1:0", monitor.endpoint, token="tok", host="node7", stats_interval_s=0.2)
    relay.start_thread()
    pubs = [
        StepPublisher(str(relay.receiver.endpoint), rank=r, host="node7", token="tok")
        for r in range(4)
    ]
    intruder = StepPublisher(str(relay.receiver.endpoint), rank=99, host="x", token="nope")
    try:
        steps: dict[int, set[int]] = {}
        relays: list[dict[str, Any]] = []
        deadline = time.monotonic() + 15
        step = 0
        while time.monotonic() < deadline and (
            len(steps) < 4 or not relays or relay.receiver.rejected_token == 0
        ):
            for p in pubs:
                p.publish(record(p.rank, step, host="node7"))
            intruder.publish(record(99, step))
            step += 1
            for r in monitor.poll(timeout_ms=50):
                if r["kind"] == "relay":
                    relays.append(r)
                else:
                    steps.setdefault(r["rank"], set()).add(r["step"])
        assert sorted(steps) == [0, 1, 2, 3]  # the intruder's records never got through
        assert relays and relays[-1]["host"] == "node7" and relays[-1]["forwarded"] > 0
        assert relay.receiver.rejected_token > 0
        assert monitor.rejected == 0
    finally:
        for p in [*pubs, intruder]:
            p.close()
        relay.stop()
        monitor.close()


def test_relay_without_monitor_drops_and_counts() -> None:
    gone = LiveReceiver("127.0.0.1:0")
    port = gone.endpoint.port
    gone.close()
    relay = Relay("127.0.0.1:0", f"127.0.0.1:{port}", stats_interval_s=60)
    relay.start_thread()
    pub = StepPublisher(str(relay.receiver.endpoint), rank=0, host="h")
    try:
        deadline = time.monotonic() + 10
        step = 0
        while relay.dropped < 3 and time.monotonic() < deadline:
            pub.publish(record(0, step))
            step += 1
            time.sleep(0.01)
        assert relay.dropped >= 3 and relay.forwarded == 0
    finally:
        pub.close()
        relay.stop()


def test_relay_from_env_in_local_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    from zdiag.live.receiver import relay_from_env

    relay_at = f"127.0.0.1:{free_port()}"
    monitor = LiveReceiver("127.0.0.1:0")
    relay = pub = None
    try:
        monkeypatch.setenv("ZDIAG_MONITOR", relay_at)
        monkeypatch.setenv("ZDIAG_MONITOR_UPSTREAM", str(monitor.endpoint))
        assert relay_from_env(1) is None  # only local rank 0 runs it
        relay = relay_from_env(0)
        assert relay is not None
        pub = publisher_from_env(5, "node3")  # every rank publishes to the node's relay
        assert pub is not None
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + 10
        step = 0
        while not got and time.monotonic() < deadline:
            pub.publish(record(5, step, host="node3"))
            step += 1
            got += [r for r in monitor.poll(timeout_ms=50) if r["kind"] == "step"]
        assert got and got[0]["rank"] == 5
    finally:
        if pub is not None:
            pub.close()
        if relay is not None:
            relay.stop()
        monitor.close()


def test_relay_with_a_bad_forward_address_leaves_its_port_free() -> None:
    port = free_port()
    with pytest.raises(ConfigError) as excinfo:
        Relay(f"127.0.0.1:{port}", "not-an-address")
    assert "--forward" in str(excinfo.value)
    receiver = LiveReceiver(f"127.0.0.1:{port}")  # would be "address in use" had it bound
    receiver.close()
