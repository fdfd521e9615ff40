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
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from zdiag.analyzers.events import (
    COLLECTIVE_KINDS,
    Collectives,
    EventKind,
    Lane,
    RankTrace,
    classify,
    collective_kind,
    dtype_size,
    is_device_category,
)
from zdiag.errors import InputError

# --- the decode schema: only what analysis reads --------------------------------------------

Number = int | float | str  # some exporters write numbers as strings; converted and checked


class _Args(msgspec.Struct, gc=False):
    """The args keys read for every event; the full args stay raw (see _Event.args)."""

    external_id: int | float | str | None = msgspec.field(default=None, name="External id")
    correlation: int | float | str | None = None
    stream: int | float | str | None = None


class _Event(msgspec.Struct, gc=False):
    """One trace event, restricted to the keys analysis reads."""

    ph: str = ""
    name: Any = ""
    cat: Any = ""
    pid: Any = 0
    tid: Any = 0
    ts: Any = None
    dur: Any = None
    args: msgspec.Raw = msgspec.Raw(b"")


class _Trace(msgspec.Struct, gc=False):
    """A Kineto trace file: its events and the few top-level blocks analysis reads."""

    traceEvents: list[_Event] | None = None
    distributedInfo: dict[str, Any] | None = None
    deviceProperties: list[dict[str, Any]] | None = None
    host_name: str | None = None


_ARGS_DECODER = msgspec.json.Decoder(_Args)
_DICT_DECODER = msgspec.json.Decoder(dict[str, Any])
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


def _as_int(value: Any) -> int | None:
    """An int from an int, an integral float or a numeric string; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


# --- building the columns -------------------------------------------------------------------


@dataclass
class _Interner:
    """Strings -> dense int ids."""

    ids: dict[Any, int]
    values: list[Any]

    @classmethod
    def new(cls) -> _Interner:
        return cls({}, [])

    def get(self, value: Any) -> int:
        i = self.ids.get(value)
        if i is None:
            i = self.ids[value] = len(self.values)
            self.values.append(value)
        return i


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
    thread_names: dict[tuple[Any, Any], str] = {}
    complete: list[_Event] = []
    for e in events:
        if e.ph == "X":
            complete.append(e)
        elif e.ph == "M" and e.name == "thread_name" and e.args:
            try:
                tn = _DICT_DECODER.decode(e.args).get("name")
            except msgspec.DecodeError:
                tn = None
            if isinstance(tn, str):
                thread_names[(e.pid, e.tid)] = tn
    # Drop the profiler's own span ("PyTorch Profiler (0)", cat "Trace") and events without dur.
    complete = [e for e in complete if e.cat != "Trace" and e.dur is not None and e.ts is not None]
    n = len(complete)
    ts = _number_column([e.ts for e in complete], path, "ts")
    dur = _number_column([e.dur for e in complete], path, "dur")
    if n and (dur < 0).any():
        count = int((dur < 0).sum())
        warnings.append(f"{count} events with a negative duration were treated as zero-length")
        dur = np.maximum(dur, 0.0)

    names = _Interner.new()
    cats = _Interner.new()
    lanes_i = _Interner.new()
    name_id = np.fromiter((names.get(str(e.name)) for e in complete), np.int32, n)
    cat_id = np.fromiter((cats.get(str(e.cat)) for e in complete), np.int32, n)
    lane_key = np.fromiter((lanes_i.get((e.pid, e.tid)) for e in complete), np.int32, n)

    # Classify each distinct (cat, name) pair once.
    pair = cat_id.astype(np.int64) * max(len(names.values), 1) + name_id
    uniq, inverse = np.unique(pair, return_inverse=True)
    n_names = max(len(names.values), 1)
    uniq_kinds = np.array(
        [
            int(classify(cats.values[int(u) // n_names], names.values[int(u) % n_names]))
            for u in uniq
        ],
        dtype=np.uint8,
    )
    kind = uniq_kinds[inverse].astype(np.uint8) if n else np.zeros(0, np.uint8)

    # Lanes: device if any event on it has a device category.
    device_cat = np.array([is_device_category(c) for c in cats.values], dtype=bool)
    lane_is_device = np.zeros(len(lanes_i.values), dtype=bool)
    if n:
        np.logical_or.at(lane_is_device, lane_key, device_cat[cat_id])
    lanes = [
        Lane(
            pid,
            tid,
            _lane_name(pid, tid, bool(lane_is_device[j]), thread_names),
            bool(lane_is_device[j]),
        )
        for j, (pid, tid) in enumerate(lanes_i.values)
    ]

    # args: External id / correlation for every event; full args only where kept.
    correlation = np.full(n, -1, dtype=np.int64)
    external_id = np.full(n, -1, dtype=np.int64)
    keep = np.isin(kind, np.array([int(k) for k in _KEEP_ARGS_KINDS], np.uint8))
    kept_args: dict[int, dict[str, Any]] = {}
    for i, e in enumerate(complete):
        raw_args = e.args
        if not raw_args:
            continue
        if keep[i]:
            try:
                full = _DICT_DECODER.decode(raw_args)
            except msgspec.DecodeError:
                full = {}
            kept_args[i] = full
            ext = _as_int(full.get("External id"))
            corr = _as_int(full.get("correlation"))
        else:
            try:
                a = _ARGS_DECODER.decode(raw_args)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            ext = _as_int(a.external_id)
            corr = _as_int(a.correlation)
        if ext is not None:
            external_id[i] = ext
        if corr is not None:
            correlation[i] = corr

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
        kept_args = {int(new_pos[i]): a for i, a in kept_args.items()}

    info = doc.distributedInfo if isinstance(doc.distributedInfo, dict) else None
    rank = _as_int(info.get("rank")) if info else None
    props = [p for p in (doc.deviceProperties or []) if isinstance(p, dict)]
    trace = RankTrace(
        rank=rank if rank is not None else 0,
        rank_source="distributedInfo" if rank is not None else "default",
        source=path,
        device="cpu",
        names=[str(v) for v in names.values],
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


def build_collectives(trace: RankTrace) -> Collectives:
    """The comm events of a rank with their kind, sizes, dtype, group size and process group.

    Device runs: one row per comm kernel. The kind comes from the kernel's own args
    ("Collective name"), else from the CPU op that launched it (`record_param_comms` /
    `nccl:*` with the same External id: this names `ncclDevKernel_Generic`), else from the
    kernel name. Host-only runs (no GPU events): one row per `gloo:*` / `nccl:*` /
    `c10d::*` op that is not nested inside another comm op on the same thread.
    """
    if trace.has_device_events:
        rows = trace.of_kind(EventKind.COMM_KERNEL)
    else:
        rows = host_comm_events(trace)
    # CPU-side comm ops with args, by External id (record_param_comms carries the sizes).
    by_ext: dict[int, dict[str, Any]] = {}
    label_by_ext: dict[int, str] = {}
    for i in trace.of_kind(EventKind.COMM_OP):
        ext = int(trace.external_id[i])
        if ext < 0:
            continue
        a = trace.args.get(int(i), {})
        if "Collective name" in a:
            by_ext.setdefault(ext, a)
        nm = trace.name(int(i))
        if nm != "record_param_comms":
            label_by_ext.setdefault(ext, nm)
    kinds = list(COLLECTIVE_KINDS)
    m = len(rows)
    kind = np.zeros(m, dtype=np.int16)
    in_n = np.full(m, -1, dtype=np.int64)
    out_n = np.full(m, -1, dtype=np.int64)
    nbytes = np.full(m, -1, dtype=np.int64)
    gsize = np.full(m, -1, dtype=np.int64)
    dtypes: list[str] = []
    pgs: list[str] = []
    for j, i in enumerate(rows):
        i = int(i)
        a = trace.args.get(i, {})
        ext = int(trace.external_id[i])
        src = a if "Collective name" in a else by_ext.get(ext, a)
        label = str(src.get("Collective name") or "")
        k = collective_kind(label) if label else "unknown"
        if k == "unknown":
            k = collective_kind(trace.name(i))
        if k == "unknown" and ext in label_by_ext:
            k = collective_kind(label_by_ext[ext])
        kind[j] = kinds.index(k)
        ni = _as_int(src.get("In msg nelems"))
        no = _as_int(src.get("Out msg nelems"))
        in_n[j] = -1 if ni is None else ni
        out_n[j] = -1 if no is None else no
        dt = str(src.get("dtype") or "")
        dtypes.append(dt)
        size = dtype_size(dt) if dt else None
        if size is not None and (ni is not None or no is not None):
            nbytes[j] = max(ni or 0, no or 0) * size
        gs = _as_int(src.get("Group size"))
        gsize[j] = -1 if gs is None else gs
        pgs.append(str(src.get("Process Group Name") or ""))
    return Collectives(
        event=np.asarray(rows, dtype=np.int64),
        kind=kind,
        kinds=kinds,
        in_nelems=in_n,
        out_nelems=out_n,
        bytes=nbytes,
        group_size=gsize,
        dtype=dtypes,
        process_group=pgs,
    )


def host_comm_events(trace: RankTrace) -> np.ndarray:
    """Host-side comm ops that are the outermost comm op on their thread (host-only runs)."""
    idx = trace.of_kind(EventKind.COMM_OP)
    if not len(idx):
        return idx
    keep = []
    open_end: dict[int, float] = {}
    for i in idx:  # time-ordered
        lane = int(trace.lane_id[i])
        start = float(trace.ts_us[i])
        if start < open_end.get(lane, -math.inf):
            continue  # nested in an enclosing comm op on the same thread
        open_end[lane] = start + float(trace.dur_us[i])
        keep.append(int(i))
    return np.asarray(keep, dtype=np.int64)


def load_rank_trace(path: Path) -> RankTrace:
    """Read, decode and columnize one trace file (rank from distributedInfo or "default")."""
    raw = read_trace_bytes(path)
    doc = _decode_document(raw, path)
    del raw
    return build_rank_trace(doc, path)
