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
on machines with several cores (`workers`).

Every failure that the user can fix (missing or empty file, not JSON, truncated gzip or JSON,
JSON without `traceEvents`, non-numeric or NaN `ts`/`dur`) raises `InputError` with one sentence
naming the file, the problem and what to do.
"""

from __future__ import annotations

import gc
import mmap
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
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
    EventKind,
    Lane,
    MemoryEvents,
    RankTrace,
    as_int,
    classify,
    is_device_category,
)
from .safe_read import (
    GZIP_MAGIC,
    current_limits,
    open_regular,
    read_capped,
    read_open,
)

# --- the decode schema: only what analysis reads --------------------------------------------

_RAW_EMPTY = msgspec.Raw(b"")


class _Args(msgspec.Struct, gc=False):
    """The `args` keys analysis reads; every other key is skipped by the decoder.

    Ids are read for every event. The collective keys are present only on collective kernels
    and ops. Big per-op shape lists stay raw bytes and are decoded only for kept events.
    Keys map back to Kineto's spelling in `ARGS_KEYS` when `RankTrace.args` is built.
    """

    external_id: Any = msgspec.field(default=None, name="External id")
    correlation: Any = None
    name: Any = None  # thread_name / process_name metadata
    collective_name: Any = msgspec.field(default=None, name="Collective name")
    in_msg_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_msg_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    dtype: Any = None
    group_size: Any = msgspec.field(default=None, name="Group size")
    pg_name: Any = msgspec.field(default=None, name="Process Group Name")
    pg_desc: Any = msgspec.field(default=None, name="Process Group Description")
    pg_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")
    input_dims: msgspec.Raw = msgspec.field(default=_RAW_EMPTY, name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default=_RAW_EMPTY, name="Input type")
    # `[memory]` instant events (profile_memory=True)
    mem_bytes: Any = msgspec.field(default=None, name="Bytes")
    total_allocated: Any = msgspec.field(default=None, name="Total Allocated")
    total_reserved: Any = msgspec.field(default=None, name="Total Reserved")
    device_type: Any = msgspec.field(default=None, name="Device Type")
    device_id: Any = msgspec.field(default=None, name="Device Id")
    addr: Any = msgspec.field(default=None, name="Addr")


ARGS_KEYS: dict[str, str] = {
    f.name: f.encode_name for f in msgspec.structs.fields(_Args) if f.name != "name"
}
"""Struct field -> Kineto args key, for the keys kept in RankTrace.args."""
_ATTR_BY_KEY = {key: attr for attr, key in ARGS_KEYS.items()}


class _Event(msgspec.Struct, gc=False):
    """One trace event, restricted to the keys analysis reads."""

    ph: str = ""
    name: str = ""
    cat: str = ""
    pid: int | float | str = 0
    tid: int | float | str = 0
    ts: float | str | None = None
    dur: float | str | None = None
    args: _Args | None = None


_RAW_DECODER = msgspec.json.Decoder()
_EVENTS_DECODER = msgspec.json.Decoder(list[_Event])

# Events whose full args are kept (decoded) in RankTrace.args.
_KEEP_ARGS_KINDS = frozenset(
    {
        EventKind.COMM_KERNEL,
        EventKind.COMM_OP,
        EventKind.FSDP_ANNOTATION,
        EventKind.PROFILER_STEP,
    }
)
_KEEP_ARGS_CODES = np.array(sorted(int(k) for k in _KEEP_ARGS_KINDS), np.uint8)


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


# --- building the columns -------------------------------------------------------------------


_Problem = tuple[str, Any]
"""A column's first bad value: ("value", the value) for non-numeric, ("nan", None) for NaN/inf."""


def _number_values(values: list[Any]) -> tuple[np.ndarray, _Problem | None]:
    """float64 column from decoded values, and its first problem (checked later, in file order)."""
    try:
        col = np.array(values, dtype=np.float64)
    except (TypeError, ValueError):
        bad = next(
            (v for v in values if not isinstance(v, int | float) and not _is_float_text(v)), None
        )
        return np.zeros(0, np.float64), ("value", bad)
    if col.size and not np.isfinite(col).all():
        return col, ("nan", None)
    return col, None


def _check_number_column(problems: list[_Problem | None], path: Path, field: str) -> None:
    """InputError for the first non-numeric value of a column, else for its first NaN/inf."""
    for kind, message in (
        ("value", "a non-numeric '{field}' ({bad!r})"),
        ("nan", "a NaN or infinite '{field}'"),
    ):
        bad = next((p for p in problems if p is not None and p[0] == kind), None)
        if bad is not None:
            what = message.format(field=field, bad=bad[1])
            raise InputError(f"{path}: an event has {what}; re-export the trace or fix that event.")


_INT_TYPES = frozenset({int, type(None)})


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class _Ids:
    """An id column of one batch: numpy's conversion (None when it failed) and the careful
    `as_int` conversion (None when both agree because every value is an int or None), and the
    first id that no 64-bit integer holds (None when all fit)."""

    fast: np.ndarray | None
    careful: np.ndarray | None
    out_of_range: Any = None


def _id_values(values: list[Any]) -> _Ids:
    """int64 ids (External id, correlation) of one batch; -1 where absent or not an integer.

    The trace-wide column is numpy's conversion unless it fails on some batch, then `as_int`'s
    everywhere (`_join_ids`), as when the whole column was converted at once.
    """
    try:
        fast: np.ndarray | None = np.array([-1 if v is None else v for v in values], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        fast = None
    if fast is not None and set(map(type, values)) <= _INT_TYPES:
        return _Ids(fast, None)
    ints = [-1 if (x := as_int(v)) is None else x for v in values]
    too_big = next((x for x in ints if not _INT64_MIN <= x <= _INT64_MAX), None)
    if too_big is not None:
        return _Ids(None, np.zeros(0, np.int64), too_big)
    return _Ids(fast, np.array(ints, dtype=np.int64))


def _check_ids(parts: list[_Ids], path: Path, field: str) -> None:
    """InputError for an id no 64-bit integer holds (Kineto's ids are 64-bit)."""
    bad = next((p.out_of_range for p in parts if p.out_of_range is not None), None)
    if bad is not None:
        raise InputError(
            f"{path}: an event has an '{field}' of {bad}, beyond any 64-bit integer, so the "
            "trace is damaged; re-export it or fix that event."
        )


def _join_ids(parts: list[_Ids]) -> np.ndarray:
    """The trace-wide id column from the batches' columns (see `_id_values`)."""
    use_fast = all(p.fast is not None for p in parts)
    cols = [p.fast if use_fast or p.careful is None else p.careful for p in parts]
    return _concat([c for c in cols if c is not None], np.int64)


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    """The parts joined (an empty column of `dtype` when there are none)."""
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


_RAW_FIELDS = ("input_dims", "input_type")


def _args_dict(a: _Args) -> dict[str, Any]:
    """The kept args of one event, under Kineto's key names (raw shape lists decoded)."""
    out: dict[str, Any] = {}
    for attr, value in msgspec.structs.asdict(a).items():
        if value is None or attr == "name":
            continue
        if isinstance(value, msgspec.Raw):
            if not value:
                continue
            try:
                value = _RAW_DECODER.decode(value)
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
                continue  # a damaged shape list: as if not recorded
        out[ARGS_KEYS[attr]] = value
    return out


class KeptArgs(Mapping[int, dict[str, Any]]):
    """`RankTrace.args`: event index -> args dict, built on first access (most are never read).

    `value(i, key)` reads one Kineto key without building the dict.
    """

    def __init__(self, structs: dict[int, _Args]) -> None:
        """`structs`: event index -> its args, raw slices already detached (`_detach_raw`)."""
        self._structs = structs
        self._dicts: dict[int, dict[str, Any]] = {}

    def __getitem__(self, i: int) -> dict[str, Any]:
        d = self._dicts.get(i)
        if d is None:
            d = self._dicts[i] = _args_dict(self._structs[i])
        return d

    def __iter__(self) -> Iterator[int]:
        return iter(self._structs)

    def __len__(self) -> int:
        return len(self._structs)

    def __contains__(self, i: object) -> bool:
        return i in self._structs

    def value(self, i: int, key: str) -> Any:
        """One args value of event i by its Kineto key ("Collective name"), or None."""
        a = self._structs.get(i)
        if a is None:
            return None
        attr = _ATTR_BY_KEY.get(key)
        return None if attr is None else getattr(a, attr)

    def reindexed(self, new_pos: np.ndarray) -> KeptArgs:
        """The same args under new event indices (after sorting)."""
        out = KeptArgs.__new__(KeptArgs)
        out._structs = {int(new_pos[i]): a for i, a in self._structs.items()}
        out._dicts = {}
        return out


def _detach_raw(a: _Args) -> _Args:
    """`a` with its raw slices copied out of the batch's buffer (so that buffer can be freed)."""
    for attr in _RAW_FIELDS:
        raw = getattr(a, attr)
        if raw:
            setattr(a, attr, raw.copy())
    return a


def _args_values(events: list[_Event], attr: str) -> list[Any]:
    """`e.args.<attr>` for every event (None where an event has no args)."""
    try:
        return list(map(attrgetter(f"args.{attr}"), events))
    except AttributeError:  # some event without args: the slower, careful path
        return [getattr(e.args, attr) if e.args is not None else None for e in events]


def _is_float_text(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def _lane_name(
    pid: Any, tid: Any, is_device: bool, thread_names: dict[tuple[Any, Any], str]
) -> str:
    named = thread_names.get((pid, tid))
    if named:
        return named.strip()
    if is_device:
        return f"GPU {pid} stream {tid}"
    return f"thread {tid}"


_TRACE_CATS = ("Trace", "trace")  # the profiler's own span ("PyTorch Profiler (0)")
_KIND_CACHE: dict[tuple[str, str], int] = {}
_KIND_CACHE_MAX = 200_000  # pairs remembered (a long-lived process loads many traces)


def _kind_code(cat: str, name: str) -> int:
    """`classify(cat, name)` as an int, memoized (a trace has few distinct pairs)."""
    code = _KIND_CACHE.get((cat, name))
    if code is None:
        if len(_KIND_CACHE) >= _KIND_CACHE_MAX:
            _KIND_CACHE.clear()
        code = _KIND_CACHE[(cat, name)] = int(classify(cat, name))
    return code


@dataclass
class _Batch:
    """One batch of events reduced to columns: the complete events in file order, their
    (name, cat, pid, tid) keys interned in first-seen order, the kept args by position."""

    n: int
    ts: np.ndarray
    ts_problem: _Problem | None
    dur: np.ndarray
    dur_problem: _Problem | None
    keys: list[tuple[Any, Any, Any, Any]]
    key_id: np.ndarray
    external_id: _Ids
    correlation: _Ids
    kept: dict[int, _Args]
    thread_names: list[tuple[tuple[Any, Any], str]]
    missing_time: int = 0  # complete events without a ts or dur (skipped)
    memory: list[tuple[Any, ...]] = field(default_factory=list)


def memory_rows(events: list[_Event], phs: list[str]) -> list[tuple[Any, ...]]:
    """(ts, pid, tid, Bytes, Total Allocated, Total Reserved, Device Type, Device Id, Addr) of
    the `[memory]` instant events (profile_memory=True), in file order."""
    return [
        (
            e.ts,
            e.pid,
            e.tid,
            a.mem_bytes,
            a.total_allocated,
            a.total_reserved,
            a.device_type,
            a.device_id,
            a.addr,
        )
        for e, ph in zip(events, phs, strict=True)
        if ph == "i" and e.name == "[memory]" and (a := e.args) is not None
    ]


def _thread_name_events(events: list[_Event]) -> list[tuple[tuple[Any, Any], str]]:
    """((pid, tid), name) of the thread_name metadata events, in file order."""
    return [
        ((e.pid, e.tid), e.args.name)
        for e in events
        if e.ph == "M"
        and e.name == "thread_name"
        and e.args is not None
        and isinstance(e.args.name, str)
    ]


def _columns_of_batch(events: list[_Event]) -> _Batch:
    """Reduce one batch of decoded events to columns (runs in a decode worker or in-process).

    The per-event loops run in C where they can (map + attrgetter + dict lookups): on multi-GB
    traces the Python-level work per event is what costs.
    """
    phs = list(map(attrgetter("ph"), events))
    thread_names = _thread_name_events(events) if "M" in phs else []
    memory = memory_rows(events, phs) if "i" in phs else []
    # Complete events only, minus the profiler's own span.
    spans = [e for e, ph in zip(events, phs, strict=True) if ph == "X"]
    del phs
    complete = [e for e in spans if e.dur is not None and e.ts is not None]
    missing_time = sum(1 for e in spans if e.cat not in _TRACE_CATS) - sum(
        1 for e in complete if e.cat not in _TRACE_CATS
    )
    complete = [e for e in complete if e.cat not in _TRACE_CATS]
    del spans
    n = len(complete)
    ts, ts_problem = _number_values(list(map(attrgetter("ts"), complete)))
    dur, dur_problem = _number_values(list(map(attrgetter("dur"), complete)))
    keys = list(map(attrgetter("name", "cat", "pid", "tid"), complete))
    distinct = list(dict.fromkeys(keys))
    key_index = {k: j for j, k in enumerate(distinct)}
    key_id = np.fromiter(map(key_index.__getitem__, keys), np.int32, n)
    del keys
    k_kind = np.fromiter((_kind_code(ct, nm) for nm, ct, _, _ in distinct), np.uint8, len(distinct))
    keep = np.isin(k_kind[key_id], _KEEP_ARGS_CODES) if n else np.zeros(0, bool)
    kept: dict[int, _Args] = {}
    for i in np.flatnonzero(keep).tolist():
        a = complete[i].args
        if a is not None:
            kept[i] = _detach_raw(a)
    return _Batch(
        n=n,
        ts=ts,
        ts_problem=ts_problem,
        dur=dur,
        dur_problem=dur_problem,
        keys=distinct,
        key_id=key_id,
        external_id=_id_values(_args_values(complete, "external_id")),
        correlation=_id_values(_args_values(complete, "correlation")),
        kept=kept,
        thread_names=thread_names,
        missing_time=missing_time,
        memory=memory,
    )


@dataclass
class _Columns:
    """All batches joined in file order (before sorting by time)."""

    ts: np.ndarray
    dur: np.ndarray
    key_id: np.ndarray  # into `keys`
    keys: list[tuple[Any, Any, Any, Any]]  # distinct (name, cat, pid, tid), first-seen order
    external_id: np.ndarray
    correlation: np.ndarray
    kept: dict[int, _Args]
    thread_names: dict[tuple[Any, Any], str]
    warnings: list[str] = field(default_factory=list)
    memory: list[tuple[Any, ...]] = field(default_factory=list)


def _join_batches(batches: Iterable[_Batch], path: Path) -> _Columns:
    """Join batch columns in order: keys re-interned trace-wide, kept args re-indexed.

    Raises the InputError of the first bad 'ts' (then 'dur') value once every batch decoded,
    as the whole-document decode did (a decode error anywhere wins over a bad value).
    """
    key_index: dict[tuple[Any, Any, Any, Any], int] = {}
    parts: dict[str, list[Any]] = {
        k: [] for k in ("ts", "dur", "key_id", "ext", "corr", "ts_p", "dur_p")
    }
    kept: dict[int, _Args] = {}
    thread_names: dict[tuple[Any, Any], str] = {}
    memory: list[tuple[Any, ...]] = []
    offset = 0
    missing_time = 0
    for b in batches:
        missing_time += b.missing_time
        remap = np.fromiter(
            (key_index.setdefault(k, len(key_index)) for k in b.keys), np.int32, len(b.keys)
        )
        parts["key_id"].append(remap[b.key_id] if b.n else b.key_id)
        parts["ts"].append(b.ts)
        parts["dur"].append(b.dur)
        parts["ts_p"].append(b.ts_problem)
        parts["dur_p"].append(b.dur_problem)
        parts["ext"].append(b.external_id)
        parts["corr"].append(b.correlation)
        kept.update((offset + i, a) for i, a in b.kept.items())
        thread_names.update(b.thread_names)
        memory += b.memory
        offset += b.n
    _check_number_column(parts["ts_p"], path, "ts")
    _check_number_column(parts["dur_p"], path, "dur")
    _check_ids(parts["ext"], path, "External id")
    _check_ids(parts["corr"], path, "correlation")
    warnings = []
    if missing_time:
        warnings.append(
            f"{missing_time} complete events without a 'ts' or 'dur' (null or missing) were "
            "left out"
        )
    return _Columns(
        ts=_concat(parts.pop("ts"), np.float64),
        dur=_concat(parts.pop("dur"), np.float64),
        key_id=_concat(parts.pop("key_id"), np.int32),
        keys=list(key_index),
        external_id=_join_ids(parts.pop("ext")),
        correlation=_join_ids(parts.pop("corr")),
        kept=kept,
        thread_names=thread_names,
        warnings=warnings,
        memory=memory,
    )


MAX_ABS_TS_US = float(2**53)
"""Beyond this `ts` (µs; year 2255 on the Unix clock) a double no longer holds microseconds."""
OUTLIER_SPAN_FACTOR = 10.0
"""An event is far outside the trace when it lies more than this many times the span of the
central 98% of start times (and at least `OUTLIER_MIN_MARGIN_US`) beyond that span."""
OUTLIER_MIN_MARGIN_US = 3600e6


def _drop_time_outliers(cols: _Columns) -> _Columns:
    """`cols` without the events whose start or end lies far outside the trace's time span.

    One corrupt `ts` (1e300) would otherwise stretch every window the analysis computes until
    the real events' durations round to zero; they are left out with a warning instead.
    """
    ts, dur = cols.ts, cols.dur
    n = len(ts)
    if not n:
        return cols
    end = ts + np.maximum(dur, 0.0)
    keep = (np.abs(ts) <= MAX_ABS_TS_US) & (np.abs(end) <= MAX_ABS_TS_US)
    if keep.any():
        lo, hi = np.quantile(ts[keep], [0.01, 0.99], method="inverted_cdf")
        margin = max(OUTLIER_SPAN_FACTOR * float(hi - lo), OUTLIER_MIN_MARGIN_US)
        keep &= (ts >= lo - margin) & (end <= hi + margin)
    if keep.all():
        return cols
    dropped = int(n - keep.sum())
    first_bad = float(ts[np.flatnonzero(~keep)[0]])
    new_pos = np.cumsum(keep) - 1
    return _Columns(
        ts=ts[keep],
        dur=dur[keep],
        key_id=cols.key_id[keep],
        keys=cols.keys,
        external_id=cols.external_id[keep],
        correlation=cols.correlation[keep],
        kept={int(new_pos[i]): a for i, a in cols.kept.items() if keep[i]},
        thread_names=cols.thread_names,
        warnings=[
            *cols.warnings,
            f"{dropped} events lie far outside the trace's time span (the first has ts "
            f"{first_bad:g} us) and were left out as damaged",
        ],
        memory=cols.memory,
    )


def build_rank_trace(cols: _Columns, header: TraceHeader, path: Path) -> RankTrace:
    """The RankTrace of joined columns; rank from distributedInfo (or 0, rank_source "default").

    The caller (`load_rank_trace`) fixes the rank from the manifest / file name when
    distributedInfo has none.
    """
    cols = _drop_time_outliers(cols)
    warnings = cols.warnings
    n = len(cols.ts)
    ts, dur = cols.ts, cols.dur
    if n and (dur < 0).any():
        count = int((dur < 0).sum())
        warnings.append(f"{count} events with a negative duration were treated as zero-length")
        dur = np.maximum(dur, 0.0)

    # Names, lanes and kinds from the distinct (name, cat, pid, tid) keys.
    distinct = cols.keys
    key_id = cols.key_id
    name_ids: dict[str, int] = {}
    cat_ids: dict[str, int] = {}
    lane_ids: dict[tuple[Any, Any], int] = {}
    k_name = np.empty(len(distinct), np.int32)
    k_lane = np.empty(len(distinct), np.int32)
    k_kind = np.empty(len(distinct), np.uint8)
    k_device = np.empty(len(distinct), bool)
    for j, (nm, ct, pid, tid) in enumerate(distinct):
        k_name[j] = name_ids.setdefault(nm, len(name_ids))
        cat_ids.setdefault(ct, len(cat_ids))
        k_lane[j] = lane_ids.setdefault((pid, tid), len(lane_ids))
        k_kind[j] = _kind_code(ct, nm)
        k_device[j] = is_device_category(ct)
    names = list(name_ids)
    lane_keys = list(lane_ids)
    name_id = k_name[key_id] if n else np.zeros(0, np.int32)
    lane_key = k_lane[key_id] if n else np.zeros(0, np.int32)
    kind = k_kind[key_id] if n else np.zeros(0, np.uint8)

    # Lanes: device if any event on it has a device category.
    lane_is_device = np.zeros(len(lane_keys), dtype=bool)
    if len(distinct):
        np.logical_or.at(lane_is_device, k_lane, k_device)
    lanes = [
        Lane(
            pid,
            tid,
            _lane_name(pid, tid, bool(lane_is_device[j]), cols.thread_names),
            bool(lane_is_device[j]),
        )
        for j, (pid, tid) in enumerate(lane_keys)
    ]

    # args: External id / correlation for every event; the known args only where kept.
    external_id, correlation = cols.external_id, cols.correlation
    kept_args = KeptArgs(cols.kept)

    # Sort everything by start time (stable: ties keep file order).
    order = np.argsort(ts, kind="stable")
    if n and not (order == np.arange(n)).all():
        ts, dur, name_id, lane_key, kind = (
            ts[order],
            dur[order],
            name_id[order],
            lane_key[order],
            kind[order],
        )
        correlation, external_id = correlation[order], external_id[order]
        new_pos = np.empty(n, dtype=np.int64)
        new_pos[order] = np.arange(n)
        kept_args = kept_args.reindexed(new_pos)

    info = header.distributedInfo if isinstance(header.distributedInfo, dict) else None
    rank = _distributed_rank(info, path)
    props = [p for p in (header.deviceProperties or []) if isinstance(p, dict)]
    trace = RankTrace(
        rank=rank if rank is not None else 0,
        rank_source="distributedInfo" if rank is not None else "default",
        source=path,
        device="cpu",
        names=names,
        name_id=name_id,
        ts_us=ts,
        dur_us=dur,
        lane_id=lane_key,
        lanes=lanes,
        kind=kind,
        correlation=correlation,
        external_id=external_id,
        args=kept_args,
        distributed_info=info,
        device_properties=props,
        host=header.host_name,
        base_time_ns=as_int(header.baseTimeNanoseconds),
        trace_start_us=float(ts[0]) if n else 0.0,
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
    batches: Iterable[_Batch], ends: list[int], total: int, on_fraction: Callable[[float], None]
) -> Iterator[_Batch]:
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
                buf, scan, _EVENTS_DECODER, _columns_of_batch, path, workers=n_workers
            )
            if on_fraction is not None:
                batches = _reporting(batches, [s.end for s in scan.spans], len(buf), on_fraction)
            cols = _join_batches(batches, path)
        finally:
            if gc_was_enabled:
                gc.enable()
    return build_rank_trace(cols, scan.header, path)
