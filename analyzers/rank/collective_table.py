"""The communication events of a rank as a table (`collectives_of(trace)`), built by the map.

The reader (`inputs/loader.py`) returns events only; this table is derived from them on first
use and kept on the trace (`RankTrace.collectives`) so every part of the map reads the same one.
Which events count (comm kernels on GPU runs; backend ops such as `gloo:*` on host-only runs),
and their collective kind, element counts, bytes, dtype, group size and process group, from
whatever the trace records (see `build_collectives`). gloo's calls name no process group; on a
rank of several groups of different members they take the group of the thread they ran on, from
what the collectors recorded (`thread_groups`, see `collectors/group_threads.py`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from zdiag.errors import InputError

from ..inputs.events import (
    COLLECTIVE_KINDS,
    Collectives,
    EnclosingIndex,
    EventKind,
    RankTrace,
    as_int,
    collective_kind,
    dtype_size,
)
from .declared_groups import trace_groups

_BACKEND_OP_RE = re.compile(r"^(nccl|gloo|rccl|ucc|mpi):")
_INT64_MAX = 2**63 - 1


def _count(trace: RankTrace, src: Mapping[str, Any], key: str) -> int | None:
    """An element count or group size from collective args (None when absent or not an integer);
    InputError when it is beyond any 64-bit integer (damaged: no tensor or group is that big)."""
    value = as_int(src.get(key))
    if value is not None and not -_INT64_MAX <= value <= _INT64_MAX:
        raise _too_big(trace, key, value)
    return value


def _too_big(trace: RankTrace, key: str, value: int) -> InputError:
    return InputError(
        f"{trace.source}: an event's '{key}' is {value}, beyond any 64-bit integer, so the "
        "trace is damaged; re-export it or fix that event."
    )


def _has_collective_name(trace: RankTrace) -> Callable[[int], bool]:
    """A fast test for "event i's args hold a 'Collective name'" (without building dicts when
    the args mapping offers `value(i, key)`, as the loader's does)."""
    args = trace.args
    value = getattr(args, "value", None)
    if callable(value):
        return lambda i: value(i, "Collective name") is not None
    return lambda i: "Collective name" in args.get(i, {})


def collectives_of(trace: RankTrace) -> Collectives:
    """The rank's collectives table (`build_collectives`), built on first use and kept on the
    trace."""
    if trace.collectives is None:
        trace.collectives = build_collectives(trace)
    return trace.collectives


def build_collectives(
    trace: RankTrace, thread_groups: Mapping[int, str] | None = None
) -> Collectives:
    """The comm events of a rank with their kind, sizes, dtype, group size and process group.

    Device runs: one row per comm kernel. Sizes and kind come from the kernel's own args
    ("Collective name", "In msg nelems", ...), else from the `record_param_comms` op with the
    same External id, else from the comm ops enclosing the host call that launched the kernel
    (correlation id; this is how `ncclDevKernel_Generic` gets its kind from `nccl:all_gather`),
    else from the kernel name. Host-only runs (no GPU events): one row per backend op
    (`gloo:*`, `nccl:*`, ...), or per outermost `c10d::*` op when there are none; sizes from the
    enclosing `record_param_comms`. A call naming no group gets the one `thread_groups`
    ({OS thread id: group name}) gives its thread (`attribute_by_thread`).
    """
    comm_ops = trace.of_kind(EventKind.COMM_OP)
    if trace.has_device_events:
        kernels = trace.of_kind(EventKind.COMM_KERNEL)
        on_host = host_executed_collectives(trace)
        rows = np.concatenate([kernels, on_host])
        calls = np.concatenate([trace.launch_calls(kernels), on_host])
        order = np.argsort(trace.ts_us[rows], kind="stable")
        rows, calls = rows[order], calls[order]
    else:
        backend = np.array(
            [bool(_BACKEND_OP_RE.match(trace.name(int(i)))) for i in comm_ops], dtype=bool
        )
        rows = comm_ops[backend] if backend.any() else host_comm_events(trace)
        calls = rows
    around_index = EnclosingIndex(trace, comm_ops)
    by_ext: dict[int, Mapping[str, Any]] = {}
    has_name = _has_collective_name(trace)
    for i in comm_ops.tolist():
        ext = int(trace.external_id[i])
        if ext >= 0 and has_name(i):
            by_ext.setdefault(ext, trace.args[i])
    kinds = list(COLLECTIVE_KINDS)
    m = len(rows)
    kind = np.zeros(m, dtype=np.int16)
    in_n = np.full(m, -1, dtype=np.int64)
    out_n = np.full(m, -1, dtype=np.int64)
    nbytes = np.full(m, -1, dtype=np.int64)
    gsize = np.full(m, -1, dtype=np.int64)
    dtypes: list[str] = []
    pgs: list[str] = []
    for j, i in enumerate(rows.tolist()):
        a = trace.args.get(i, {})
        src = a if "Collective name" in a else by_ext.get(int(trace.external_id[i]), {})
        src, labels = _around_call(trace, int(calls[j]), around_index, src, has_name)
        kind[j] = kinds.index(_kind(src, labels, trace.name(i)))
        ni = _count(trace, src, "In msg nelems")
        no = _count(trace, src, "Out msg nelems")
        dt = str(src.get("dtype") or "")
        if ni is None and no is None and not src:
            # gloo/c10d ops recorded with record_shapes: the op's largest input tensor
            ni, dt = _largest_input(a)
            if ni is not None and ni > _INT64_MAX:
                raise _too_big(trace, "Input Dims", ni)
        in_n[j] = -1 if ni is None else ni
        out_n[j] = -1 if no is None else no
        dtypes.append(dt)
        size = dtype_size(dt) if dt else None
        if size is not None and (ni is not None or no is not None):
            nbytes[j] = min(max(ni or 0, no or 0) * size, _INT64_MAX)
        gs = _count(trace, src, "Group size")
        gsize[j] = -1 if gs is None else gs
        pgs.append(str(src.get("Process Group Name") or ""))
    if thread_groups:
        attribute_by_thread(trace, rows, pgs, thread_groups)
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


def attribute_by_thread(
    trace: RankTrace, rows: np.ndarray, pgs: list[str], thread_groups: Mapping[int, str]
) -> None:
    """Name the group of each call of `rows` that names none (`pgs[j] == ""`, gloo) by the
    thread it ran on, where `thread_groups` names a group the trace declares. Only on a rank that
    declares groups of different members: elsewhere "" already means the rank's one group
    (`declared_groups.group_members`), and the tables stay as they were."""
    infos = trace_groups(trace)
    if len({tuple(g.ranks) for g in infos if g.ranks is not None}) < 2:
        return
    declared = {g.name for g in infos}
    for j, i in enumerate(rows.tolist()):
        if pgs[j]:
            continue
        lane = trace.lanes[int(trace.lane_id[i])]
        tid = None if lane.is_device else as_int(lane.tid)
        name = thread_groups.get(tid) if tid is not None else None
        if name in declared:
            pgs[j] = name


def _around_call(
    trace: RankTrace,
    call: int,
    around_index: EnclosingIndex,
    src: Mapping[str, Any],
    has_name: Callable[[int], bool],
) -> tuple[Mapping[str, Any], list[str]]:
    """The args that describe a collective (`src`, else those of the innermost comm op around
    the host call that launched it holding a 'Collective name') and the names of those comm ops,
    innermost first (`record_param_comms` left out)."""
    labels: list[str] = []
    if call >= 0:
        around = around_index.at(int(trace.lane_id[call]), float(trace.ts_us[call]))
        for op in reversed(around):  # innermost first
            if not src and has_name(op):
                src = trace.args[op]
            if trace.name(op) != "record_param_comms":
                labels.append(trace.name(op))
    return src, labels


def _kind(src: Mapping[str, Any], labels: list[str], name: str) -> str:
    """The collective kind: from the 'Collective name', else the enclosing ops, else the
    event's own name ("unknown" when none tells)."""
    for text in [str(src.get("Collective name") or ""), *labels, name]:
        if text:
            k = collective_kind(text)
            if k != "unknown":
                return k
    return "unknown"


_NOT_DTYPES = frozenset({"", "TensorList", "Scalar", "ScalarList", "GenericList", "int", "bool"})


def input_tensors(args: Mapping[str, Any]) -> list[tuple[int, str]]:
    """(element count, dtype) of each tensor argument in an op's `Input Dims` / `Input type`
    (recorded with `record_shapes` only; [] without).

    A TensorList is one entry of its summed size (dtype ""). A 0-dim tensor (dims `[]`) is one
    element: inside a TensorList always, at top level only when `Input type` names a dtype
    there (non-tensor arguments record `[]` too). Empty tensors are left out.
    """
    dims = args.get("Input Dims") or []
    types = args.get("Input type") or []
    out: list[tuple[int, str]] = []
    for k, d in enumerate(dims if isinstance(dims, list) else []):
        if not isinstance(d, list):
            continue
        t = str(types[k]) if isinstance(types, list) and k < len(types) else ""
        n = -1
        if not d:
            n = 1 if t not in _NOT_DTYPES else -1
        elif all(isinstance(x, int | float) for x in d):
            n = math.prod(int(x) for x in d)
        elif all(isinstance(x, list) for x in d):
            parts = [x for x in d if all(isinstance(y, int | float) for y in x)]
            n = sum(math.prod(int(y) for y in x) for x in parts) if parts else -1
        if n > 0:
            out.append((n, "" if t in _NOT_DTYPES else t))
    return out


def input_dtype(args: Mapping[str, Any]) -> str:
    """The first tensor dtype in an op's `Input type` ("" when none is recorded)."""
    types = args.get("Input type") or []
    return next((str(t) for t in types if str(t) not in _NOT_DTYPES), "")


def _largest_input(args: Mapping[str, Any]) -> tuple[int | None, str]:
    """(element count, dtype) of the largest tensor in an op's "Input Dims" / "Input type"."""
    tensors = input_tensors(args)
    if not tensors:
        return None, ""
    n, dt = max(tensors, key=lambda x: x[0])
    return n, dt or input_dtype(args)


def host_executed_collectives(trace: RankTrace) -> np.ndarray:
    """On a device run, the collectives the host itself carries out: gloo's (`gloo:*`, outermost
    per thread). Gloo moves even CUDA tensors through host memory, blocking the calling thread,
    so these calls launch no kernel and are the only trace of that communication. NCCL's host
    ops only enqueue work: their kernels are the communication."""
    outer = host_comm_events(trace)
    gloo = np.array([trace.name(int(i)).startswith("gloo:") for i in outer], dtype=bool)
    return outer[gloo] if len(outer) else outer


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
