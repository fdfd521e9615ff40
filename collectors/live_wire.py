"""The live stream's wire format, shared by the publisher, the per-node relay and the monitor.

One message is three ZeroMQ frames: ``[SCHEMA, token, payload]``.

- ``SCHEMA`` is ``b"zdiag.live/1"``. New record fields may be added; none is renamed or removed.
- ``token`` is the shared secret (``ZDIAG_MONITOR_TOKEN``), empty when none is set. It
  authenticates, it does not encrypt: on untrusted networks tunnel the port over ssh.
- ``payload`` is one JSON object. A step record carries ``kind="step"``, ``rank``, ``host``,
  ``step``, ``step_time_ms``, ``mem_allocated_bytes``, ``mem_reserved_bytes``, ``mem_peak_bytes``,
  ``samples_per_s``, optionally ``compute_ms``, ``comm_ms``, ``exposed_comm_ms``, and the publisher
  adds ``job``, ``ts`` (unix seconds when ``publish`` was called), ``seq`` and ``dropped`` (records
  this publisher dropped so far). A relay sends ``kind="relay"`` records with its own counters.

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

SCHEMA = "zdiag.live/1"
SCHEMA_FRAME = SCHEMA.encode()
MAX_MESSAGE_BYTES = 64 * 1024  # a step record is ~400 bytes; larger messages are refused by zmq
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


def push_socket(ctx: zmq.Context[Any], target: Endpoint, send_hwm: int) -> zmq.Socket[Any]:
    """A PUSH socket connected to `target` as every sender (publisher, relay) sets it up.

    Nothing lingers on close, at most `send_hwm` messages wait for a connected but slow peer,
    nothing is queued for a peer that is not connected (``IMMEDIATE``), and zmq reconnects by
    itself every ``RECONNECT_IVL_MS`` (backing off to ``RECONNECT_IVL_MAX_MS``).
    """
    import zmq

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.connect(target.connect_url)
    return sock


class WireError(ValueError):
    """A message that is not a valid zdiag.live/1 record."""


def decode(frames: list[bytes]) -> dict[str, Any]:
    """Validate and decode the payload of a message whose token was already checked.

    Raises WireError for anything malformed: wrong frame count or schema, bad JSON, missing or
    mistyped fields. Number fields are coerced to float (None when absent).
    """
    if len(frames) != 3 or frames[0] != SCHEMA_FRAME:
        raise WireError("not a zdiag.live/1 message")
    try:
        obj = json.loads(frames[2])
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"bad JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError("payload is not an object")
    kind = obj.get("kind", "step")
    if kind == "relay":
        if not isinstance(obj.get("host"), str):
            raise WireError("relay record without host")
        obj["host"] = obj["host"][:128]
        for name in ("forwarded", "dropped", "rejected"):
            obj[name] = _count(obj.get(name))
        return obj
    if kind != "step":
        raise WireError(f"unknown kind {kind!r}")
    for name in ("rank", "step"):
        if not isinstance(obj.get(name), int) or isinstance(obj.get(name), bool):
            raise WireError(f"{name} must be an integer")
    ts = obj.get("ts")
    if not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise WireError("ts must be a number")
    obj["ts"] = float(ts)
    obj["host"] = str(obj.get("host", "?"))[:128]
    obj["job"] = str(obj.get("job", ""))[:128]
    obj["kind"] = "step"
    for name in _NUMBER_FIELDS:
        value = obj.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            obj[name] = float(value)
        else:
            obj[name] = None
    obj["dropped"] = _count(obj.get("dropped"))
    if not isinstance(obj.get("pid"), int):
        obj["pid"] = None
    return obj


def _count(value: Any) -> int:
    """A counter field: a non-negative int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
