"""Reading Kineto traces (JSON or JSON.gz) into columnar `RankTrace`s.

Decoding: msgspec decodes each file straight into small typed Structs that name only the fields
analysis needs (`ph`, `cat`, `name`, `pid`, `tid`, `ts`, `dur` and a handful of `args` keys);
every other key is skipped by the decoder without building Python objects. The full `args`
object is kept as raw bytes (`msgspec.Raw`) and decoded to a dict only for the few events that
need it (collectives, FSDP and step annotations). docs/analyze.md has the decoder measurements.

Every failure that the user can fix (missing or empty file, not JSON, truncated gzip or JSON,
JSON without `traceEvents`, non-numeric or NaN `ts`/`dur`) raises `InputError` with one sentence
naming the file, the problem and what to do.
"""

from __future__ import annotations

import gc
import gzip
import re
import zlib
from collections.abc import Iterator, Mapping
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from zdiag.analyzers.collectives import build_collectives
from zdiag.analyzers.events import (
    EventKind,
    Lane,
    RankTrace,
    as_int,
    classify,
    is_device_category,
)
from zdiag.errors import InputError

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


class _Trace(msgspec.Struct, gc=False):
    """A Kineto trace file: its events and the few top-level blocks analysis reads."""

    traceEvents: list[_Event] | None = None
    distributedInfo: dict[str, Any] | None = None
    deviceProperties: list[dict[str, Any]] | None = None
    host_name: str | None = None
    baseTimeNanoseconds: int | float | None = None


_RAW_DECODER = msgspec.json.Decoder()
_TRACE_DECODER = msgspec.json.Decoder(_Trace)

# Events whose full args are kept (decoded) in RankTrace.args.
_KEEP_ARGS_KINDS = frozenset(
    {
        EventKind.COMM_KERNEL,
        EventKind.COMM_OP,
        EventKind.FSDP_ANNOTATION,
        EventKind.PROFILER_STEP,
    }
)


# --- reading bytes --------------------------------------------------------------------------


def read_trace_bytes(path: Path) -> bytes:
    """The (decompressed) bytes of a trace file; InputError for missing, empty or bad gzip."""
    if not path.exists():
        raise InputError(f"{path}: no such file or folder; check the path.")
    if path.is_dir():
        raise InputError(f"{path}: is a folder, expected a trace file.")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(
            f"{path}: cannot be read ({exc.strerror or exc}); check its permissions."
        ) from exc
    if not raw:
        raise InputError(
            f"{path}: the file is empty; re-export the trace (the profiler may have been killed while writing)."
        )
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as exc:
            raise InputError(
                f"{path}: the gzip data is truncated or corrupt ({exc}); copy the file again or re-export the trace."
            ) from exc
        if not raw.strip():
            raise InputError(f"{path}: the compressed file holds no data; re-export the trace.")
    return raw


def _decode_document(raw: bytes, path: Path) -> _Trace:
    """Decode the trace JSON into the minimal schema; InputError naming the problem."""
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark (some editors add one)
        raw = raw[3:]
    head = raw.lstrip()[:1]
    if head not in (b"{", b"["):
        raise InputError(
            f"{path}: is not JSON (it starts with {raw.lstrip()[:12]!r}); pass a Kineto trace exported by torch.profiler (.json or .json.gz)."
        )
    gc_was_enabled = gc.isenabled()
    gc.disable()  # millions of small objects: the cyclic GC would rescan them repeatedly
    try:
        if head == b"[":
            # The bare-array form of the Chrome trace format: a list of events.
            events = msgspec.json.decode(raw, type=list[_Event])
            return _Trace(traceEvents=events)
        return _TRACE_DECODER.decode(raw)
    except msgspec.ValidationError as exc:
        raise InputError(
            f"{path}: is JSON but not a Kineto trace ({exc}); pass a trace exported by torch.profiler."
        ) from exc
    except msgspec.DecodeError as exc:
        msg = str(exc)
        if "truncated" in msg.lower():
            problem = "the JSON is truncated (the file ends early)"
            todo = "copy the file again or re-export the trace"
        elif _has_nan_token(raw):
            problem = "it holds NaN or Infinity where numbers are expected"
            todo = "re-export the trace or fix the event times"
        else:
            problem = f"it is not valid JSON ({msg})"
            todo = "check that it is a Kineto trace and was fully written"
        raise InputError(f"{path}: {problem}; {todo}.") from exc
    finally:
        if gc_was_enabled:
            gc.enable()


def _has_nan_token(raw: bytes) -> bool:
    """True when the text holds a bare NaN/Infinity token (Python's json writes them)."""
    return re.search(rb"[:\[,]\s*-?(NaN|Infinity)\b", raw) is not None


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


def _number_column(values: list[Any], path: Path, field: str) -> np.ndarray:
    """float64 column from decoded values; InputError for non-numeric or NaN entries."""
    try:
        col = np.array(values, dtype=np.float64)
    except (TypeError, ValueError):
        bad = next(
            (v for v in values if not isinstance(v, int | float) and not _is_float_text(v)), None
        )
        raise InputError(
            f"{path}: an event has a non-numeric '{field}' ({bad!r}); re-export the trace or fix that event."
        ) from None
    if col.size and not np.isfinite(col).all():
        raise InputError(
            f"{path}: an event has a NaN or infinite '{field}'; re-export the trace or fix that event."
        )
    return col


def _id_column(values: list[Any]) -> np.ndarray:
    """int64 ids (External id, correlation); -1 where absent or not an integer."""
    try:
        return np.array([-1 if v is None else v for v in values], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return np.array([-1 if (x := as_int(v)) is None else x for v in values], dtype=np.int64)


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
            except msgspec.DecodeError:
                continue
        out[ARGS_KEYS[attr]] = value
    return out


class KeptArgs(Mapping[int, dict[str, Any]]):
    """`RankTrace.args`: event index -> args dict, built on first access (most are never read).

    `value(i, key)` reads one Kineto key without building the dict.
    """

    def __init__(self, structs: dict[int, _Args]) -> None:
        for a in structs.values():  # detach raw slices from the file buffer (memory)
            for attr in _RAW_FIELDS:
                raw = getattr(a, attr)
                if raw:
                    setattr(a, attr, raw.copy())
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


def build_rank_trace(doc: _Trace, path: Path) -> RankTrace:
    """Columns from a decoded document; rank from distributedInfo (or 0, rank_source "default").

    The caller (`load_rank_trace`) fixes the rank from the manifest / file name when
    distributedInfo has none.
    """
    events = doc.traceEvents
    if events is None:
        raise InputError(
            f"{path}: is JSON but has no 'traceEvents' list; pass a Kineto trace exported by torch.profiler."
        )
    warnings: list[str] = []
    thread_names: dict[tuple[Any, Any], str] = {
        (e.pid, e.tid): e.args.name
        for e in events
        if e.ph == "M"
        and e.name == "thread_name"
        and e.args is not None
        and isinstance(e.args.name, str)
    }
    # Complete events only, minus the profiler's own span ("PyTorch Profiler (0)", cat "Trace").
    complete = [
        e
        for e in events
        if e.ph == "X"
        and e.dur is not None
        and e.ts is not None
        and e.cat not in ("Trace", "trace")
    ]
    n = len(complete)
    # The per-event loops below run in C (map + attrgetter + dict lookups): on multi-GB traces
    # the Python-level work per event is what costs.
    ts = _number_column(list(map(attrgetter("ts"), complete)), path, "ts")
    dur = _number_column(list(map(attrgetter("dur"), complete)), path, "dur")
    if n and (dur < 0).any():
        count = int((dur < 0).sum())
        warnings.append(f"{count} events with a negative duration were treated as zero-length")
        dur = np.maximum(dur, 0.0)

    # Intern (name, cat, pid, tid) once per distinct combination, then derive the columns.
    keys = list(map(attrgetter("name", "cat", "pid", "tid"), complete))
    distinct = list(dict.fromkeys(keys))
    key_index = {k: j for j, k in enumerate(distinct)}
    key_id = np.fromiter(map(key_index.__getitem__, keys), np.int32, n)
    del keys
    name_ids: dict[str, int] = {}
    cat_ids: dict[str, int] = {}
    lane_ids: dict[tuple[Any, Any], int] = {}
    kind_of_pair: dict[tuple[str, str], int] = {}
    k_name = np.empty(len(distinct), np.int32)
    k_lane = np.empty(len(distinct), np.int32)
    k_kind = np.empty(len(distinct), np.uint8)
    k_device = np.empty(len(distinct), bool)
    for j, (nm, ct, pid, tid) in enumerate(distinct):
        k_name[j] = name_ids.setdefault(nm, len(name_ids))
        cat_ids.setdefault(ct, len(cat_ids))
        k_lane[j] = lane_ids.setdefault((pid, tid), len(lane_ids))
        kd = kind_of_pair.get((ct, nm))
        if kd is None:
            kd = kind_of_pair[(ct, nm)] = int(classify(ct, nm))
        k_kind[j] = kd
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
            _lane_name(pid, tid, bool(lane_is_device[j]), thread_names),
            bool(lane_is_device[j]),
        )
        for j, (pid, tid) in enumerate(lane_keys)
    ]

    # args: External id / correlation for every event; the known args only where kept.
    external_id = _id_column(_args_values(complete, "external_id"))
    correlation = _id_column(_args_values(complete, "correlation"))
    keep = np.isin(kind, np.array([int(k) for k in _KEEP_ARGS_KINDS], np.uint8))
    kept_structs: dict[int, _Args] = {}
    for i in np.flatnonzero(keep).tolist():
        a = complete[i].args
        if a is not None:
            kept_structs[i] = a
    kept_args = KeptArgs(kept_structs)

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

    info = doc.distributedInfo if isinstance(doc.distributedInfo, dict) else None
    rank = as_int(info.get("rank")) if info else None
    props = [p for p in (doc.deviceProperties or []) if isinstance(p, dict)]
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
        host=doc.host_name,
        base_time_ns=as_int(doc.baseTimeNanoseconds),
        trace_start_us=float(ts[0]) if n else 0.0,
        warnings=warnings,
    )
    trace.device = _device_kind(trace)
    trace.collectives = build_collectives(trace)
    return trace


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


def load_rank_trace(path: Path) -> RankTrace:
    """Read, decode and columnize one trace file (rank from distributedInfo or "default")."""
    raw = read_trace_bytes(path)
    doc = _decode_document(raw, path)
    del raw
    return build_rank_trace(doc, path)
