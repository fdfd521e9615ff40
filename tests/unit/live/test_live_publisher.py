"""The live publisher never blocks or raises into training, drops and counts, and reconnects."""

from __future__ import annotations

import time
from typing import Any

import pytest

from support.live import collect, free_port, record
from zdiag.errors import ConfigError
from zdiag.live.publisher import StepPublisher, publisher_from_env
from zdiag.live.receiver import LiveReceiver
from zdiag.live.wire import encode, parse_endpoint


def test_from_env_is_none_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZDIAG_MONITOR", raising=False)
    assert publisher_from_env(0, "h") is None


def test_from_env_rejects_a_malformed_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZDIAG_MONITOR", "nohostport")
    with pytest.raises(ConfigError, match="ZDIAG_MONITOR"):
        publisher_from_env(0, "h")


def test_no_receiver_publish_returns_at_once_and_counts_drops() -> None:
    pub = StepPublisher(f"127.0.0.1:{free_port()}", rank=3, host="h", queue_size=16)
    try:
        n = 2000
        start = time.perf_counter()
        for i in range(n):
            pub.publish(record(3, i))
        per_call_s = (time.perf_counter() - start) / n
        # Generous bound: a blocking call would take at least the reconnect interval (200 ms).
        assert per_call_s < 0.01
        deadline = time.monotonic() + 5
        while pub.dropped < n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pub.dropped == n  # nobody listened: every record is counted as dropped
        assert pub.sent == 0
    finally:
        pub.close()


def test_publish_never_raises_on_bad_input_or_after_close() -> None:
    pub = StepPublisher(f"127.0.0.1:{free_port()}", rank=0, host="h")
    pub.publish({"step": float("nan"), "weird": object()})
    pub.publish(None)  # type: ignore[arg-type]
    pub.close()
    pub.publish(record())
    pub.close()
    assert pub.error is None


def test_records_flow_and_carry_job_ts_and_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    rx = LiveReceiver("127.0.0.1:0", token="s3cret")
    monkeypatch.setenv("ZDIAG_MONITOR", str(rx.endpoint))
    monkeypatch.setenv("ZDIAG_MONITOR_TOKEN", "s3cret")
    monkeypatch.setenv("ZDIAG_JOB_ID", "job-42")
    pub = publisher_from_env(1, "node1")
    assert pub is not None
    try:
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + 10
        step = 0
        while len(got) < 3 and time.monotonic() < deadline:  # the first ones race the connect
            pub.publish(record(1, step, host="node1"))
            step += 1
            got += rx.poll(timeout_ms=50)
        assert got, "no record arrived"
        rec = got[-1]
        assert rec["rank"] == 1 and rec["host"] == "node1" and rec["job"] == "job-42"
        assert rec["schema"] == "zdiag.live/1" and rec["recv_ts"] >= rec["ts"] - 1
        assert rec["step_time_ms"] == 100.0 and rec["compute_ms"] is None
        assert rx.rejected == 0
    finally:
        pub.close()
        rx.close()


def test_receiver_restarted_mid_run_records_flow_again() -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    pub = StepPublisher(target, rank=0, host="h")
    try:
        rx = LiveReceiver(target)
        step = 0

        def pump(rx: LiveReceiver) -> list[dict[str, Any]]:
            nonlocal step
            got: list[dict[str, Any]] = []
            deadline = time.monotonic() + 10
            while len(got) < 3 and time.monotonic() < deadline:
                pub.publish(record(0, step))
                step += 1
                got += rx.poll(timeout_ms=50)
            return got

        assert pump(rx)
        rx.close()  # the monitor is killed
        for _ in range(50):
            pub.publish(record(0, step))
            step += 1
            time.sleep(0.005)
        rx = LiveReceiver(target)  # ... and restarted on the same port
        try:
            again = pump(rx)
            assert again, "records did not flow again after the receiver restarted"
            assert again[-1]["dropped"] > 0  # what was lost meanwhile is counted
        finally:
            rx.close()
    finally:
        pub.close()


def test_wrong_token_is_rejected_and_counted() -> None:
    rx = LiveReceiver("127.0.0.1:0", token="right")
    bad = StepPublisher(str(rx.endpoint), rank=0, host="h", token="wrong")
    try:
        deadline = time.monotonic() + 10
        got: list[dict[str, Any]] = []
        while rx.rejected_token < 3 and time.monotonic() < deadline:
            bad.publish(record())
            got += rx.poll(timeout_ms=50)
        assert rx.rejected_token >= 3
        assert got == []
    finally:
        bad.close()
        rx.close()


def test_remote_listen_needs_a_token() -> None:
    with pytest.raises(ConfigError, match="token"):
        LiveReceiver("0.0.0.0:0")


def test_malformed_messages_are_counted() -> None:
    import zmq

    rx = LiveReceiver("127.0.0.1:0")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(rx.endpoint.connect_url)
    try:
        sock.send_multipart([b"junk"])
        sock.send_multipart(encode({"kind": "step", "rank": "x"}, b""))
        sock.send_multipart(encode({"kind": "step", "rank": 0, "step": 1, "ts": 1.0}, b""))
        sock.send_multipart(encode({"kind": "relay", "host": "n", "dropped": "lots"}, b""))
        got = collect(rx, 2, timeout_s=5)
        deadline = time.monotonic() + 5
        while rx.malformed < 2 and time.monotonic() < deadline:
            got += rx.poll(timeout_ms=50)
        assert [r.get("step") for r in got] == [1, None]
        assert got[0]["pid"] is None and got[1]["dropped"] == 0  # garbage counters become 0
        assert rx.malformed == 2
    finally:
        sock.close()
        ctx.term()
        rx.close()


def test_parse_endpoint() -> None:
    assert str(parse_endpoint("127.0.0.1:5577")) == "127.0.0.1:5577"
    assert parse_endpoint("[::1]:80").is_loopback
    with pytest.raises(ConfigError):
        parse_endpoint("host:99999")
