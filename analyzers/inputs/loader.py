"""Reading Kineto traces (JSON or JSON.gz) into columnar `RankTrace`s.

Decoding: msgspec decodes each file straight into small typed Structs that name only the fields
analysis needs (`ph`, `cat`, `name`, `pid`, `tid`, `ts`, `dur` and a handful of `args` keys);
every other key is skipped by the decoder without building Python objects. The full `args`
object is kept as raw bytes (`msgspec.Raw`) and decoded to a dict only for the few events that
need it (collectives, FSDP and step annotations). docs/analyze.md has the decoder measurements.

Bounded memory: the events are decoded in batches (`decode_batches`: a pre-scan of the event
array as raw slices, then `BATCH_EVENTS` events at a time), each batch is reduced to numpy
columns and small interning tables at once, and the columns are joined in file order. An
uncompressed file is memory-mapped, not read; a big one is decoded by forked worker processes
on machines with several cores (`workers`). `kineto_batches` holds the decode schema and the
per-batch columns, `kineto_columns` their joining; this module reads the bytes and builds the
`RankTrace`. The reader returns events only: the map derives the collectives table from them
(`rank/collective_table.py`).

Every failure that the user can fix (missing or empty file, not JSON, truncated gzip or JSON,
JSON without `traceEvents`, non-numeric or NaN `ts`/`dur`) raises `InputError` with one sentence
naming the file, the problem and what to do.
"""

from __future__ import annotations

import gc
import mmap
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zdiag.errors import InputError

from .decode_batches import (
    BATCH_EVENTS,
    Buffer,
    TraceHeader,
    auto_workers,
    decode_spans,
    scan_trace,
)
from .events import (
    Lane,
    MemoryEvents,
    RankTrace,
    as_int,
    as_int64,
    is_device_category,
)
from .kineto_batches import EVENTS_DECODER, Batch, KeptArgs, columns_of_batch, kind_code
from .kineto_columns import Columns, drop_time_outliers, join_batches
from .reader import Reader
from .safe_read import (
    GZIP_MAGIC,
    current_limits,
    open_regular,
    read_capped,
    read_open,
)

# --- reading bytes --------------------------------------------------------------------------


def read_trace_bytes(path: Path, what: str = "trace") -> bytes | bytearray:
    """The (decompressed) bytes of a trace file (or another JSON input: `what` names it);
    InputError for a missing, empty, special (FIFO, device), oversized or corrupt gzip file."""
    with open_regular(path, what) as f:
        return read_open(f, path, what)


@contextmanager
def open_trace_buffer(path: Path) -> Iterator[Buffer]:
    """The trace's JSON text: a read-only memory map of an uncompressed regular file (pages are
    read on demand and can be dropped once decoded), else the decompressed bytes.

    Only regular files are opened (`safe_read.open_regular`: a FIFO or a device is refused,
    never read); the size cap of `safe_read.current_limits` applies to both forms.
    """
    with open_regular(path, "trace") as f:
        head = f.read(2)
        size = os.fstat(f.fileno()).st_size
        if not head or head == GZIP_MAGIC or size == 0:
            f.seek(0)
            yield read_open(f, path, "trace")  # empty or gzip
            return
        limit = current_limits().max_bytes
        if size > limit:
            read_capped(f, path, "trace", limit)  # raises the too-big sentence
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # not mappable: read it
            f.seek(0)
            yield read_open(f, path, "trace")
            return
        try:
            yield mm
        finally:
            try:
                mm.close()
            except BufferError:  # a view is still alive (only on an error path): GC closes it
                pass


# --- recognizing a trace --------------------------------------------------------------------

TRACE_SUFFIXES = (".json", ".json.gz")
_NOT_TRACES = ("manifest", "timeline", "snapshot", ".oom.", "report", "metrics")


def is_trace_name(name: str) -> bool:
    """Whether a file name is a trace's (`*.json`, `*.json.gz`, not a manifest, memory timeline,
    snapshot, OOM record, report or metrics file); hidden and temporary files (being written)
    are not."""
    low = name.lower()
    if low.startswith(".") or ".tmp" in low or low.endswith("~"):
        return False
    return low.endswith(TRACE_SUFFIXES) and not any(x in low for x in _NOT_TRACES)


def _sniff(path: str | Path, head: bytes) -> bool:
    """A trace's file name, or content that starts as gzip or as a JSON object."""
    return is_trace_name(Path(path).name) or head[:2] == GZIP_MAGIC or head.lstrip()[:1] == b"{"


# --- rank inference -------------------------------------------------------------------------

_RANK_PATTERNS = (
    re.compile(r"rank[-_]?(\d+)", re.IGNORECASE),  # rank-3, rank3, rank_3, rank34_of_300
    re.compile(r"(?:^|[_\-.])(\d+)_of_\d+", re.IGNORECASE),  # trace_3_of_8
    re.compile(r"(?:^|[_\-.])r(\d+)(?:[_\-.]|$)", re.IGNORECASE),  # trace.r3.json
)


def rank_from_file_name(path: Path) -> int | None:
    """The rank encoded in a file name (rank-3, rank3, rank_3, _3_of_8, .r3.), or None."""
    name = path.name
    for rx in _RANK_PATTERNS:
        m = rx.search(name)
        if m:
            return int(m.group(1))
    return None


# --- the RankTrace ---------------------------------------------------------------------------


def _lane_name(
    pid: Any, tid: Any, is_device: bool, thread_names: dict[tuple[Any, Any], str]
) -> str:
    named = thread_names.get((pid, tid))
    if named:
        return named.strip()
    if is_device:
        return f"GPU {pid} stream {tid}"
    return f"thread {tid}"


@dataclass
class _EventColumns:
    """The per-event columns of a RankTrace, in one order (file order, then start time)."""

    ts: np.ndarray
    dur: np.ndarray
    name_id: np.ndarray
    lane_id: np.ndarray
    kind: np.ndarray
    correlation: np.ndarray
    external_id: np.ndarray
    args: KeptArgs

    def sorted_by_time(self) -> _EventColumns:
        """The columns sorted by start time (stable: ties keep file order)."""
        n = len(self.ts)
        order = np.argsort(self.ts, kind="stable")
        if not n or (order == np.arange(n)).all():
            return self
        new_pos = np.empty(n, dtype=np.int64)
        new_pos[order] = np.arange(n)
        return _EventColumns(
            ts=self.ts[order],
            dur=self.dur[order],
            name_id=self.name_id[order],
            lane_id=self.lane_id[order],
            kind=self.kind[order],
            correlation=self.correlation[order],
            external_id=self.external_id[order],
            args=self.args.reindexed(new_pos),
        )


def _event_columns(cols: Columns, dur: np.ndarray) -> tuple[_EventColumns, list[str], list[Lane]]:
    """The per-event columns in file order, the interned names and the lanes, from the distinct
    (name, cat, pid, tid) keys; a lane is a device lane if any event on it has a device
    category."""
    distinct, key_id, n = cols.keys, cols.key_id, len(cols.ts)
    name_ids: dict[str, int] = {}
    lane_ids: dict[tuple[Any, Any], int] = {}
    k_name = np.empty(len(distinct), np.int32)
    k_lane = np.empty(len(distinct), np.int32)
    k_kind = np.empty(len(distinct), np.uint8)
    k_device = np.empty(len(distinct), bool)
    for j, (nm, ct, pid, tid) in enumerate(distinct):
        k_name[j] = name_ids.setdefault(nm, len(name_ids))
        k_lane[j] = lane_ids.setdefault((pid, tid), len(lane_ids))
        k_kind[j] = kind_code(ct, nm)
        k_device[j] = is_device_category(ct)
    lane_is_device = np.zeros(len(lane_ids), dtype=bool)
    if len(distinct):
        np.logical_or.at(lane_is_device, k_lane, k_device)
    lanes = [
        Lane(
            pid,
            tid,
            _lane_name(pid, tid, bool(lane_is_device[j]), cols.thread_names),
            bool(lane_is_device[j]),
        )
        for j, (pid, tid) in enumerate(lane_ids)
    ]
    columns = _EventColumns(
        ts=cols.ts,
        dur=dur,
        name_id=k_name[key_id] if n else np.zeros(0, np.int32),
        lane_id=k_lane[key_id] if n else np.zeros(0, np.int32),
        kind=k_kind[key_id] if n else np.zeros(0, np.uint8),
        correlation=cols.correlation,
        external_id=cols.external_id,
        args=KeptArgs(cols.kept),
    )
    return columns, list(name_ids), lanes


def build_rank_trace(cols: Columns, header: TraceHeader, path: Path) -> RankTrace:
    """The RankTrace of joined columns; rank from distributedInfo (or 0, rank_source "default").

    The caller (`load_rank_trace`) fixes the rank from the manifest / file name when
    distributedInfo has none.
    """
    cols = drop_time_outliers(cols)
    warnings = cols.warnings
    n = len(cols.ts)
    dur = cols.dur
    if n and (dur < 0).any():
        count = int((dur < 0).sum())
        warnings.append(f"{count} events with a negative duration were treated as zero-length")
        dur = np.maximum(dur, 0.0)
    events, names, lanes = _event_columns(cols, dur)
    events = events.sorted_by_time()
    info = header.distributedInfo if isinstance(header.distributedInfo, dict) else None
    rank = _distributed_rank(info, path)
    trace = RankTrace(
        rank=rank if rank is not None else 0,
        rank_source="distributedInfo" if rank is not None else "default",
        source=path,
        device="cpu",
        names=names,
        name_id=events.name_id,
        ts_us=events.ts,
        dur_us=events.dur,
        lane_id=events.lane_id,
        lanes=lanes,
        kind=events.kind,
        correlation=events.correlation,
        external_id=events.external_id,
        args=events.args,
        distributed_info=info,
        device_properties=[p for p in (header.deviceProperties or []) if isinstance(p, dict)],
        host=header.host_name,
        base_time_ns=as_int64(header.baseTimeNanoseconds),
        trace_start_us=float(events.ts[0]) if n else 0.0,
        warnings=warnings,
        memory_events=MemoryEvents.of_rows(cols.memory) if cols.memory else None,
    )
    trace.device = _device_kind(trace)
    return trace


MAX_RANK = 2**31 - 1
"""Ranks are 32-bit in torch.distributed."""


def _distributed_rank(info: dict[str, Any] | None, path: Path) -> int | None:
    """distributedInfo's rank, None when absent; InputError when it is no rank at all
    (not an integer, negative, or beyond 32 bits)."""
    if not info or info.get("rank") is None:
        return None
    value = info["rank"]
    rank = as_int(value)
    if rank is None or not 0 <= rank <= MAX_RANK:
        raise InputError(
            f"{path}: distributedInfo.rank is {str(value)[:40]}, not a rank (an integer from 0 "
            f"to {MAX_RANK}), so the trace header is damaged; fix or remove distributedInfo.rank."
        )
    return rank


def _device_kind(trace: RankTrace) -> str:
    """ "rocm", "cuda" or "cpu" from device properties, runtime names and device events."""
    gpu_names = " ".join(str(p.get("name", "")) for p in trace.device_properties)
    hip = any(n.startswith("hip") for n in trace.names)
    if hip or re.search(r"\b(AMD|Radeon|Instinct|MI\d{3})", gpu_names):
        return "rocm"
    if trace.has_device_events:
        return "cuda"
    return "cpu"


# --- collectives ----------------------------------------------------------------------------


def _reporting(
    batches: Iterable[Batch], ends: list[int], total: int, on_fraction: Callable[[float], None]
) -> Iterator[Batch]:
    """`batches` (one per span, in file order), calling `on_fraction` after each."""
    for batch, end in zip(batches, ends, strict=False):
        yield batch
        on_fraction(min(end / total, 1.0) if total else 1.0)
    on_fraction(1.0)


def load_rank_trace(
    path: Path,
    *,
    workers: int | None = None,
    batch_events: int = BATCH_EVENTS,
    on_fraction: Callable[[float], None] | None = None,
) -> RankTrace:
    """Read, decode and columnize one trace file (rank from distributedInfo or "default").

    The events are decoded `batch_events` at a time; `workers` decode processes (None: by file
    size and cores, see `decode_batches.auto_workers`; 1: in this process). The result does not
    depend on either. `on_fraction`, when given, is called with the share of the JSON decoded
    (0..1) after each batch, for a byte-based progress line on one big file.
    """
    with open_trace_buffer(path) as buf:
        scan = scan_trace(buf, path, batch_events)
        if not scan.has_events:
            raise InputError(
                f"{path}: is JSON but has no 'traceEvents' list; pass a Kineto trace exported by torch.profiler."
            )
        n_workers = auto_workers(len(buf)) if workers is None else workers
        gc_was_enabled = gc.isenabled()
        gc.disable()  # millions of small objects: the cyclic GC would rescan them repeatedly
        try:
            batches = decode_spans(
                buf, scan, EVENTS_DECODER, columns_of_batch, path, workers=n_workers
            )
            if on_fraction is not None:
                batches = _reporting(batches, [s.end for s in scan.spans], len(buf), on_fraction)
            cols = join_batches(batches, path)
        finally:
            if gc_was_enabled:
                gc.enable()
    return build_rank_trace(cols, scan.header, path)


READER = Reader(
    name="kineto-trace",
    kind="trace",
    what="Kineto trace (torch.profiler's JSON or JSON.gz export)",
    sniff=_sniff,
    read=load_rank_trace,
)
