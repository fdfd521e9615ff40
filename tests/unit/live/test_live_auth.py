"""Issue 14: a peer without the token delivers no frame, so one huge many-frame message cannot
make the monitor or a relay buffer it. Real sockets on 127.0.0.1; the receiver runs in its own
process, which reports its peak RSS (VmHWM) before and after the attack."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest
import zmq

from support.live import collect, record
from support.zmtp import send_null_peer
from zdiag.errors import ConfigError
from zdiag.live import auth
from zdiag.live.publisher import StepPublisher
from zdiag.live.receiver import LiveReceiver
from zdiag.live.wire import SCHEMA_FRAME, Endpoint

TOKEN = "job-token-1234"
ATTACK = [SCHEMA_FRAME, b"", *([b"x" * (200 * 1024)] * 200)]  # 200 frames x 200 KiB: 40 MiB
ATTACK_BYTES = sum(map(len, ATTACK))
MIB = 1 << 20

# The receiver under attack: a monitor's LiveReceiver, or a Relay (forwarding to argv[3]).
# It prints its port and peak RSS once warmed up, then waits for one good record (monitor:
# received; relay: forwarded) and prints what it saw as JSON.
RECEIVER = r"""
import json, sys, time
from zdiag.live.receiver import LiveReceiver, Relay

def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))

mode, token = sys.argv[1], sys.argv[2]
relay = Relay("127.0.0.1:0", sys.argv[3], token=token, stats_interval_s=60) if mode == "relay" else None
rx = relay.receiver if relay else LiveReceiver("127.0.0.1:0", token=token)
steps = []
if relay:
    relay.start_thread()
    time.sleep(0.5)
else:
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        rx.poll(timeout_ms=50)  # warm up the loop before the baseline
print(rx.endpoint.port, peak_kib(), flush=True)
deadline = time.monotonic() + 20
while time.monotonic() < deadline and not (relay.forwarded if relay else steps):
    if relay:
        time.sleep(0.05)
    else:
        steps += [r["step"] for r in rx.poll(timeout_ms=50)]
out = {"peak_kib": peak_kib(), "steps": steps, "rejections": dict(rx.rejections)}
if relay:
    out["forwarded"] = relay.forwarded
    relay.stop()
else:
    rx.close()
print(json.dumps(out), flush=True)
"""


def attacked(
    attack: Any, *, token: str = TOKEN, mode: str = "monitor", forward: str = ""
) -> dict[str, Any]:
    """Start a receiver process, run `attack(port)`, then publish one good record with `token`;
    return the receiver's report with ``peak_rise_mib`` (its VmHWM growth)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, mode, token, forward],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port_text, baseline_text = proc.stdout.readline().split()  # type: ignore[union-attr]
        attack(int(port_text))
        good = StepPublisher(f"127.0.0.1:{port_text}", rank=0, host="h", token=token)
        try:
            for step in range(100):  # until the receiver has it and exits
                good.publish(record(0, step))
                if proc.poll() is not None:
                    break
                time.sleep(0.1)
        finally:
            good.close()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    report: dict[str, Any] = json.loads(out)
    report["peak_rise_mib"] = (report["peak_kib"] - int(baseline_text)) / 1024
    return report


def raw_null_peer(port: int) -> None:
    """A peer with no credential: ZMTP NULL, the 40 MiB message right after the greeting."""
    send_null_peer(port, ATTACK)


def wrong_token_peer(port: int) -> None:
    """A zmq peer holding the wrong token, queueing the 40 MiB message for as long as zmq tries."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    auth.secure_sender(sock, b"not-the-token")
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart(ATTACK)
        time.sleep(1.0)  # zmq retries the handshake meanwhile
    finally:
        sock.close()
        ctx.term()


@pytest.mark.slow  # starts a program
def test_without_a_token_the_many_frame_message_is_buffered_whole() -> None:
    """The control: the attack is real and the measurement sees it (loopback, no token)."""
    report = attacked(raw_null_peer, token="")
    assert report["peak_rise_mib"] > ATTACK_BYTES / MIB * 0.75, report
    assert report["rejections"]["oversize"] == 1  # the receiver dropped it, after zmq held it
    assert report["steps"]


@pytest.mark.slow  # starts a program
@pytest.mark.parametrize("attack", [raw_null_peer, wrong_token_peer], ids=["no-token", "wrong"])
def test_monitor_takes_no_frame_from_a_peer_without_the_token(attack: Any) -> None:
    report = attacked(attack)
    assert report["peak_rise_mib"] < 8, report  # vs. >= 30 MiB in the control
    assert report["steps"] and report["steps"][0] >= 0  # the token holder's record arrived
    rejections = {k: v for k, v in report["rejections"].items() if v}
    assert set(rejections) == {"handshake"}, rejections  # the attack never reached a check


@pytest.mark.slow  # starts a program
def test_relay_takes_no_frame_from_a_peer_without_the_token() -> None:
    monitor = LiveReceiver("127.0.0.1:0", token=TOKEN)
    try:

        def both(port: int) -> None:
            raw_null_peer(port)
            wrong_token_peer(port)

        report = attacked(both, mode="relay", forward=str(monitor.endpoint))
        got = [r for r in collect(monitor, 1) if r["kind"] == "step"]
    finally:
        monitor.close()
    assert report["peak_rise_mib"] < 8, report
    assert report["forwarded"] >= 1 and report["rejections"]["handshake"] >= 2
    assert got and got[0]["rank"] == 0  # through the relay to the monitor, authenticated
    assert monitor.rejected == 0


def test_token_mismatch_either_way_is_refused_at_the_handshake() -> None:
    for listener_token, sender_token in (("a", "b"), ("", "b"), ("a", "")):
        rx = LiveReceiver("127.0.0.1:0", token=listener_token)
        pub = StepPublisher(str(rx.endpoint), rank=0, host="h", token=sender_token)
        try:
            deadline = time.monotonic() + 10
            got: list[dict[str, Any]] = []
            while rx.rejections["handshake"] == 0 and time.monotonic() < deadline:
                pub.publish(record(0, 0))
                got += rx.poll(timeout_ms=50)
            assert not got and rx.rejections["handshake"] > 0
            assert rx.rejected_token == rx.rejections["handshake"]  # a token problem, not malformed
        finally:
            pub.close()
            rx.close()
        assert pub.dropped > 0 and pub.sent == 0  # nothing queued for a refused peer (IMMEDIATE)


def test_a_publisher_whose_security_setup_fails_only_drops(monkeypatch: Any) -> None:
    def no_curve(token: bytes, role: str) -> tuple[bytes, bytes]:
        raise zmq.ZMQError(zmq.ENOTSUP)

    monkeypatch.setattr(auth, "curve_keys", no_curve)
    pub = StepPublisher(Endpoint("127.0.0.1", 9), rank=0, host="h", token=TOKEN)
    try:
        deadline = time.monotonic() + 5
        while pub.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        pub.publish(record(0, 1))  # never raises, never blocks
    finally:
        pub.close()
    assert pub.error is not None and "ZMQError" in pub.error
    assert pub.sent == 0


def test_a_receiver_without_curve_support_says_so(monkeypatch: Any) -> None:
    def no_curve(token: bytes, role: str) -> tuple[bytes, bytes]:
        raise zmq.ZMQError(zmq.ENOTSUP)

    monkeypatch.setattr(auth, "curve_keys", no_curve)
    with pytest.raises(ConfigError, match="CURVE"):
        LiveReceiver("127.0.0.1:0", token=TOKEN)
    LiveReceiver("127.0.0.1:0").close()  # without a token, no CURVE is needed


def test_derived_keys_differ_by_token_and_role() -> None:
    keys = {auth.curve_keys(t, r) for t in (b"a", b"b") for r in ("receiver", "sender")}
    assert len(keys) == 4
    assert auth.curve_keys(b"a", "sender") == auth.curve_keys(b"a", "sender")
    assert all(len(public) == len(secret) == 40 for public, secret in keys)
