"""Decoding a trace's event array in bounded batches, in this process or in forked workers.

Decoding a whole multi-GB Kineto document into typed Structs at once keeps the file bytes and
~540 bytes of Python objects per event alive together (3.6 GB for a 1 GB trace). Instead:

1. `scan_trace` decodes the document once with the event array as `list[msgspec.Raw]` (zero-copy
   views into the buffer, ~1 GB/s), keeps the few top-level blocks analysis reads, and records
   the byte range of every `batch_events` consecutive events (a `Span`). The `Raw` list is
   dropped before any event is decoded.
2. `decode_spans` decodes one span at a time (its bytes wrapped in `[...]`) with the caller's
   typed decoder and hands the event list to the caller's `build` function, which keeps only
   compact columns; the events are dropped before the next span. For big files on machines with
   several cores, contiguous groups of spans go to forked worker processes (they share the
   parent's buffer copy-on-write, or the file mapping), and the per-span results come back in
   file order.

When the buffer is a read-only `mmap` of the file, the pages already decoded are released from
this process (`madvise(MADV_DONTNEED)`): they stay in the OS page cache, not in the process.
"""

from __future__ import annotations

import gc
import itertools
import mmap
import multiprocessing
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from zdiag.errors import InputError

BATCH_EVENTS = 16384
"""Events decoded together: ~3 MB of JSON and ~9 MB of Structs on a typical trace. Measured on a
500 MB trace: 16k events per batch decodes ~1.5x faster than 64k (whose bigger heap of
short-lived objects costs page faults) and as fast as 4k."""

PARALLEL_MIN_BYTES = 64 * 1024 * 1024
"""Below this much JSON, one process decodes (forking costs more than it saves)."""

MAX_WORKERS = 8
"""At most this many decode processes for one file."""

TASKS_PER_WORKER = 4
"""Spans are handed out in this many contiguous groups per worker (balances uneven load)."""

T = TypeVar("T")
Buffer = bytes | bytearray | mmap.mmap


class TraceHeader(msgspec.Struct, gc=False):
    """The top-level blocks of a Kineto trace, with the events left as raw JSON slices."""

    traceEvents: list[msgspec.Raw] | None = None
    distributedInfo: dict[str, Any] | None = None
    deviceProperties: list[dict[str, Any]] | None = None
    host_name: str | None = None
    baseTimeNanoseconds: int | float | None = None


_HEADER_DECODER = msgspec.json.Decoder(TraceHeader)
_ARRAY_DECODER = msgspec.json.Decoder(list[msgspec.Raw])
_NON_SPACE = re.compile(rb"\S")
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Span:
    """Consecutive events: the index of the first, how many, and their bytes [start, end)."""

    first: int
    count: int
    start: int
    end: int


@dataclass
class Scan:
    """What the pre-scan found: the top-level blocks, whether traceEvents exists, the spans."""

    header: TraceHeader  # traceEvents is always None here (the raw list is dropped)
    has_events: bool
    spans: list[Span]
    bare_array: bool  # the document is a bare JSON array of events


# --- errors ---------------------------------------------------------------------------------


def _has_nan_token(buf: Buffer) -> bool:
    """True when the text holds a bare NaN/Infinity token (Python's json writes them)."""
    return re.search(rb"[:\[,]\s*-?(NaN|Infinity)\b", buf) is not None


def not_utf8(exc: Exception) -> bool:
    """Whether a decode failure is bytes that are not UTF-8: msgspec before 0.23 raised
    UnicodeDecodeError, 0.23 a DecodeError "Invalid UTF-8 encoded string"."""
    return isinstance(exc, UnicodeDecodeError) or (
        isinstance(exc, msgspec.DecodeError) and "utf-8" in str(exc).lower()
    )


def _bad_byte(exc: Exception, buf: Buffer) -> str:
    """ " (byte 0x..)" for the first byte that is not UTF-8, "" when it cannot be told."""
    if not isinstance(exc, UnicodeDecodeError):
        try:
            bytes(buf).decode("utf-8")
            return ""
        except UnicodeDecodeError as found:
            exc = found
    return f" (byte 0x{exc.object[exc.start]:02x})"


def decode_error(exc: Exception, buf: Buffer, path: Path) -> InputError:
    """The InputError sentence for a decode failure (truncated, NaN tokens, invalid JSON, bytes
    that are not UTF-8, nesting deeper than the decoder's limit)."""
    if not_utf8(exc):
        return InputError(
            f"{path}: holds bytes that are not UTF-8 text{_bad_byte(exc, buf)}, "
            "so the file is damaged; copy it again or re-export the trace."
        )
    if isinstance(exc, RecursionError):
        return InputError(
            f"{path}: holds JSON nested deeper than the decoder's limit "
            f"(about {sys.getrecursionlimit()} levels), which no profiler writes; "
            "re-export the trace."
        )
    if isinstance(exc, msgspec.ValidationError):
        return InputError(
            f"{path}: is JSON but not a Kineto trace ({exc}); pass a trace exported by torch.profiler."
        )
    msg = str(exc)
    if "truncated" in msg.lower():
        problem = "the JSON is truncated (the file ends early)"
        todo = "copy the file again or re-export the trace"
    elif _has_nan_token(buf):
        problem = "it holds NaN or Infinity where numbers are expected"
        todo = "re-export the trace or fix the event times"
    else:
        problem = f"it is not valid JSON ({msg})"
        todo = "check that it is a Kineto trace and was fully written"
    return InputError(f"{path}: {problem}; {todo}.")


_BATCH_PATH = re.compile(r"`\$\[(\d+)\]")


def _batch_validation_error(
    exc: msgspec.ValidationError, span: Span, bare_array: bool
) -> msgspec.ValidationError:
    """The batch decoder's error with its `$[k]` path rewritten to the event's place in the file."""
    prefix = "$" if bare_array else "$.traceEvents"

    def fix(m: re.Match[str]) -> str:
        return f"`{prefix}[{span.first + int(m.group(1))}]"

    return msgspec.ValidationError(_BATCH_PATH.sub(fix, str(exc), count=1))


# --- the pre-scan ---------------------------------------------------------------------------


def check_json_start(buf: Buffer, path: Path) -> None:
    """InputError unless the text (after a byte-order mark and spaces) opens an object or array."""
    body_from = len(_BOM) if buf[: len(_BOM)] == _BOM else 0
    m = _NON_SPACE.search(buf, body_from)
    head = buf[m.start() : m.start() + 1] if m else b""
    if head not in (b"{", b"["):
        start = buf[m.start() : m.start() + 12] if m else b""
        raise InputError(
            f"{path}: is not JSON (it starts with {start!r}); pass a Kineto trace exported by torch.profiler (.json or .json.gz)."
        )


def scan_trace(buf: Buffer, path: Path, batch_events: int = BATCH_EVENTS) -> Scan:
    """Decode the document with the events as raw slices; InputError for any decode failure."""
    check_json_start(buf, path)
    body_from = len(_BOM) if buf[: len(_BOM)] == _BOM else 0
    m = _NON_SPACE.search(buf, body_from)
    bare = m is not None and buf[m.start() : m.start() + 1] == b"["
    with memoryview(buf) as view, view[body_from:] as body:
        try:
            if bare:
                header = TraceHeader(traceEvents=_ARRAY_DECODER.decode(body))
            else:
                header = _HEADER_DECODER.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise decode_error(exc, buf, path) from None
        raws = header.traceEvents
        header.traceEvents = None
        if isinstance(buf, mmap.mmap):  # the scanned pages: keep them in the page cache only
            buf.madvise(mmap.MADV_DONTNEED)
        spans = _spans(buf, raws, batch_events) if raws is not None else []
        has_events = raws is not None
        del raws
    return Scan(header=header, has_events=has_events, spans=spans, bare_array=bare)


def _spans(buf: Buffer, raws: list[msgspec.Raw], batch_events: int) -> list[Span]:
    """The byte ranges of each run of `batch_events` events (Raw slices point into `buf`)."""
    base = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    spans = []
    n = len(raws)
    for first in range(0, n, max(1, batch_events)):
        last = min(first + batch_events, n) - 1
        start = np.frombuffer(raws[first], dtype=np.uint8).ctypes.data - base
        tail = raws[last]
        end = np.frombuffer(tail, dtype=np.uint8).ctypes.data - base + len(tail)
        spans.append(Span(first, last - first + 1, start, end))
    return spans


# --- decoding spans -------------------------------------------------------------------------


@dataclass
class _Job(Generic[T]):
    """What a decode process needs: shared with forked workers through a module global."""

    buf: Buffer
    decoder: msgspec.json.Decoder[Any]
    build: Callable[[Any], T]
    path: Path
    bare_array: bool


_FORK_JOB: _Job[Any] | None = None


def _decode_span(job: _Job[T], span: Span) -> T:
    """Decode one span's events and build its result; the events are dropped on return."""
    data = b"".join((b"[", job.buf[span.start : span.end], b"]"))
    try:
        events = job.decoder.decode(data)
    except msgspec.ValidationError as exc:
        err = _batch_validation_error(exc, span, job.bare_array)
        raise decode_error(err, job.buf, job.path) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise decode_error(exc, job.buf, job.path) from None
    del data
    out = job.build(events)
    del events
    if isinstance(job.buf, mmap.mmap):  # drop the decoded pages from this process
        lo = span.start - span.start % mmap.PAGESIZE
        job.buf.madvise(mmap.MADV_DONTNEED, lo, span.end - lo)
    return out


def _run_group(spans: list[Span]) -> list[Any]:
    """Worker body: decode a contiguous group of spans of the job inherited at fork."""
    job = _FORK_JOB
    if job is None:  # pragma: no cover - only reachable if the pool was not forked
        raise RuntimeError("decode worker started without a job (not forked?)")
    return [_decode_span(job, s) for s in spans]


def fork_available() -> bool:
    """True where decode workers can be forked: Linux, not inside a daemonic process, and only
    one thread (forking a threaded process can copy a lock another thread holds: a UI that
    loads traces from a worker thread decodes in-process instead)."""
    return (
        sys.platform.startswith("linux")
        and "fork" in multiprocessing.get_all_start_methods()
        and not multiprocessing.current_process().daemon
        and threading.active_count() == 1
    )


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def auto_workers(json_bytes: int, cores: int | None = None) -> int:
    """Decode processes for one file of this size: 1 when small or on one core.

    `cores`: the cores this file may use (default: all usable ones); a caller that already
    loads several files in parallel passes its share so that processes do not multiply.
    """
    if json_bytes < PARALLEL_MIN_BYTES or not fork_available():
        return 1
    return max(1, min(usable_cores() if cores is None else cores, MAX_WORKERS))


def _groups(spans: list[Span], n_groups: int) -> list[list[Span]]:
    """`spans` cut into at most `n_groups` contiguous groups of near-equal size, in order."""
    n_groups = max(1, min(n_groups, len(spans)))
    bounds = np.linspace(0, len(spans), n_groups + 1).round().astype(int)
    return [spans[a:b] for a, b in itertools.pairwise(bounds.tolist()) if b > a]


def decode_spans(
    buf: Buffer,
    scan: Scan,
    decoder: msgspec.json.Decoder[Any],
    build: Callable[[Any], T],
    path: Path,
    *,
    workers: int = 1,
) -> Iterator[T]:
    """`build(events)` for each span, in file order; forked workers when `workers` > 1.

    The first failure in file order is raised (InputError for a decode problem).
    """
    job = _Job(buf, decoder, build, path, scan.bare_array)
    if workers <= 1 or len(scan.spans) < 2 or not fork_available():
        for span in scan.spans:
            yield _decode_span(job, span)
        return
    yield from _decode_forked(job, scan.spans, min(workers, len(scan.spans)))


def _decode_forked(job: _Job[T], spans: list[Span], workers: int) -> Iterator[T]:
    """Decode groups of spans in `workers` forked processes; results in file order."""
    global _FORK_JOB
    groups = _groups(spans, workers * TASKS_PER_WORKER)
    _FORK_JOB = job
    try:
        ctx = multiprocessing.get_context("fork")
        # the inherited heap frozen out of each worker's garbage collector (plain_pickle._child)
        with ctx.Pool(workers, initializer=gc.freeze) as pool:
            _FORK_JOB = None  # the children have their copy; the parent needs none
            for results in pool.imap(_run_group, groups):
                yield from results
    finally:
        _FORK_JOB = None
