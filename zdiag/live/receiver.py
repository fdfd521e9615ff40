"""The receiving end of the live stream: the monitor's receiver and the per-node relay.

`LiveReceiver` binds a ZeroMQ PULL socket, checks each message's token and schema, and returns
records decoded into the fixed schema of `wire.decode`, stamped with their receive time.
Every refused message is counted by reason (`rejections`: handshake, token, schema, oversize,
json, nested, field, range; see `wire.REJECT_REASONS`), and one bad message costs only
itself. Binding anywhere but loopback requires a token.

Peers authenticate before they can send (`auth`): with a token, a peer that does not hold it
fails the CURVE handshake and zmq takes no message frame from it (counted "handshake"), so it
cannot make zmq buffer anything; without a token only this machine's processes can connect.

Bounded memory: a message is read frame by frame, without copying, and given up (counted
"oversize") once its frames pass `MAX_MESSAGE_BYTES` in all or it has more than 3 frames; zmq
disconnects a peer that sends one frame over `MAX_FRAME_BYTES` (``MAXMSGSIZE``; such a message
never reaches the receiver, so it cannot be counted), and holds at most ``RCV_HWM`` complete
messages per connection. zmq delivers a multipart message only once all its frames have arrived
and has no cap on their number: only an authenticated peer (one holding the token) could make it
hold one long message, which the receiver then discards without copying.

`Relay` fans in one node's ranks: it listens on the node (loopback by default), and forwards
every valid record, re-encoded from its decoded schema (so nothing it was sent beyond the schema,
and no invalid message, goes on), over one connection to the monitor, dropping and counting when
the monitor is slow or absent, and reporting its counters as ``kind="relay"`` records every few
seconds. Run it as ``zdiag monitor --relay`` or inside the local-rank-0 process with
`Relay.start_thread`.

The control path (triggered captures) goes the other way through the relay: it subscribes to its
upstream's control socket (the monitor's, or the next relay's: `--forward`'s port + 1) and
re-publishes each valid capture request, decoded and re-encoded (`wire.decode_control`), on its
own (its listen port + 1), where its ranks' publishers subscribe. Both are authenticated as the
data path, bounded (`wire.CONTROL_HWM`, `wire.CONTROL_MAX_BYTES`) and never block; a relay whose
control sockets cannot be set up (its control port taken) forwards records all the same and says
so in its counters (`control_error`). Relays chain: a relay behind a relay needs nothing more.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from zdiag.errors import ConfigError
from zdiag.live.auth import HandshakeGuard
from zdiag.live.wire import (
    CONTROL_HWM,
    ENV_MONITOR,
    ENV_TOKEN,
    MAX_FRAME_BYTES,
    MAX_MESSAGE_BYTES,
    REJECT_REASONS,
    SCHEMA,
    SCHEMA_FRAME,
    Endpoint,
    WireError,
    control_endpoint,
    control_pub_socket,
    control_sub_socket,
    decode,
    decode_control,
    encode,
    parse_endpoint,
    push_socket,
    token_matches,
)

RCV_HWM = 256
"""Complete messages zmq may buffer per connection (zmq's ``RCVHWM`` holds for each peer, not
for the socket): 32 s of a relay's 8 ranks at 1 step/s, minutes of one rank. Beyond it zmq stops
reading that connection and the sender drops and counts. A monitor behind 512 relays that could
not keep up (bench/monitor_fanin.py --hz 4 on a saturated machine) reached 1.2 GiB of RSS at
10_000, 0.55 GiB at 256."""
MAX_FRAMES = 3  # a zdiag.live/1 message has exactly 3 frames
RELAY_SEND_HWM = 10_000
RELAY_STATS_INTERVAL_S = 2.0
RELAY_POLL_MS = 100
"""The relay's loop waits at most this long for a record or a control message."""


def _as_endpoint(value: Endpoint | str, option: str) -> Endpoint:
    return value if isinstance(value, Endpoint) else parse_endpoint(value, option=option)


class LiveReceiver:
    """A PULL socket bound to `listen` that yields validated records (never blocks unless asked)."""

    def __init__(
        self,
        listen: Endpoint | str,
        *,
        token: str = "",
        clock: Callable[[], float] = time.time,
        option: str = "--listen",
    ) -> None:
        """Bind; raise ConfigError for a non-loopback address without a token, a busy port, or a
        token with a libzmq that has no CURVE support."""
        endpoint = _as_endpoint(listen, option)
        if not endpoint.is_loopback and not token:
            raise ConfigError(
                f"{option} {endpoint} accepts connections from other machines, so it needs a shared "
                "token: pass --token or set ZDIAG_MONITOR_TOKEN (and the same on every rank)."
            )
        self._token = token.encode()
        self._clock = clock
        self.received = 0
        self.rejections: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
        self._ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        self._sock: zmq.Socket[Any] = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._guard: HandshakeGuard | None = None
        try:
            self._guard = HandshakeGuard(self._ctx, self._sock, self._token)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(
                f"{option} {endpoint}: a token needs ZeroMQ's CURVE security ({exc.strerror}); "
                "install a pyzmq wheel built with it (`pip install -U pyzmq`)."
            ) from None
        try:
            if endpoint.port == 0:
                port = self._sock.bind_to_random_port(f"tcp://{endpoint.host}")
                endpoint = Endpoint(endpoint.host, port)
            else:
                self._sock.bind(endpoint.bind_url)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(
                f"{option} {endpoint}: cannot listen there ({exc.strerror}); choose another port."
            ) from None
        self.endpoint = endpoint

    @property
    def socket(self) -> zmq.Socket[Any]:
        """The PULL socket, for a `zmq.Poller` that waits on it beside other sockets (read it
        with `poll`, never directly)."""
        return self._sock

    @property
    def rejected(self) -> int:
        """Messages refused, for any reason."""
        return sum(self.rejections.values())

    @property
    def rejected_token(self) -> int:
        """Connections and messages refused for a wrong or missing token (at the handshake, or
        in the message's token frame)."""
        return self.rejections["handshake"] + self.rejections["token"]

    @property
    def malformed(self) -> int:
        """Messages refused for anything but the token."""
        return self.rejected - self.rejected_token

    def _reject(self, reason: str) -> None:
        self.rejections[reason] += 1

    def _recv_message(self) -> list[bytes] | None:
        """The next message's frames (raises zmq.Again when there is none), or None when it was
        refused (counted): over `MAX_FRAMES` frames or `MAX_MESSAGE_BYTES` in all. The frames
        of a refused message are received without copying and dropped at once."""
        frame = self._sock.recv(flags=zmq.NOBLOCK, copy=False)
        frames: list[bytes] = []
        total = 0
        refused = False
        while True:
            total += len(frame.buffer)
            if total > MAX_MESSAGE_BYTES or len(frames) >= MAX_FRAMES:
                refused = True
                frames.clear()
            elif not refused:
                frames.append(frame.bytes)
            if not frame.more:
                break
            frame = self._sock.recv(copy=False)  # the rest of this message has arrived already
        if refused:
            self._reject("oversize")
            return None
        return frames

    def poll_frames(self, timeout_ms: int = 0, max_messages: int = 50_000) -> list[list[bytes]]:
        """Raw messages whose size, frame count, token and schema frame are right (waits up to
        `timeout_ms` for one); the others are counted in `rejections`."""
        out: list[list[bytes]] = []
        ready = self._sock.poll(timeout_ms, zmq.POLLIN)
        if self._guard is not None:
            self.rejections["handshake"] = self._guard.refused()
        if not ready:
            return out
        for _ in range(max_messages):
            try:
                frames = self._recv_message()
            except zmq.Again:
                break
            if frames is None:
                continue
            if len(frames) != 3 or frames[0] != SCHEMA_FRAME:
                self._reject("schema")
            elif not token_matches(self._token, frames[1]):
                self._reject("token")
            else:
                out.append(frames)
        return out

    def poll(self, timeout_ms: int = 0, max_messages: int = 50_000) -> list[dict[str, Any]]:
        """Decoded records, each stamped with ``recv_ts`` (this receiver's clock); a message
        that does not decode is counted by reason and costs only itself."""
        records: list[dict[str, Any]] = []
        frames_list = self.poll_frames(timeout_ms, max_messages)
        now = self._clock()
        for frames in frames_list:
            try:
                record = decode(frames)
            except WireError as exc:
                self._reject(exc.reason)
                continue
            record["recv_ts"] = now
            records.append(record)
        self.received += len(records)
        return records

    def close(self) -> None:
        """Close the socket at once (nothing lingers)."""
        if self._guard is not None:
            self._guard.close()
        self._sock.close(linger=0)
        self._ctx.term()


class Relay:
    """Forwards one node's ranks to the monitor over a single connection, and the monitor's
    capture requests back to them."""

    def __init__(
        self,
        listen: Endpoint | str,
        forward: Endpoint | str,
        *,
        token: str = "",
        host: str | None = None,
        stats_interval_s: float = RELAY_STATS_INTERVAL_S,
    ) -> None:
        """Bind `listen` (token rules as for the monitor) and connect to `forward` in the
        background; also the control path (`_open_control`), unless it cannot be set up."""
        self.forward = _as_endpoint(forward, "--forward")  # before binding: nothing to undo
        self.receiver = LiveReceiver(listen, token=token, option="--listen")
        self.host = host or socket.gethostname()
        self._token = token.encode()
        self._stats_interval_s = stats_interval_s
        self.forwarded = 0
        self.dropped = 0
        self.control_forwarded = 0
        """Control messages (capture requests) re-published to this node's ranks."""
        self.control_rejected = 0
        """Control messages from upstream that did not decode (`wire.decode_control`): dropped."""
        self.control_error: str | None = None
        """Why this relay has no control path (its control port taken, ...), or None."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        self._out: zmq.Socket[Any] = push_socket(
            self._ctx, self.forward, RELAY_SEND_HWM, self._token
        )
        self._control_in: zmq.Socket[Any] | None = None
        self._control_out: zmq.Socket[Any] | None = None
        self._control_guard: HandshakeGuard | None = None
        self._open_control()

    def _open_control(self) -> None:
        """Subscribe to the upstream's control endpoint and bind this relay's own (its listen
        port + 1), both as the monitor and the publishers set them up (`wire.control_sub_socket`,
        `wire.control_pub_socket`; the ZAP handler of the latter in this relay's sending
        context, the receiver's context has its own). When either fails the relay goes on
        without a control path (`control_error` says why); the records still flow."""
        where = f"control port {control_endpoint(self.receiver.endpoint)} (--listen port + 1)"
        try:
            self._control_out, self._control_guard = control_pub_socket(
                self._ctx, self.receiver.endpoint, self._token
            )
            where = f"upstream control port {control_endpoint(self.forward)}"
            self._control_in = control_sub_socket(self._ctx, self.forward, self._token)
        except zmq.ZMQError as exc:
            self._close_control()
            self.control_error = f"{where}: {exc.strerror}"

    def _send(self, frames: list[bytes]) -> None:
        try:
            self._out.send_multipart(frames, flags=zmq.NOBLOCK)
            self.forwarded += 1
        except zmq.Again:
            self.dropped += 1

    def _forward_control(self) -> None:
        """Re-publish the control messages waiting from upstream (at most `CONTROL_HWM`, never
        blocks): each one that decodes, re-encoded from its decoded fields with this relay's
        token, so nothing invalid and nothing beyond the schema goes on; the others are counted."""
        if self._control_in is None or self._control_out is None:
            return
        for _ in range(CONTROL_HWM):
            try:
                frames = self._control_in.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            request = decode_control(frames, self._token)
            if request is None:
                self.control_rejected += 1
                continue
            try:  # a PUB socket drops for a subscriber whose queue is full; it never blocks
                self._control_out.send_multipart(
                    encode({"kind": "capture", **request}, self._token), flags=zmq.NOBLOCK
                )
                self.control_forwarded += 1
            except zmq.ZMQError:
                pass

    def stats_record(self) -> dict[str, Any]:
        """This relay's counters as a ``kind="relay"`` record."""
        return {
            "kind": "relay",
            "schema": SCHEMA,
            "host": self.host,
            "ts": time.time(),
            "forwarded": self.forwarded,
            "dropped": self.dropped,
            "rejected": self.receiver.rejected,
            "control_forwarded": self.control_forwarded,
            "control_rejected": self.control_rejected,
            "control_error": self.control_error,
        }

    def run(self, duration_s: float | None = None) -> None:
        """Forward until `stop()` (or for `duration_s` seconds); then close the sockets.

        One `zmq.Poller` waits on the records' socket and the upstream's control socket (up to
        `RELAY_POLL_MS`, so `stop()` and the counters are seen that often): a record is
        forwarded as soon as it arrives, whatever the control socket does."""
        deadline = None if duration_s is None else time.monotonic() + duration_s
        next_stats = time.monotonic() + self._stats_interval_s
        poller = zmq.Poller()
        poller.register(self.receiver.socket, zmq.POLLIN)
        if self._control_in is not None:
            poller.register(self._control_in, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                ready = dict(poller.poll(RELAY_POLL_MS))
                for record in self.receiver.poll(timeout_ms=0):  # also counts refused handshakes
                    record.pop("recv_ts", None)
                    self._send(encode(record, self._token))
                if self._control_in is not None and self._control_in in ready:
                    try:
                        self._forward_control()
                    except zmq.ZMQError as exc:  # contained: the records keep flowing
                        poller.unregister(self._control_in)
                        self._close_control()
                        self.control_error = f"control path closed ({exc.strerror})"
                if now >= next_stats:
                    next_stats = now + self._stats_interval_s
                    self._send(encode(self.stats_record(), self._token))
        finally:
            self._close()

    def start_thread(self) -> threading.Thread:
        """Run the relay in a daemon thread (e.g. inside the local-rank-0 process)."""
        self._thread = threading.Thread(target=self.run, name="zdiag-live-relay", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout_s: float = 2.0) -> None:
        """Ask `run` to return and wait for its thread, if it has one."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _close_control(self) -> None:
        if self._control_guard is not None:
            self._control_guard.close()
        for sock in (self._control_in, self._control_out):
            if sock is not None:
                sock.close(linger=0)
        self._control_in = self._control_out = self._control_guard = None

    def _close(self) -> None:
        self._close_control()
        self._out.close(linger=0)
        self._ctx.term()
        self.receiver.close()


ENV_UPSTREAM = "ZDIAG_MONITOR_UPSTREAM"


def relay_from_env(local_rank: int) -> Relay | None:
    """In local rank 0, the node's relay when ``ZDIAG_MONITOR_UPSTREAM=HOST:PORT`` is set.

    Every rank of the node publishes to ``ZDIAG_MONITOR`` (a loopback address); local rank 0 also
    listens there and forwards to the monitor at ``ZDIAG_MONITOR_UPSTREAM``, with
    ``ZDIAG_MONITOR_TOKEN``. Returns the started relay (call `Relay.stop` at the end), or None
    (not local rank 0, or not configured). A bad address raises ConfigError.
    """
    upstream = os.environ.get(ENV_UPSTREAM, "").strip()
    listen = os.environ.get(ENV_MONITOR, "").strip()
    if local_rank != 0 or not upstream or not listen:
        return None
    relay = Relay(
        parse_endpoint(listen, option=ENV_MONITOR),
        parse_endpoint(upstream, option=ENV_UPSTREAM),
        token=os.environ.get(ENV_TOKEN, ""),
    )
    relay.start_thread()
    return relay
