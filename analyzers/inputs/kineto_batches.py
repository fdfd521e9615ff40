"""Kineto JSON decoding, one batch at a time: the decode schema and a batch reduced to columns.

msgspec decodes each batch of the `traceEvents` array straight into the small typed Structs
below, which name only the fields analysis needs (`ph`, `cat`, `name`, `pid`, `tid`, `ts`, `dur`
and a handful of `args` keys); every other key is skipped by the decoder without building Python
objects. `columns_of_batch` reduces one decoded batch to numpy columns and small interning
tables (it runs in a decode worker or in-process); `kineto_columns.join_batches` joins them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np

from .events import EventKind, as_int, classify

# --- the decode schema: only what analysis reads --------------------------------------------

_RAW_EMPTY = msgspec.Raw(b"")


class EventArgs(msgspec.Struct, gc=False):
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
    f.name: f.encode_name for f in msgspec.structs.fields(EventArgs) if f.name != "name"
}
"""Struct field -> Kineto args key, for the keys kept in RankTrace.args."""
_ATTR_BY_KEY = {key: attr for attr, key in ARGS_KEYS.items()}


class TraceEvent(msgspec.Struct, gc=False):
    """One trace event, restricted to the keys analysis reads."""

    ph: str = ""
    name: str = ""
    cat: str = ""
    pid: int | float | str = 0
    tid: int | float | str = 0
    ts: float | str | None = None
    dur: float | str | None = None
    args: EventArgs | None = None


_RAW_DECODER = msgspec.json.Decoder()
EVENTS_DECODER = msgspec.json.Decoder(list[TraceEvent])

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


# --- one batch to columns ------------------------------------------------------------------


Problem = tuple[str, Any]
"""A column's first bad value: ("value", the value) for non-numeric, ("nan", None) for NaN/inf."""


def _number_values(values: list[Any]) -> tuple[np.ndarray, Problem | None]:
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


_INT_TYPES = frozenset({int, type(None)})


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class Ids:
    """An id column of one batch: numpy's conversion (None when it failed) and the careful
    `as_int` conversion (None when both agree because every value is an int or None), and the
    first id that no 64-bit integer holds (None when all fit)."""

    fast: np.ndarray | None
    careful: np.ndarray | None
    out_of_range: Any = None


def _id_values(values: list[Any]) -> Ids:
    """int64 ids (External id, correlation) of one batch; -1 where absent or not an integer.

    The trace-wide column is numpy's conversion unless it fails on some batch, then `as_int`'s
    everywhere (`join_ids`), as when the whole column was converted at once.
    """
    try:
        fast: np.ndarray | None = np.array([-1 if v is None else v for v in values], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        fast = None
    if fast is not None and set(map(type, values)) <= _INT_TYPES:
        return Ids(fast, None)
    ints = [-1 if (x := as_int(v)) is None else x for v in values]
    too_big = next((x for x in ints if not _INT64_MIN <= x <= _INT64_MAX), None)
    if too_big is not None:
        return Ids(None, np.zeros(0, np.int64), too_big)
    return Ids(fast, np.array(ints, dtype=np.int64))


_RAW_FIELDS = ("input_dims", "input_type")


def _args_dict(a: EventArgs) -> dict[str, Any]:
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

    def __init__(self, structs: dict[int, EventArgs]) -> None:
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


def _detach_raw(a: EventArgs) -> EventArgs:
    """`a` with its raw slices copied out of the batch's buffer (so that buffer can be freed)."""
    for attr in _RAW_FIELDS:
        raw = getattr(a, attr)
        if raw:
            setattr(a, attr, raw.copy())
    return a


def _args_values(events: list[TraceEvent], attr: str) -> list[Any]:
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


_TRACE_CATS = ("Trace", "trace")  # the profiler's own span ("PyTorch Profiler (0)")
_KIND_CACHE: dict[tuple[str, str], int] = {}
_KIND_CACHE_MAX = 200_000  # pairs remembered (a long-lived process loads many traces)


def kind_code(cat: str, name: str) -> int:
    """`classify(cat, name)` as an int, memoized (a trace has few distinct pairs)."""
    code = _KIND_CACHE.get((cat, name))
    if code is None:
        if len(_KIND_CACHE) >= _KIND_CACHE_MAX:
            _KIND_CACHE.clear()
        code = _KIND_CACHE[(cat, name)] = int(classify(cat, name))
    return code


@dataclass
class Batch:
    """One batch of events reduced to columns: the complete events in file order, their
    (name, cat, pid, tid) keys interned in first-seen order, the kept args by position."""

    n: int
    ts: np.ndarray
    ts_problem: Problem | None
    dur: np.ndarray
    dur_problem: Problem | None
    keys: list[tuple[Any, Any, Any, Any]]
    key_id: np.ndarray
    external_id: Ids
    correlation: Ids
    kept: dict[int, EventArgs]
    thread_names: list[tuple[tuple[Any, Any], str]]
    missing_time: int = 0  # complete events without a ts or dur (skipped)
    memory: list[tuple[Any, ...]] = field(default_factory=list)


def memory_rows(events: list[TraceEvent], phs: list[str]) -> list[tuple[Any, ...]]:
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


def _thread_name_events(events: list[TraceEvent]) -> list[tuple[tuple[Any, Any], str]]:
    """((pid, tid), name) of the thread_name metadata events, in file order."""
    return [
        ((e.pid, e.tid), e.args.name)
        for e in events
        if e.ph == "M"
        and e.name == "thread_name"
        and e.args is not None
        and isinstance(e.args.name, str)
    ]


def columns_of_batch(events: list[TraceEvent]) -> Batch:
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
    k_kind = np.fromiter((kind_code(ct, nm) for nm, ct, _, _ in distinct), np.uint8, len(distinct))
    keep = np.isin(k_kind[key_id], _KEEP_ARGS_CODES) if n else np.zeros(0, bool)
    kept: dict[int, EventArgs] = {}
    for i in np.flatnonzero(keep).tolist():
        a = complete[i].args
        if a is not None:
            kept[i] = _detach_raw(a)
    return Batch(
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
