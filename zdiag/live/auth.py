"""Peer authentication for the live stream: no frame from a peer without the job's token.

ZeroMQ hands a multipart message over only once all its frames have arrived and does not bound
their number, so a check on the message (its token frame) comes too late: any peer that can
connect could make the receiver hold one huge message first. Here the peers authenticate at the
ZMTP handshake instead, before zmq accepts any message frame from them:

- With a token, every socket uses CURVE. Two key pairs are derived from the token
  (HMAC-SHA256 of the token, one per role): the receiver's (monitor, relay) and one shared by
  all senders (publishers, relays forwarding). A sender must know the receiver's public key to
  start the handshake at all, and the receiver's ZAP handler (`zmq.auth.thread.ThreadAuthenticator`)
  accepts only the senders' public key. Both are computable only from the token, which never
  crosses the network; the records are encrypted on the way.
- Without a token, the sockets use ZMTP's NULL mechanism: the receiver may then listen only on
  loopback (`LiveReceiver` refuses anything else), so only processes of its own machine connect.

A refused handshake (wrong or missing token, or a peer that does not speak ZMTP) delivers
nothing; `HandshakeGuard.refused()` counts them from the socket's monitor events.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

ZAP_DOMAIN = "zdiag.live"
_KEY_LABEL = b"zdiag.live/1 curve key "
REFUSED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""The socket monitor events of a connection refused during the handshake."""


def curve_keys(token: bytes, role: str) -> tuple[bytes, bytes]:
    """The Z85 (public, secret) CURVE key pair of `role` ("receiver" or "sender") for `token`."""
    secret = z85.encode(hmac.new(token, _KEY_LABEL + role.encode(), hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def secure_sender(sock: zmq.Socket[Any], token: bytes) -> None:
    """Set a sending socket's CURVE client keys for `token` (nothing without a token).

    Call before `connect`. Raises zmq.ZMQError when this libzmq has no CURVE support.
    """
    if not token:
        return
    public, secret = curve_keys(token, "sender")
    sock.curve_serverkey = curve_keys(token, "receiver")[0]
    sock.curve_publickey = public
    sock.curve_secretkey = secret


class _SenderKey:
    """The ZAP credentials check: the one sender public key the token gives."""

    def __init__(self, token: bytes) -> None:
        self._public = curve_keys(token, "sender")[0]

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether the connecting peer's Z85 public key is the senders' key."""
        return hmac.compare_digest(key, self._public)


class HandshakeGuard:
    """A receiving socket's authentication: CURVE server keys and a ZAP handler for the token's
    senders, and a count of refused handshakes (with or without a token). Call before `bind`."""

    def __init__(self, ctx: zmq.Context[Any], sock: zmq.Socket[Any], token: bytes) -> None:
        """Secure `sock` (a socket of `ctx`) for `token`; raises zmq.ZMQError without CURVE."""
        self._auth: ThreadAuthenticator | None = None
        if token:
            public, secret = curve_keys(token, "receiver")
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN.encode()
            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve_callback(ZAP_DOMAIN, _SenderKey(token))
        self._events: zmq.Socket[Any] = sock.get_monitor_socket(REFUSED_EVENTS)
        self._events.setsockopt(zmq.LINGER, 0)
        self._refused = 0

    def refused(self) -> int:
        """Handshakes refused so far (reads the monitor events that arrived since the last call)."""
        while self._events.poll(0):
            event = parse_monitor_message(self._events.recv_multipart())
            if event["event"] & REFUSED_EVENTS:
                self._refused += 1
        return self._refused

    def close(self) -> None:
        """Stop the ZAP handler and the event socket (before the context is terminated)."""
        self._events.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
