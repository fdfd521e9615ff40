"""The columnar per-rank event model every analyzer reads.

A Kineto trace (what `torch.profiler` exports) is a JSON object with a `traceEvents` list.
`zdiag.analyzers.inputs.loader` decodes it straight into one `RankTrace` per file: numpy columns over
the *complete* events (`"ph": "X"`, those with a `dur`), sorted by start time, plus small tables.

Columns (all of length `len(trace)`, index `i` is one event):

- `name_id[i]` -> `names[name_id[i]]` (names are interned; compare ids, not strings, in loops)
- `ts_us[i]`, `dur_us[i]`: start and duration in microseconds (float64, absolute trace clock)
- `lane_id[i]` -> `lanes[lane_id[i]]`: where the event ran. A `Lane` is a GPU stream
  (`is_device=True`) or a CPU thread (`is_device=False`).
- `kind[i]`: an `EventKind` (compute kernel, comm kernel, memcpy, cpu op, launch call, ...)
- `correlation[i]`: CUDA/HIP correlation id linking a runtime launch call to its kernel (-1: none)
- `external_id[i]`: Kineto "External id" linking a kernel to the CPU op that launched it (-1)

`args` keeps the full `args` dict only for the events that need it (collective kernels and
ops, `record_param_comms`, `nccl:*`/`gloo:*`/`c10d::*` ops, `FSDP::*` / `ProfilerStep#*`
annotations); look it up with `trace.args.get(i, {})`. It is a read-only Mapping whose dicts are
built on first access. Kept keys: External id, correlation, Collective name, In/Out msg nelems,
dtype, Group size, Process Group Name/Description/Ranks, Input Dims, Input type (ask for
more in kineto_batches.EventArgs: every key is a field there, and each costs memory on huge traces).

`collectives` (built by the map, `rank.collective_table.collectives_of`, not by the reader) is
one row per communication event that counts as device communication (comm
kernels on GPU runs; `gloo:*`/`nccl:*` ops on host-only runs) with its collective kind
(`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `broadcast`, `send_recv`, ...),
element counts, dtype, bytes, group size and process group when the trace says so.

Example (count all-gather kernels on rank 0):

    t = load_rank_trace(Path("trace.json.gz"))  # analyzers/inputs/loader.py
    c = collectives_of(t)  # analyzers/rank/collective_table.py
    n = int((c.kind == c.kinds.index("all_gather")).sum())
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import frameworks

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class EventKind(IntEnum):
    """What one complete event is; stored as uint8 in `RankTrace.kind`."""

    OTHER = 0
    CPU_OP = 1  # cat "cpu_op" (aten ops, autograd nodes, ...)
    USER_ANNOTATION = 2  # record_function ranges: "## forward ##", Optimizer.step#..., ...
    PROFILER_STEP = 3  # "ProfilerStep#N" on the CPU
    RUNTIME_LAUNCH = 4  # cudaLaunchKernel, hipLaunchKernel, cuLaunchKernelEx, ...
    RUNTIME_OTHER = 5  # other CUDA/HIP runtime/driver calls (cudaMemcpyAsync, sync, ...)
    COMPUTE_KERNEL = 6  # any GPU kernel that is not communication
    COMM_KERNEL = 7  # NCCL/RCCL kernels, custom all-reduce, DeepEP-style dispatch/combine
    MEMCPY = 8  # cat "gpu_memcpy"
    MEMSET = 9  # cat "gpu_memset"
    GPU_ANNOTATION = 10  # cat "gpu_user_annotation" (never device activity)
    COMM_OP = 11  # host side of a collective: nccl:*, gloo:*, c10d::*, record_param_comms
    FSDP_ANNOTATION = 12  # "FSDP::..." ranges (FSDP2), FSDP1 / DeepSpeed ZeRO ranges
    PYTHON_FUNCTION = 13  # cat "python_function" (with_stack traces)
    CPU_SYNC = 14  # cat "cuda_sync" and similar waits


DEVICE_KINDS = (EventKind.COMPUTE_KERNEL, EventKind.COMM_KERNEL, EventKind.MEMCPY, EventKind.MEMSET)
"""Kinds that are device activity on GPU runs (annotations on GPU lanes are not)."""


@dataclass(frozen=True)
class Lane:
    """Where events ran: a GPU stream (is_device) or a CPU thread."""

    pid: int | float | str
    tid: int | float | str
    name: str  # "stream 7", "thread 2919752 (pt_main_thread)", ...
    is_device: bool


@dataclass
class MemoryEvents:
    """Kineto's `[memory]` instant events (profile_memory=True), in file order.

    Per event: time, the lane's (pid, tid), the signed `Bytes` change, the allocator's
    `Total Allocated` / `Total Reserved` after it (-1 when absent), `Device Type` (0 CPU,
    1 CUDA; -1 unknown), `Device Id` and the block's `Addr`.
    """

    ts_us: npt.NDArray[np.float64]
    pid: list[Any]
    tid: list[Any]
    nbytes: npt.NDArray[np.int64]
    total_allocated: npt.NDArray[np.int64]
    total_reserved: npt.NDArray[np.int64]
    device_type: npt.NDArray[np.int64]
    device_id: npt.NDArray[np.int64]
    addr: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.ts_us)

    @staticmethod
    def of_rows(rows: list[tuple[Any, ...]]) -> MemoryEvents:
        """From (ts, pid, tid, bytes, total allocated, total reserved, device type, device id,
        addr) rows; values that are not numbers become -1 (time: NaN, dropped later)."""

        def col(j: int, dtype: Any, missing: float) -> Any:
            return np.fromiter(
                (
                    r[j]
                    if isinstance(r[j], int | float)
                    and not isinstance(r[j], bool)
                    and abs(r[j]) < 2**62
                    else missing
                    for r in rows
                ),
                dtype,
                len(rows),
            )

        return MemoryEvents(
            ts_us=col(0, np.float64, np.nan),
            pid=[r[1] for r in rows],
            tid=[r[2] for r in rows],
            nbytes=col(3, np.int64, 0),
            total_allocated=col(4, np.int64, -1),
            total_reserved=col(5, np.int64, -1),
            device_type=col(6, np.int64, -1),
            device_id=col(7, np.int64, -1),
            addr=col(8, np.int64, -1),
        )


@dataclass
class Collectives:
    """One row per communication event; `event[i]` indexes the RankTrace columns.

    Unknown numbers are -1, unknown strings "". `kind[i]` indexes `kinds`.
    `bytes` = max(in, out) elements x dtype size when both are known.
    """

    event: IntArray
    kind: npt.NDArray[np.int16]
    kinds: list[str]
    in_nelems: IntArray
    out_nelems: IntArray
    bytes: IntArray
    group_size: IntArray
    dtype: list[str]
    process_group: list[str]  # "Process Group Name" ("0", "1", ...) or ""

    def __len__(self) -> int:
        return len(self.event)

    def kind_name(self, i: int) -> str:
        """The collective kind of row i ("all_gather", ...)."""
        return self.kinds[int(self.kind[i])]

    @staticmethod
    def empty() -> Collectives:
        """A table with no rows."""
        z = np.zeros(0, dtype=np.int64)
        return Collectives(z, np.zeros(0, np.int16), [], z, z, z, z, [], [])


@dataclass
class RankTrace:
    """One rank's trace as columns; see the module docstring for the column meanings."""

    rank: int
    rank_source: str  # "distributedInfo", "manifest", "file name", "default"
    source: Path
    device: str  # "cuda", "rocm", "cpu"
    names: list[str]
    name_id: npt.NDArray[np.int32]
    ts_us: FloatArray
    dur_us: FloatArray
    lane_id: npt.NDArray[np.int32]
    lanes: list[Lane]
    kind: npt.NDArray[np.uint8]
    correlation: IntArray
    external_id: IntArray
    args: Mapping[int, dict[str, Any]] = field(default_factory=dict)
    # The map's table of communication events (`rank.collective_table.collectives_of` builds it
    # on first use; the reader leaves it None).
    collectives: Collectives | None = None
    distributed_info: dict[str, Any] | None = None
    device_properties: list[dict[str, Any]] = field(default_factory=list)
    host: str | None = None
    trace_start_us: float = 0.0  # earliest event start (the clock origin used in reports)
    base_time_ns: int | None = None  # Kineto's baseTimeNanoseconds: epoch ns = ts_us * 1000 + this
    warnings: list[str] = field(default_factory=list)
    memory_events: MemoryEvents | None = None  # Kineto `[memory]` events, when recorded

    def __len__(self) -> int:
        return len(self.ts_us)

    @property
    def end_us(self) -> FloatArray:
        """Event end times (ts + dur)."""
        return self.ts_us + self.dur_us

    def name(self, i: int) -> str:
        """The name of event i."""
        return self.names[int(self.name_id[i])]

    def of_kind(self, *kinds: EventKind) -> IntArray:
        """Indices of the events of the given kinds, in start-time order."""
        return np.flatnonzero(np.isin(self.kind, np.array([int(k) for k in kinds], np.uint8)))

    def matching(self, pattern: str) -> IntArray:
        """Indices of events whose name matches the regex `pattern` (re.match), in time order."""
        rx = re.compile(pattern)
        ids = np.array([i for i, n in enumerate(self.names) if rx.match(n)], dtype=np.int32)
        return np.flatnonzero(np.isin(self.name_id, ids))

    def launch_calls(self, idx: IntArray) -> IntArray:
        """For device events `idx`, the index of the host call (cudaLaunchKernel, ...) that
        launched each one (same correlation id), or -1 when the trace does not link them."""
        idx = np.asarray(idx, dtype=np.int64)
        out = np.full(len(idx), -1, dtype=np.int64)
        rt = self.of_kind(EventKind.RUNTIME_LAUNCH, EventKind.RUNTIME_OTHER)
        rt = rt[self.correlation[rt] >= 0]
        if not len(rt) or not len(idx):
            return out
        order = np.argsort(self.correlation[rt], kind="stable")
        corr_sorted = self.correlation[rt][order]
        c = self.correlation[idx]
        pos = np.clip(np.searchsorted(corr_sorted, c), 0, len(corr_sorted) - 1)
        found = (c >= 0) & (corr_sorted[pos] == c)
        return np.where(found, rt[order][pos], -1)

    @property
    def has_device_events(self) -> bool:
        """True when the trace holds GPU kernels, memcpys or memsets."""
        return bool(np.isin(self.kind, np.array([int(k) for k in DEVICE_KINDS], np.uint8)).any())

    @property
    def world_size(self) -> int | None:
        """World size from distributedInfo, if recorded."""
        info = self.distributed_info or {}
        ws = as_int(info.get("world_size"))
        return ws if ws is not None and 0 < ws <= MAX_WORLD_SIZE else None  # else: damaged


class EnclosingIndex:
    """Which of a set of (properly nested, per-thread) ranges enclose a given time on a lane.

    Built once for `candidates` (e.g. all comm ops); `at(lane, t)` costs O(log n + depth).
    """

    def __init__(self, trace: RankTrace, candidates: IntArray) -> None:
        self._by_lane: dict[int, tuple[IntArray, FloatArray, FloatArray, IntArray]] = {}
        candidates = np.asarray(candidates, dtype=np.int64)
        lanes = trace.lane_id[candidates]
        for lane in np.unique(lanes).tolist():
            idx = candidates[lanes == lane]
            idx = idx[np.argsort(trace.ts_us[idx], kind="stable")]
            start = trace.ts_us[idx]
            end = start + trace.dur_us[idx]
            parent = np.full(len(idx), -1, dtype=np.int64)
            stack: list[int] = []
            for j in range(len(idx)):
                while stack and end[stack[-1]] < start[j]:
                    stack.pop()
                parent[j] = stack[-1] if stack else -1
                stack.append(j)
            self._by_lane[int(lane)] = (idx, start, end, parent)

    def at(self, lane: int, t: float) -> list[int]:
        """Event indices whose range holds time t on `lane`, outermost first."""
        entry = self._by_lane.get(int(lane))
        if entry is None:
            return []
        idx, start, end, parent = entry
        j = int(np.searchsorted(start, t, side="right")) - 1
        found: list[int] = []
        while j >= 0:
            if end[j] >= t:
                found.append(int(idx[j]))
            j = int(parent[j])
        return found[::-1]


MAX_WORLD_SIZE = 2**31
"""A world size beyond this (a damaged header) is treated as unknown."""
MAX_INT64 = 2**63 - 1
"""Integers the analysis stores (summaries are msgpack, reports JSON) fit in 64 bits."""


def as_int64(value: Any) -> int | None:
    """`as_int`, and None unless 0 <= value <= MAX_INT64 (a damaged header's 10**30 would not
    fit a summary)."""
    n = as_int(value)
    return n if n is not None and 0 <= n <= MAX_INT64 else None


def as_int(value: Any) -> int | None:
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


# --- classification -----------------------------------------------------------------------

_LAUNCH_RE = re.compile(
    r"^(cuda|hip|cu|hipExt)(LaunchKernel|LaunchKernelExC|LaunchKernelEx|LaunchCooperativeKernel"
    r"|ModuleLaunchKernel|ExtModuleLaunchKernel|ExtLaunchKernel|GraphLaunch|LaunchKernel_ptsz)"
)
_LAUNCH_NAMES = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaLaunchCooperativeKernel",
        "cudaGraphLaunch",
        "hipLaunchKernel",
        "hipExtLaunchKernel",
        "hipModuleLaunchKernel",
        "hipExtModuleLaunchKernel",
        "hipGraphLaunch",
        "cudaMemcpyAsync",
        "cudaMemsetAsync",
        "hipMemcpyAsync",
        "hipMemsetAsync",
        "hipMemcpyWithStream",
    }
)
"""Host API calls counted as launch time (kernel launches and async copy/set enqueues)."""

# Communication kernels: NCCL/RCCL, custom / symmetric-memory all-reduce, DeepEP-style
# expert-parallel dispatch/combine, NVSHMEM, MSCCL++. Matched on the kernel name.
_COMM_KERNEL_RE = re.compile(
    r"(^nccl|^rccl|^void nccl|^void rccl|ncclDevKernel|ncclKernel|rcclKernel|msccl"
    r"|all_?reduce_kernel|all_?gather_kernel|reduce_?scatter_kernel|cross_device_reduce"
    r"|multimem_all_reduce|one_shot_all_reduce|two_shot_all_reduce|custom_all_reduce"
    r"|deep_ep|deepep|intranode::(dispatch|combine)|internode::(dispatch|combine)"
    r"|internode_ll::(dispatch|combine)|nvshmem|moe_(dispatch|combine)_kernel)",
    re.IGNORECASE,
)
# Host-side collective ops (also the comm activity of host-only / gloo runs).
_COMM_OP_RE = re.compile(
    r"^(nccl:|gloo:|rccl:|ucc:|mpi:|c10d::|c10d_functional::|_c10d_functional::|record_param_comms"
    r"|torch\.distributed\.|ProcessGroup)"
)
# Every framework's own record_function labels (analyzers/frameworks/: FSDP2, FSDP1, ZeRO).
_FSDP_RE = frameworks.annotation_re()

_DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})


_LEGACY_CATEGORIES = {
    "memcpy": "gpu_memcpy",
    "memset": "gpu_memset",
    "runtime": "cuda_runtime",
    "driver": "cuda_driver",
    "operator": "cpu_op",
    "python": "python_function",
    "gpu_user_annotation": "gpu_user_annotation",
}


def canonical_category(cat: str) -> str:
    """Kineto category in today's spelling (older exporters wrote "Kernel", "Memcpy", "Runtime",
    "Operator", ...)."""
    low = cat.lower()
    return _LEGACY_CATEGORIES.get(low, low)


def classify(cat: str, name: str) -> EventKind:
    """The EventKind of a complete event from its category and name (pure, cacheable)."""
    cat = canonical_category(cat)
    if cat == "kernel":
        return EventKind.COMM_KERNEL if _COMM_KERNEL_RE.search(name) else EventKind.COMPUTE_KERNEL
    if cat == "gpu_memcpy":
        return EventKind.MEMCPY
    if cat == "gpu_memset":
        return EventKind.MEMSET
    if cat == "gpu_user_annotation":
        return EventKind.GPU_ANNOTATION
    if cat in ("cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver", "runtime"):
        if name in _LAUNCH_NAMES or _LAUNCH_RE.match(name):
            return EventKind.RUNTIME_LAUNCH
        return EventKind.RUNTIME_OTHER
    if cat == "cuda_sync":
        return EventKind.CPU_SYNC
    if cat == "python_function":
        return EventKind.PYTHON_FUNCTION
    if name.startswith("ProfilerStep#"):
        return EventKind.PROFILER_STEP
    if _COMM_OP_RE.match(name):
        return EventKind.COMM_OP
    if _FSDP_RE.match(name):
        return EventKind.FSDP_ANNOTATION
    if cat == "user_annotation":
        return EventKind.USER_ANNOTATION
    if cat == "cpu_op":
        return EventKind.CPU_OP
    return EventKind.OTHER


def is_device_category(cat: str) -> bool:
    """True for categories that Kineto records on GPU lanes."""
    return canonical_category(cat) in _DEVICE_CATS


# --- collective kinds ---------------------------------------------------------------------

COLLECTIVE_KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "send_recv",
    "barrier",
    "gather",
    "scatter",
    "dispatch",
    "combine",
    "unknown",
)

_KIND_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(rx, re.IGNORECASE))
    for kind, rx in (
        ("reduce_scatter", r"reduce_?scatter|reducescatter"),
        ("all_gather", r"all_?gather|allgather"),
        ("all_reduce", r"all_?reduce|allreduce"),
        ("all_to_all", r"all_?to_?all|alltoall|all2all"),
        ("broadcast", r"broadcast|bcast"),
        (
            "send_recv",
            r"sendrecv|send_recv|\bsend\b|\brecv\b|ncclDevKernel_Send|ncclDevKernel_Recv|ncclKernel_Send|ncclKernel_Recv|:send|:recv|p2p",
        ),
        ("barrier", r"barrier"),
        ("reduce", r"(^|[_:])reduce(\b|_|$)"),
        ("gather", r"(^|[_:])gather"),
        ("scatter", r"(^|[_:])scatter"),
        ("dispatch", r"dispatch"),
        ("combine", r"combine"),
    )
)


def collective_kind(text: str) -> str:
    """Normalize a collective label ("allreduce", "ncclKernel_AllGather_RING..", "gloo:all_reduce",
    "_reduce_scatter_base") to one of COLLECTIVE_KINDS ("unknown" when nothing matches)."""
    for kind, rx in _KIND_PATTERNS:
        if rx.search(text):
            return kind
    return "unknown"


DTYPE_BYTES: dict[str, int] = {
    "float": 4,
    "float32": 4,
    "double": 8,
    "float64": 8,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "long": 8,
    "int64": 8,
    "int": 4,
    "int32": 4,
    "short": 2,
    "int16": 2,
    "char": 1,
    "byte": 1,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "complexfloat": 8,
    "complexdouble": 16,
}
"""Bytes per element for the `dtype` strings that Kineto writes in collective args."""


def dtype_size(dtype: str) -> int | None:
    """Bytes per element of a collective-args dtype string ("Float", "BFloat16"), or None."""
    return DTYPE_BYTES.get(dtype.strip().lower().removeprefix("torch."))
