"""The per-node relay: many ranks in, one connection out, token enforced, counters reported; the
monitor's capture requests back down to the ranks, valid ones only."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from support.live import free_port, free_port_pair, record
from zdiag.errors import ConfigError
from zdiag.live.captures import ControlSender
from zdiag.live.publisher import StepPublisher, publisher_from_env
from zdiag.live.receiver import LiveReceiver, Relay
from zdiag.live.wire import (
    SCHEMA_FRAME,
    Endpoint,
    control_endpoint,
    control_pub_socket,
    control_sub_socket,
    encode,
)


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


# -- the control path (triggered captures) through relays ----------------------------------------

REQUEST = {"kind": "capture", "id": 7, "job": "j", "step": 40, "steps": 3, "reason": "chronic"}
DECODED = {"id": 7, "job": "j", "step": 40, "steps": 3, "reason": "chronic"}


def _wait_for(done: Callable[[], bool], send: Callable[[], None], timeout_s: float = 10) -> None:
    """Call `send` every 50 ms until `done()` (a PUB socket drops what a subscriber still
    connecting misses: the monitor re-sends too) or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        send()
        time.sleep(0.05)


@pytest.mark.parametrize("hops", [1, 2])
def test_capture_requests_reach_the_ranks_through_relays(hops: int) -> None:
    monitor = LiveReceiver(f"127.0.0.1:{free_port_pair()}", token="tok")
    control = ControlSender(monitor.endpoint, "tok")
    relays: list[Relay] = []
    upstream = monitor.endpoint
    for _ in range(hops):  # a relay behind a relay needs nothing more
        relay = Relay(f"127.0.0.1:{free_port_pair()}", upstream, token="tok", stats_interval_s=0.2)
        relay.start_thread()
        relays.append(relay)
        upstream = relay.receiver.endpoint
    pub = StepPublisher(upstream, rank=3, host="node1", token="tok", job="j")
    try:
        assert all(r.control_error is None for r in relays)
        _wait_for(lambda: pub.capture_request is not None, lambda: control.send(REQUEST))
        assert pub.capture_request == DECODED
        assert all(r.control_forwarded > 0 and r.control_rejected == 0 for r in relays)
        steps: list[dict[str, Any]] = []
        reports: list[dict[str, Any]] = []

        def receive() -> None:
            pub.publish(record(3, len(steps), host="node1"))
            for r in monitor.poll(timeout_ms=0):
                (reports if r["kind"] == "relay" else steps).append(r)

        _wait_for(lambda: bool(steps) and any(r["control_forwarded"] for r in reports), receive)
        assert steps[0]["rank"] == 3  # the records still flow up
        assert any(r["control_forwarded"] > 0 and r["control_error"] is None for r in reports)
    finally:
        pub.close()
        for relay in reversed(relays):
            relay.stop()
        control.close()
        monitor.close()


def test_a_relay_forwards_only_valid_control_messages() -> None:
    upstream = Endpoint("127.0.0.1", free_port_pair())  # a monitor that sends anything
    ctx: zmq.Context[Any] = zmq.Context()
    pub_sock, guard = control_pub_socket(ctx, upstream, b"tok")
    relay = Relay(f"127.0.0.1:{free_port_pair()}", upstream, token="tok")
    relay.start_thread()
    ranks = control_sub_socket(ctx, relay.receiver.endpoint, b"tok")  # as a rank's publisher
    bad = [
        encode(REQUEST, b"nope"),  # the token frame is not the token
        [SCHEMA_FRAME, b"tok", b"{not json"],
        [SCHEMA_FRAME, b"tok", b"[" * 2000 + b"]" * 2000],  # under zmq's MAXMSGSIZE
        encode({**REQUEST, "steps": 99}, b"tok"),
        encode({**REQUEST, "kind": "step"}, b"tok"),
        [SCHEMA_FRAME, b"tok"],
    ]
    got: list[list[bytes]] = []

    def send() -> None:
        for frames in [*bad, encode({**REQUEST, "extra": "x" * 100}, b"tok")]:
            pub_sock.send_multipart(frames)
        while ranks.poll(0):
            got.append(ranks.recv_multipart())

    try:
        _wait_for(lambda: len(got) >= 3, send)
        assert len(got) >= 3
        for frames in got:  # only the valid request, re-encoded from its decoded fields
            assert frames[:2] == [SCHEMA_FRAME, b"tok"]
            assert json.loads(frames[2]) == {"kind": "capture", **DECODED}
        assert relay.control_forwarded >= len(got) and relay.control_rejected >= len(bad)
    finally:
        relay.stop()
        guard.close()
        for sock in (pub_sock, ranks):
            sock.close(linger=0)
        ctx.term()


def test_a_relay_forwards_no_control_message_from_a_monitor_without_its_token() -> None:
    monitor = LiveReceiver(f"127.0.0.1:{free_port_pair()}", token="other")
    control = ControlSender(monitor.endpoint, "other")  # the relay's handshake fails
    relay = Relay(f"127.0.0.1:{free_port_pair()}", monitor.endpoint, token="tok")
    relay.start_thread()
    pub = StepPublisher(relay.receiver.endpoint, rank=0, host="h", token="tok", job="j")
    try:
        _wait_for(lambda: False, lambda: control.send(REQUEST), timeout_s=1.0)
        assert pub.capture_request is None
        assert relay.control_forwarded == 0 and relay.control_rejected == 0
    finally:
        pub.close()
        relay.stop()
        control.close()
        monitor.close()


@pytest.mark.parametrize("taken", ["upstream", "own"])
def test_a_relay_forwards_records_without_a_control_path(taken: str) -> None:
    """`upstream`: the monitor's control port holds something that is no zmq socket (it accepts
    and never answers); `own`: the relay's control port is taken, so it has no control path."""
    monitor = LiveReceiver(f"127.0.0.1:{free_port_pair()}")
    listen = Endpoint("127.0.0.1", free_port_pair())
    held = control_endpoint(monitor.endpoint if taken == "upstream" else listen)
    squatter = socket.socket()
    squatter.bind((held.host, held.port))
    squatter.listen()
    relay = Relay(listen, monitor.endpoint, stats_interval_s=0.2)
    relay.start_thread()
    pub = StepPublisher(listen, rank=1, host="h")
    try:
        assert (relay.control_error is not None) == (taken == "own")
        steps: list[dict[str, Any]] = []
        reports: list[dict[str, Any]] = []

        def receive() -> None:
            pub.publish(record(1, len(steps)))
            for r in monitor.poll(timeout_ms=0):
                (reports if r["kind"] == "relay" else steps).append(r)

        _wait_for(lambda: len(steps) >= 3 and bool(reports), receive)
        assert len(steps) >= 3 and relay.dropped == 0
        assert (reports[-1]["control_error"] is not None) == (taken == "own")
    finally:
        pub.close()
        relay.stop()
        monitor.close()
        squatter.close()
