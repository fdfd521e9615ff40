"""The input formats zdiag reads, one Reader each (`reader.Reader`: `sniff` and `read`).

A new format (an Nsight Systems SQLite export, say) is one module in inputs/ that defines its
`READER`, plus one line in `READERS`. `reader_for(path)` asks the readers in `READERS` order and
returns the first that recognizes the input: name-based formats come before content-based ones,
and the Kineto trace, which accepts any JSON, comes last.
"""

from __future__ import annotations

from pathlib import Path

from . import (
    cuda_snapshot,
    flight_dumps,
    loader,
    memory_timeline,
    model_facts,
    remote_traces,
)
from .reader import Reader

HEAD_BYTES = cuda_snapshot.PEEK_BYTES
"""Bytes of a local file read once for the readers' `sniff` (a snapshot's first keys fit)."""

READERS: tuple[Reader, ...] = (
    remote_traces.READER,
    memory_timeline.READER,
    model_facts.READER,
    cuda_snapshot.READER,
    flight_dumps.READER,
    loader.READER,
)
"""Every input format, in the order `reader_for` asks them."""


def head_of(path: str | Path) -> bytes:
    """The first HEAD_BYTES bytes of a local regular file; b"" for a URL, a folder, a FIFO, a
    device or a file that cannot be read (it is never opened then)."""
    if remote_traces.is_url(path):
        return b""
    p = Path(path)
    try:
        if not p.is_file():
            return b""
        with p.open("rb") as f:
            return f.read(HEAD_BYTES)
    except OSError:
        return b""


def trace_reader_for(path: str | Path) -> Reader:
    """The trace format of `path` (a local file): the first "trace" reader that recognizes it,
    else the Kineto trace reader, whose `read` says in one sentence what is wrong with it."""
    head = head_of(path)
    found = (r for r in READERS if r.kind == "trace" and r.sniff(path, head))
    return next(found, loader.READER)


def reader_for(path: str | Path) -> Reader | None:
    """The Reader of the first format in READERS that recognizes `path`, None when none does."""
    head = head_of(path)
    return next((r for r in READERS if r.sniff(path, head)), None)
