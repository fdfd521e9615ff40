"""The live step-record publisher each training rank runs when a monitor is configured.

`publisher_from_env(rank, host)` returns a `StepPublisher` when ``ZDIAG_MONITOR=HOST:PORT`` is
set (``ZDIAG_MONITOR_TOKEN`` is the shared token), else None. `StepPublisher.publish(record)`
is called once per training step: it stamps the record and puts it on a bounded in-memory
queue, nothing more. A background thread encodes and sends it over a ZeroMQ PUSH socket.

Guarantees, for the training step:

- `publish` never blocks and never raises: it appends to a deque (no lock, no thread wake-up, so
  the step never hands the GIL to the sender thread), which the sender drains every 50 ms.
  When the queue is full (the sender is behind) the
  record is dropped and counted; when the socket cannot take it (no monitor, monitor gone, a slow
  link filling the send high-water mark) it is dropped and counted too. Every record carries the
  running drop count, so the monitor shows what was lost.
- memory is bounded: ``queue_size`` records here plus ``SEND_HWM`` messages inside zmq, and
  zmq's ``IMMEDIATE`` option keeps nothing queued for a peer that is not connected.
- zmq reconnects by itself (`wire.push_socket`: every ``RECONNECT_IVL_MS``, backing off),
  so a monitor that starts late, or is killed and restarted, just starts receiving.
- The same thread subscribes to the control socket of its target (`wire.control_endpoint`,
  the target's port + 1, authenticated as the data path): the monitor's, or, behind a relay, the
  relay's, which re-publishes the monitor's. It keeps this job's latest capture request in
  `capture_request`, which the training step reads (`collectors.capture_window`).
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import threading
import time
from typing import Any

import zmq

from zdiag.live.wire import (
    CONTROL_HWM,
    ENV_JOB,
    ENV_MONITOR,
    ENV_TOKEN,
    JOB_ENV_FALLBACKS,
    SCHEMA,
    Endpoint,
    control_sub_socket,
    decode_control,
    encode,
    parse_endpoint,
    push_socket,
)

QUEUE_SIZE = 256  # records waiting for the sender thread (a few minutes of steps at 1 Hz)
SEND_HWM = 64  # messages zmq may hold for a connected but slow peer
CLOSE_LINGER_MS = 250  # on close, zmq may take this long to get the last records out
FLUSH_INTERVAL_S = 0.05  # the sender thread wakes this often and sends what is queued


def job_id_from_env() -> str:
    """The job id: ``ZDIAG_JOB_ID``, else the launcher's (torchelastic, Slurm, LSF, PBS), else ""."""
    for name in (ENV_JOB, *JOB_ENV_FALLBACKS):
        value = os.environ.get(name)
        if value and value != "none":  # torchrun's default run id says nothing
            return value
    return ""


class StepPublisher:
    """Sends step records to a monitor or relay without ever slowing the training step."""

    def __init__(
        self,
        target: Endpoint | str,
        *,
        rank: int,
        host: str,
        token: str = "",
        job: str = "",
        queue_size: int = QUEUE_SIZE,
        send_hwm: int = SEND_HWM,
    ) -> None:
        """Start the sender thread; it connects to `target` (``HOST:PORT``) in the background."""
        self.target = target if isinstance(target, Endpoint) else parse_endpoint(target)
        self.rank = int(rank)
        self.host = str(host)
        self.job = job
        self._token = token.encode()
        self._send_hwm = send_hwm
        # A deque, not a queue.Queue: appending takes no lock and wakes no thread, so the training
        # step never hands the GIL to the sender; the sender drains it every FLUSH_INTERVAL_S.
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._queue_size = max(1, queue_size)
        self._stop = threading.Event()
        self._seq = itertools.count()
        self._closed = False
        # Counters: written by one thread each (no lock needed for the GIL-atomic int updates).
        self.dropped_queue_full = 0
        self.dropped_unsent = 0
        self.sent = 0
        self.error: str | None = None  # the first internal error, if any (the sender then stops)
        # The monitor's latest capture request for this job (`wire.decode_control`), set by the
        # sender thread, read by the training step (one attribute read: a GIL-atomic swap).
        self.capture_request: dict[str, Any] | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"zdiag-live-publisher-{self.rank}", daemon=True
        )
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Records dropped so far (queue full, or the socket could not take them)."""
        return self.dropped_queue_full + self.dropped_unsent

    def publish(self, record: dict[str, Any]) -> None:
        """Queue one step record; never blocks, never raises (drops and counts when full)."""
        try:
            if self._closed:
                return
            if len(self._queue) >= self._queue_size:
                self.dropped_queue_full += 1
                return
            item = dict(record)
            item["ts"] = time.time()
            item["seq"] = next(self._seq)
            self._queue.append(item)
        except Exception:  # instrumentation must never break training
            self.dropped_queue_full += 1

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the sender thread; what is queued is sent if it can be (zmq lingers <= 250 ms)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout_s)

    def __enter__(self) -> StepPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sender thread -------------------------------------------------------------------------

    def _run(self) -> None:
        ctx: zmq.Context[Any] | None = None
        sock: zmq.Socket[Any] | None = None
        try:
            ctx = zmq.Context(io_threads=1)
            sock = push_socket(ctx, self.target, self._send_hwm, self._token)
            control = self._control_socket(ctx)
            while True:
                stopping = self._stop.wait(FLUSH_INTERVAL_S)
                while self._queue:
                    self._send(sock, self._queue.popleft())
                if control is not None:
                    self._read_control(control)
                if stopping:
                    break
        except Exception as exc:  # contained: training goes on, the records are counted as dropped
            self.error = f"{type(exc).__name__}: {exc}"
            self._drain_as_dropped()
        finally:
            if sock is not None:
                sock.close(linger=CLOSE_LINGER_MS)
            if ctx is not None:
                ctx.destroy(linger=0)  # the control socket too

    def _control_socket(self, ctx: zmq.Context[Any]) -> zmq.Socket[Any] | None:
        """A SUB socket on the target's control endpoint (capture requests: the monitor's, or
        the relay's, which re-publishes the monitor's), authenticated as the data path
        (`wire.control_sub_socket`); None when it cannot be set up (the records still flow)."""
        try:
            return control_sub_socket(ctx, self.target, self._token)
        except zmq.ZMQError:
            return None

    def _read_control(self, sub: zmq.Socket[Any]) -> None:
        """Take the capture requests waiting (never blocks); keep this job's latest."""
        for _ in range(CONTROL_HWM):
            try:
                frames = sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            request = decode_control(frames, self._token)
            if request is not None and request["job"] in ("", self.job):
                self.capture_request = request

    def _send(self, sock: zmq.Socket[Any], item: dict[str, Any]) -> None:
        item.setdefault("rank", self.rank)
        item.setdefault("host", self.host)
        item["kind"] = "step"
        item["schema"] = SCHEMA
        item["job"] = self.job
        item["pid"] = os.getpid()
        item["dropped"] = self.dropped
        for key, value in item.items():
            if isinstance(value, float) and not math.isfinite(value):
                item[key] = None  # JSON has no NaN/inf
        try:
            sock.send_multipart(encode(item, self._token), flags=zmq.NOBLOCK, copy=True)
            self.sent += 1
        except zmq.Again:
            self.dropped_unsent += 1
        except (TypeError, ValueError):  # an unencodable record: drop it, keep going
            self.dropped_unsent += 1

    def _drain_as_dropped(self) -> None:
        while self._queue:
            self._queue.popleft()
            self.dropped_unsent += 1


def publisher_from_env(rank: int, host: str) -> StepPublisher | None:
    """A publisher to ``$ZDIAG_MONITOR`` (``HOST:PORT``) with ``$ZDIAG_MONITOR_TOKEN``; None if unset.

    A malformed ``ZDIAG_MONITOR`` raises ConfigError (a user mistake, reported before training).
    """
    target = os.environ.get(ENV_MONITOR, "").strip()
    if not target:
        return None
    endpoint = parse_endpoint(target, option=ENV_MONITOR)
    return StepPublisher(
        endpoint,
        rank=rank,
        host=host,
        token=os.environ.get(ENV_TOKEN, ""),
        job=job_id_from_env(),
    )
