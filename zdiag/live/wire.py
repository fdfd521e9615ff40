"""The live stream's wire format, shared by the publisher, the per-node relay and the monitor.

One message is three ZeroMQ frames: ``[SCHEMA, token, payload]``.

- ``SCHEMA`` is ``b"zdiag.live/1"``. New record fields may be added; none is renamed or removed.
- ``token`` is the shared secret (``ZDIAG_MONITOR_TOKEN``), empty when none is set. With a
  token, peers also authenticate at the connection's handshake with CURVE keys derived from it
  (`auth`), so a peer without it delivers no frame at all, and the stream is encrypted.
- ``payload`` is one JSON object. A step record carries ``kind="step"``, ``rank``, ``host``,
  ``step``, ``step_time_ms``, ``mem_allocated_bytes``, ``mem_reserved_bytes``, ``mem_peak_bytes``,
  ``samples_per_s``, optionally ``compute_ms``, ``comm_ms``, ``exposed_comm_ms``, and the publisher
  adds ``job``, ``ts`` (unix seconds when ``publish`` was called), ``seq`` and ``dropped`` (records
  this publisher dropped so far). ``mem_source`` says what the memory figures are (one of
  `MEM_SOURCES`: CUDA's allocator, a registered reader, or the process's RSS; absent: unknown).
  ``last_collective`` names the last collective the step issued
  (when the comm split is measured), and ``comm_by_dim``, when the step's collectives ran on
  groups of 2+ mesh dimensions, maps each dimension label (at most `MAX_DIMS`, 32 characters)
  to ``[comm_ms, exposed_comm_ms]``. A relay sends ``kind="relay"`` records with its own counters
  (`RELAY_FIELDS`).
- The end-of-run record is a step record with ``ended`` set (``"finished"``: the rank's training
  returned; ``"failed"``: it raised), ``step`` the last step's number and no figures. It is a field
  added to ``zdiag.live/1``, not a new kind, so older monitors decode it as an empty step.

Version rules: a field may be added to a kind (older receivers drop it), with a default that
means what records without it meant; a field is never renamed, removed or given another meaning;
a new kind, or any change older receivers would misread, needs a new ``SCHEMA``.

Only the standard library and zmq are used here (the collectors' import boundary).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zdiag.errors import ConfigError

if TYPE_CHECKING:  # zmq is imported where a socket is made: `zdiag run` needs only the constants
    import zmq

    from zdiag.live.auth import HandshakeGuard

SCHEMA = "zdiag.live/1"
SCHEMA_FRAME = SCHEMA.encode()
MAX_MESSAGE_BYTES = 64 * 1024
"""A message's frames together (a step record is ~400 bytes): the receiver refuses and counts
("oversize") any larger message."""
MAX_FRAME_BYTES = 4 * MAX_MESSAGE_BYTES
"""zmq's own limit on one frame (``MAXMSGSIZE``): a peer sending a larger frame is disconnected
by zmq before the receiver sees anything (so that message cannot be counted)."""
DEFAULT_PORT = 5577
ENV_MONITOR = "ZDIAG_MONITOR"
ENV_TOKEN = "ZDIAG_MONITOR_TOKEN"
ENV_JOB = "ZDIAG_JOB_ID"
# Launchers' job ids, tried in order when ZDIAG_JOB_ID is unset.
RECONNECT_IVL_MS = 200  # a sender retries a missing peer this often ...
RECONNECT_IVL_MAX_MS = 2000  # ... backing off to this
JOB_ENV_FALLBACKS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID")

_NUMBER_FIELDS = (
    "step_time_ms",
    "mem_allocated_bytes",
    "mem_reserved_bytes",
    "mem_peak_bytes",
    "samples_per_s",
    "compute_ms",
    "comm_ms",
    "exposed_comm_ms",
)


@dataclass(frozen=True)
class Endpoint:
    """A TCP address, ``HOST:PORT``."""

    host: str
    port: int

    @property
    def bind_url(self) -> str:
        """The zmq address to bind."""
        return f"tcp://{_bracket(self.host)}:{self.port}"

    @property
    def connect_url(self) -> str:
        """The zmq address to connect to."""
        return f"tcp://{_bracket(self.host)}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        """Whether only this machine can reach the address."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def __str__(self) -> str:
        return f"{_bracket(self.host)}:{self.port}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_endpoint(text: str, *, option: str = "address") -> Endpoint:
    """Parse ``HOST:PORT`` (``[v6]:PORT`` for IPv6); raise ConfigError naming `option` if bad."""
    text = text.strip()
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ConfigError(
            f"{option} must be HOST:PORT, for example 127.0.0.1:{DEFAULT_PORT}, got {text!r}."
        )
    return Endpoint(host, int(port_text))


def token_matches(expected: bytes, received: bytes) -> bool:
    """Constant-time token comparison; with no expected token, anything is accepted."""
    if not expected:
        return True
    return hmac.compare_digest(expected, received)


def encode(payload: dict[str, Any], token: bytes) -> list[bytes]:
    """The frames of one message."""
    body = json.dumps(payload, separators=(",", ":"), default=str, allow_nan=False)
    return [SCHEMA_FRAME, token, body.encode()]


def push_socket(
    ctx: zmq.Context[Any], target: Endpoint, send_hwm: int, token: bytes = b""
) -> zmq.Socket[Any]:
    """A PUSH socket connected to `target` as every sender (publisher, relay) sets it up.

    Nothing lingers on close, at most `send_hwm` messages wait for a connected but slow peer,
    nothing is queued for a peer that is not connected (``IMMEDIATE``: a connection counts once
    its handshake succeeded), and zmq reconnects by itself every ``RECONNECT_IVL_MS`` (backing
    off to ``RECONNECT_IVL_MAX_MS``). With a `token` it authenticates with the CURVE keys
    derived from it (`auth`); a receiver with another token, or none, refuses the handshake.
    """
    import zmq

    from zdiag.live.auth import secure_sender

    sock = ctx.socket(zmq.PUSH)
    secure_sender(sock, token)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.connect(target.connect_url)
    return sock


MAX_NESTING_BRACKETS = 32
"""A record is one flat JSON object: a payload with more `[`/`{` than this is refused before it is
parsed (so no deeply nested payload ever reaches the JSON parser's recursion)."""

MAX_RANK = 2**31 - 1
MAX_COUNT = 2**63 - 1
MAX_TS_S = 1e11  # unix seconds (year 5138)
MAX_MS = 1e9  # 11.6 days: longer than any step or phase
MAX_BYTES = 2.0**60  # 1 EiB: more than any device's memory
MAX_RATE = 1e12  # samples per second
_NUMBER_RANGES: dict[str, float] = {
    "step_time_ms": MAX_MS,
    "mem_allocated_bytes": MAX_BYTES,
    "mem_reserved_bytes": MAX_BYTES,
    "mem_peak_bytes": MAX_BYTES,
    "samples_per_s": MAX_RATE,
    "compute_ms": MAX_MS,
    "comm_ms": MAX_MS,
    "exposed_comm_ms": MAX_MS,
}
"""Each number field's upper bound (all are >= 0); a value outside is refused ("range")."""

STEP_FIELDS = (
    "kind",
    "schema",
    "rank",
    "host",
    "job",
    "step",
    "ts",
    "seq",
    "pid",
    "dropped",
    "hung_in",
    "ended",
    "last_collective",
    "mem_source",
    "comm_by_dim",
    "capture_id",
    "capture_state",
    "capture_path",
    *_NUMBER_FIELDS,
)
"""The fields a decoded step record holds (every other field is dropped). `hung_in` is set only
on the record a rank's hang watchdog sends: where the rank is stuck, one line. `ended` is set only
on the end-of-run record, one of `ENDED_VALUES`."""
ENDED_VALUES = ("finished", "failed")
CAPTURE_STATES = ("recording", "done", "skipped", "failed")
"""`capture_state` values: the rank's latest triggered capture (`capture_id`), carried by every
record after the rank saw the request, so a dropped record loses nothing."""
MAX_PATH_CHARS = 1024
"""`capture_path` (the capture's trace, for the monitor's analysis) is cut to this length."""
CONTROL_PORT_OFFSET = 1
"""A control socket (triggered captures: the monitor's, a relay's) listens on its data port +
this."""
CONTROL_HWM = 16
"""Control messages a control socket holds per peer (the monitor sends few: about one a second
while a capture is being asked for); beyond it they are dropped."""
CONTROL_MAX_BYTES = 4096
"""A larger frame on a control socket is refused by zmq (a capture request is ~150 bytes)."""
MAX_CAPTURE_STEPS = 20
"""A capture request records at most this many steps."""
MAX_CAPTURES_PER_RUN = 4
"""Captures a monitor asks of one job, and a rank takes in one run."""
MEM_SOURCES = ("device", "reader", "process")
"""`mem_source` values (`collectors.memory.memory_source`); any other decodes as None."""
RELAY_FIELDS = (
    "kind",
    "schema",
    "host",
    "ts",
    "forwarded",
    "dropped",
    "rejected",
    "control_forwarded",
    "control_rejected",
    "control_error",
)
"""The fields a decoded relay record holds: its records forwarded, dropped and refused; the
capture requests it re-published to its ranks and refused; the error that left it without a
control path, if it reported one (None: none reported; relays before the control path had
none and sent neither control field)."""

REJECT_REASONS = (
    "handshake",
    "token",
    "schema",
    "oversize",
    "json",
    "nested",
    "field",
    "range",
)
"""Why a message was refused, as counted by the receiver: a connection refused at its handshake
(a wrong or missing token: nothing it sent arrives, each refused attempt counts once); wrong
token frame; not 3 frames or a wrong schema frame; over `MAX_MESSAGE_BYTES` in all; not JSON
(or not UTF-8); nested; a missing or mistyped field; a number outside its range."""


class WireError(ValueError):
    """A message that is not a valid zdiag.live/1 record; `reason` is one of REJECT_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def decode(frames: list[bytes]) -> dict[str, Any]:
    """Validate a message whose token was already checked and decode it into a fixed schema.

    Returns a new dict holding only `STEP_FIELDS` (or `RELAY_FIELDS`): unknown fields are
    dropped, strings are cut to 128 characters, integers are range-checked, number fields are
    floats within `_NUMBER_RANGES` (None when absent). Raises WireError (with its `reason`) for
    anything else; no input makes it raise anything but WireError.
    """
    if len(frames) != 3 or frames[0] != SCHEMA_FRAME:
        raise WireError("schema", "not a zdiag.live/1 message")
    payload = frames[2]
    if sum(map(len, frames)) > MAX_MESSAGE_BYTES:
        raise WireError("oversize", f"message over {MAX_MESSAGE_BYTES} bytes")
    if payload.count(b"[") + payload.count(b"{") > MAX_NESTING_BRACKETS:
        raise WireError("nested", "payload is not a flat JSON object")
    try:
        obj = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise WireError("json", f"bad JSON: {str(exc)[:80]}") from None
    if not isinstance(obj, dict):
        raise WireError("json", "payload is not an object")
    kind = obj.get("kind", "step")
    if kind == "relay":
        host = obj.get("host")
        if not isinstance(host, str):
            raise WireError("field", "relay record without host")
        error = obj.get("control_error")
        return {
            "kind": "relay",
            "schema": SCHEMA,
            "host": host[:128],
            "ts": _number(obj, "ts", MAX_TS_S),
            "forwarded": _count(obj.get("forwarded")),
            "dropped": _count(obj.get("dropped")),
            "rejected": _count(obj.get("rejected")),
            "control_forwarded": _count(obj.get("control_forwarded")),
            "control_rejected": _count(obj.get("control_rejected")),
            "control_error": _text(error) if isinstance(error, str) else None,
        }
    if kind == "capture":  # `zdiag capture`: a person asks the monitor for a capture
        job = obj.get("job", "")
        reason = obj.get("reason", "")
        return {
            "kind": "capture",
            "schema": SCHEMA,
            "job": _text(job) if isinstance(job, str) else "",
            "reason": _text(reason) if isinstance(reason, str) else "",
            "ts": _number(obj, "ts", MAX_TS_S),
        }
    if kind != "step":
        raise WireError("field", f"unknown kind {str(kind)[:32]!r}")
    out: dict[str, Any] = {"kind": "step", "schema": SCHEMA}
    for name, top in (("rank", MAX_RANK), ("step", MAX_COUNT)):
        value = obj.get(name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise WireError("field", f"{name} must be an integer")
        if not 0 <= value <= top:
            raise WireError("range", f"{name} out of range")
        out[name] = value
    ts = _number(obj, "ts", MAX_TS_S)
    if ts is None:
        raise WireError("field", "ts must be a number")
    out["ts"] = ts
    out["host"] = _text(obj.get("host", "?"))
    out["job"] = _text(obj.get("job", ""))
    out["seq"] = _count(obj.get("seq"))
    pid = obj.get("pid")
    out["pid"] = (
        pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= MAX_RANK else None
    )
    out["dropped"] = _count(obj.get("dropped"))
    hung_in = obj.get("hung_in")
    out["hung_in"] = _text(hung_in) if isinstance(hung_in, str) else None
    ended = obj.get("ended")
    if ended is not None and ended not in ENDED_VALUES:
        raise WireError("field", f"ended must be one of {', '.join(ENDED_VALUES)}")
    out["ended"] = ended
    source = obj.get("mem_source")
    out["mem_source"] = source if source in MEM_SOURCES else None
    collective = obj.get("last_collective")
    out["last_collective"] = _text(collective) if isinstance(collective, str) else None
    for name, limit in _NUMBER_RANGES.items():
        out[name] = _number(obj, name, limit)
    out["comm_by_dim"] = _comm_by_dim(obj.get("comm_by_dim"))
    capture = obj.get("capture_id")
    out["capture_id"] = _count(capture) if capture is not None else None
    state = obj.get("capture_state")
    out["capture_state"] = state if state in CAPTURE_STATES else None
    path = obj.get("capture_path")
    out["capture_path"] = path[:MAX_PATH_CHARS] if isinstance(path, str) else None
    return out


def control_endpoint(data: Endpoint) -> Endpoint:
    """The control endpoint (triggered captures) of a monitor or relay listening on `data`."""
    return Endpoint(data.host, data.port + CONTROL_PORT_OFFSET)


def control_sub_socket(ctx: zmq.Context[Any], data: Endpoint, token: bytes) -> zmq.Socket[Any]:
    """A SUB socket connected to the control endpoint of `data` (a monitor's or a relay's data
    endpoint), as every control receiver (a rank's publisher, a relay) sets it up.

    Authenticated as the data path (`auth.secure_sender` with `token`), subscribed to everything,
    nothing lingers on close, at most `CONTROL_HWM` messages wait, and zmq disconnects a peer
    that sends a frame over `CONTROL_MAX_BYTES`; zmq reconnects by itself. Read it with NOBLOCK
    and `decode_control`. Raises zmq.ZMQError (with a token: no CURVE in this libzmq); nothing
    is left open then.
    """
    import zmq

    from zdiag.live.auth import secure_sender

    sub = ctx.socket(zmq.SUB)
    try:
        secure_sender(sub, token)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, CONTROL_HWM)
        sub.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(control_endpoint(data).connect_url)
    except zmq.ZMQError:
        sub.close(linger=0)
        raise
    return sub


def control_pub_socket(
    ctx: zmq.Context[Any], data: Endpoint, token: bytes
) -> tuple[zmq.Socket[Any], HandshakeGuard]:
    """A PUB socket bound on the control endpoint of `data`, as every control sender (the
    monitor's `captures.ControlSender`, a relay) sets it up, and its `auth.HandshakeGuard`.

    With a `token` only its holders connect (CURVE, a ZAP handler in `ctx`: one guarded socket
    per context); without one, `data` is on loopback (the data socket's rule). Nothing lingers
    on close, at most `CONTROL_HWM` messages wait per subscriber (then zmq drops: a PUB socket
    never blocks), and zmq disconnects a subscriber that sends a frame over
    `CONTROL_MAX_BYTES`. Raises zmq.ZMQError when the port is taken (or, with a token, this
    libzmq has no CURVE); nothing is left open then. Close the guard before the socket.
    """
    import zmq

    from zdiag.live.auth import HandshakeGuard

    sock = ctx.socket(zmq.PUB)
    guard: HandshakeGuard | None = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, CONTROL_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
        guard = HandshakeGuard(ctx, sock, token)
        sock.bind(control_endpoint(data).bind_url)
    except zmq.ZMQError:
        if guard is not None:
            guard.close()
        sock.close(linger=0)
        raise
    return sock, guard


def decode_control(frames: list[bytes], token: bytes) -> dict[str, Any] | None:
    """A capture request from the monitor's control socket, or None for anything else (a wrong
    token or schema, bad or nested JSON, a missing or out-of-range field): the rank ignores it.
    No input makes it raise."""
    if len(frames) != 3 or frames[0] != SCHEMA_FRAME or not token_matches(token, frames[1]):
        return None
    payload = frames[2]
    if len(payload) > MAX_MESSAGE_BYTES or payload.count(b"{") > 1:
        return None
    if payload.count(b"[") > MAX_NESTING_BRACKETS:  # never deep enough to exhaust the parser
        return None
    try:
        obj = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("kind") != "capture":
        return None
    fields = [obj.get(k) for k in ("id", "step", "steps")]
    ints = [v for v in fields if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    if len(ints) != len(fields):
        return None
    capture_id, step, steps = ints
    if not (0 < steps <= MAX_CAPTURE_STEPS and step <= MAX_COUNT and capture_id <= MAX_COUNT):
        return None
    job = obj.get("job", "")
    return {
        "id": capture_id,
        "step": step,
        "steps": steps,
        "job": job[:128] if isinstance(job, str) else "",
        "reason": _text(obj.get("reason", "")),
    }


MAX_DIMS = 9
"""Dimension labels a step record may carry in `comm_by_dim` (the collectors keep 8, then
"other")."""


def _comm_by_dim(value: Any) -> dict[str, tuple[float, float]] | None:
    """`comm_by_dim` checked: None when absent; WireError unless a map of at most `MAX_DIMS`
    labels of 1-32 characters to two milliseconds within `MAX_MS`, exposed <= comm."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_DIMS:
        raise WireError("field", "comm_by_dim must map at most 9 labels to [comm, exposed]")
    out = {}
    for label, pair in value.items():
        if not (isinstance(label, str) and 0 < len(label) <= 32):
            raise WireError("field", "comm_by_dim labels are 1-32 characters")
        if not (isinstance(pair, list) and len(pair) == 2):
            raise WireError("field", "comm_by_dim values are [comm_ms, exposed_comm_ms]")
        comm = _number({"v": pair[0]}, "v", MAX_MS)
        exposed = _number({"v": pair[1]}, "v", MAX_MS)
        if comm is None or exposed is None:
            raise WireError("field", "comm_by_dim values are numbers")
        out[label] = (comm, min(exposed, comm))
    return out


def _text(value: Any) -> str:
    """A string field, cut to 128 characters (a non-string becomes "?")."""
    return value[:128] if isinstance(value, str) else "?"


def _number(obj: dict[str, Any], name: str, top: float) -> float | None:
    """A number field as a float in [0, top]; None when absent or null; WireError("range")
    when finite-looking but outside (or not finite), WireError("field") when not a number."""
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WireError("field", f"{name} must be a number")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        raise WireError("range", f"{name} out of range") from None
    if not (math.isfinite(number) and 0.0 <= number <= top):
        raise WireError("range", f"{name} out of range")
    return number


def _count(value: Any) -> int:
    """A counter field: a non-negative int below 2**63, else 0."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT
    return value if ok else 0
