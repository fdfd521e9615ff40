"""A hand-made ZMTP 3.1 peer for attack tests: it speaks the NULL mechanism (no credential) and,
once the receiver answered, writes one multipart message as fast as the receiver takes it, and
keeps writing even when the receiver refused the handshake (what a hostile peer would do)."""

from __future__ import annotations

import socket
import struct

_MORE = 0x01
_LONG = 0x02
_COMMAND = 0x04
_GREETING_BYTES = 64


def _frame(body: bytes, flags: int) -> bytes:
    if len(body) > 255:
        return bytes([flags | _LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def _handshake() -> bytes:
    """The greeting (NULL mechanism, as a client) and the READY command of a PUSH socket."""
    greeting = b"\xff" + bytes(7) + b"\x01\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\0")
    greeting += bytes(_GREETING_BYTES - len(greeting))
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
    return greeting + _frame(ready, _COMMAND)


def _message(frames: list[bytes]) -> bytes:
    return b"".join([_frame(f, _MORE) for f in frames[:-1]] + [_frame(frames[-1], 0)])


def _read_handshake(sock: socket.socket) -> None:
    """Read the receiver's greeting and first command (its READY, or ERROR), or until it closes."""
    got = b""
    while len(got) < _GREETING_BYTES + 2:
        chunk = sock.recv(4096)
        if not chunk:
            return
        got += chunk
    size = got[_GREETING_BYTES + 1]  # a short command frame: flags, one size byte, body
    while len(got) < _GREETING_BYTES + 2 + size and (chunk := sock.recv(4096)):
        got += chunk


def send_null_peer(port: int, frames: list[bytes], timeout_s: float = 5.0) -> int:
    """Connect to 127.0.0.1:`port` with no credential and write the message of `frames`; return
    the bytes of it the receiver took before it closed the connection or stopped reading."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(_handshake())
            _read_handshake(sock)
            view = memoryview(_message(frames))
            while sent < len(view):
                sent += sock.send(view[sent : sent + (1 << 20)])
            # wait for the receiver to close: closing first, with its bytes unread, would reset
            # the connection and discard what the receiver has not read yet
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(1.0)
            while sock.recv(4096):
                pass
        except OSError:  # the receiver closed the connection (or stopped reading)
            pass
    return sent
