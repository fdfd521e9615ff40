"""Per-step breakdown of one rank: where the step's time went, from interval unions.

Activity sets (unions over all lanes, so two busy streams at once count once):

- GPU runs (the trace holds kernels/memcpys): `compute` = non-communication kernels,
  `comm` = communication kernels (NCCL/RCCL, custom all-reduce, DeepEP-style dispatch/combine)
  and the collectives the host carries out itself (gloo on CUDA tensors: `gloo:*` ops, which
  launch no kernel), `mem` = memcpy + memset. Other GPU annotations and host events are not
  device activity.
- Host-only runs (CPU/gloo, or a trace without GPU events): lanes are threads. `comm` = the
  outermost `gloo:*` / `nccl:*` / `c10d::*` / `record_param_comms` op on each thread; `compute`
  = per thread, the times whose innermost open op is a computing op (the self time of `aten::*`
  and other ops, not of wrappers such as `autograd::engine::evaluate_function: ...`, autograd
  nodes `...Backward0` or `PythonSubclass`, which also span hooks blocked waiting for a
  collective), minus the time that thread spent inside a comm op (a thread blocked in a
  collective is not computing), then the union over threads.

Per step window: `compute_ms`, `comm_ms`, `overlapped_ms` = |compute ∩ comm|, `exposed_comm_ms`
= |comm − compute|, `memcpy_ms` = |mem − compute − comm|, `idle_ms` = duration − |compute ∪ comm
∪ mem|. Hence compute + exposed_comm + memcpy + idle = duration exactly.
`host_launch_ms` = union of kernel-launch / async-copy API calls in the window;
`kernel_count` = kernels (compute + comm) starting in the window.
"""

from __future__ import annotations

import re

import numpy as np
import numpy.typing as npt

from ..inputs.events import EventKind, RankTrace
from ..report import CollectiveKindStats, StepBreakdown
from . import intervals as iv
from .collective_table import collectives_of, host_comm_events, host_executed_collectives
from .steps import StepWindows
from .verdict import decide

US_PER_MS = 1000.0


class ActivitySets:
    """The compute / comm / mem interval sets of one rank (see the module docstring)."""

    def __init__(self, trace: RankTrace) -> None:
        self.host_only = not trace.has_device_events
        if self.host_only:
            self.comm_events = host_comm_events(trace)
            self.compute, self.comm = _host_sets(trace, self.comm_events)
            self.mem = iv.EMPTY
            self.kernels = np.zeros(0, dtype=np.int64)
        else:
            comp = trace.of_kind(EventKind.COMPUTE_KERNEL)
            comm_kernels = trace.of_kind(EventKind.COMM_KERNEL)
            self.comm_events = np.sort(
                np.concatenate([comm_kernels, host_executed_collectives(trace)])
            )
            memi = trace.of_kind(EventKind.MEMCPY, EventKind.MEMSET)
            self.compute = _union_of(trace, comp)
            self.comm = _union_of(trace, self.comm_events)
            self.mem = _union_of(trace, memi)
            self.kernels = np.sort(np.concatenate([comp, self.comm_events]))
        self.overlapped = iv.intersect(self.compute, self.comm)
        self.exposed = iv.subtract(self.comm, self.compute)
        compute_or_comm = iv.join(self.compute, self.comm)
        self.mem_only = iv.subtract(self.mem, compute_or_comm)
        self.busy = iv.join(compute_or_comm, self.mem)
        launches = trace.of_kind(EventKind.RUNTIME_LAUNCH)
        self.launch = _union_of(trace, launches)


def _union_of(trace: RankTrace, idx: npt.NDArray[np.int64]) -> iv.IntervalSet:
    return iv.union(trace.ts_us[idx], trace.ts_us[idx] + trace.dur_us[idx])


_WRAPPER_OP_RE = re.compile(
    r"^(autograd::engine::evaluate_function: |PythonSubclass$|[A-Za-z0-9_]+Backward\d*$"
    r"|torch::autograd::AccumulateGrad$)"
)
"""CPU ops that only wrap others: their own (self) time is not computation. Autograd nodes run
backward hooks inside them, e.g. FSDP's pre-backward all-gather blocked waiting for gloo;
`AccumulateGrad` runs the gradient hooks (its accumulation is a child `aten::` op), e.g.
DeepSpeed ZeRO's bucket reduction and the wait for it."""


def _innermost_segments(
    start: npt.NDArray[np.float64], end: npt.NDArray[np.float64], counts: npt.NDArray[np.bool_]
) -> iv.IntervalSet:
    """The times at which the innermost open op (of one thread's nested ops) has counts=True."""
    order = np.lexsort((-(end - start), start)).tolist()
    st, en, ok = start.tolist(), end.tolist(), counts.tolist()
    seg_s: list[float] = []
    seg_e: list[float] = []
    stack: list[int] = []
    cur = 0.0

    def emit(a: float, b: float, op: int) -> None:
        if b > a and ok[op]:
            seg_s.append(a)
            seg_e.append(b)

    for i in order:
        s = st[i]
        while stack and en[stack[-1]] <= s:
            top = stack.pop()
            emit(cur, en[top], top)
            cur = max(cur, en[top])
        if stack:
            emit(cur, s, stack[-1])
        cur = s
        stack.append(i)
    while stack:
        top = stack.pop()
        emit(cur, en[top], top)
        cur = max(cur, en[top])
    return iv.union(np.asarray(seg_s), np.asarray(seg_e))


def _host_sets(
    trace: RankTrace, comm_idx: npt.NDArray[np.int64]
) -> tuple[iv.IntervalSet, iv.IntervalSet]:
    """(compute, comm) for host-only runs: per thread, the time in computing ops' own (self)
    time, minus that thread's time inside comm ops; then the union over threads."""
    ops = trace.of_kind(EventKind.CPU_OP, EventKind.COMM_OP)
    wrapper_ids = {j for j, name in enumerate(trace.names) if _WRAPPER_OP_RE.match(name)}
    counts_all = (trace.kind[ops] == int(EventKind.CPU_OP)) & ~np.isin(
        trace.name_id[ops], np.fromiter(wrapper_ids, np.int32, len(wrapper_ids))
    )
    comm = _union_of(trace, comm_idx)
    parts_s: list[npt.NDArray[np.float64]] = []
    parts_e: list[npt.NDArray[np.float64]] = []
    lanes_ops = trace.lane_id[ops]
    lanes_comm = trace.lane_id[comm_idx]
    for lane in np.unique(lanes_ops):
        mine = lanes_ops == lane
        idx = ops[mine]
        busy = _innermost_segments(
            trace.ts_us[idx], trace.ts_us[idx] + trace.dur_us[idx], counts_all[mine]
        )
        blocked = _union_of(trace, comm_idx[lanes_comm == lane])
        s, e = iv.subtract(busy, blocked)
        parts_s.append(s)
        parts_e.append(e)
    if not parts_s:
        return iv.EMPTY, comm
    compute = iv.union(np.concatenate(parts_s), np.concatenate(parts_e))
    return compute, comm


def breakdown_rank(
    trace: RankTrace, windows: StepWindows, sets: ActivitySets | None = None
) -> list[StepBreakdown]:
    """One StepBreakdown per step window of the rank (`sets`: reuse already built sets)."""
    if not len(windows):
        return []
    sets = sets or ActivitySets(trace)
    s, e = windows.start_us, windows.end_us
    dur = e - s
    compute = iv.clipped_totals(sets.compute, s, e)
    comm = iv.clipped_totals(sets.comm, s, e)
    overlapped = iv.clipped_totals(sets.overlapped, s, e)
    exposed = iv.clipped_totals(sets.exposed, s, e)
    mem_only = iv.clipped_totals(sets.mem_only, s, e)
    busy = iv.clipped_totals(sets.busy, s, e)
    launch = iv.clipped_totals(sets.launch, s, e)
    idle = np.maximum(dur - busy, 0.0)
    if len(sets.kernels):
        k_at = windows.index_of(trace.ts_us[sets.kernels])
        kernel_count = np.bincount(k_at[k_at >= 0], minlength=len(windows))
    else:
        kernel_count = np.zeros(len(windows), dtype=np.int64)
    origin = trace.trace_start_us
    out = []
    for k in range(len(windows)):
        d_ms = float(dur[k]) / US_PER_MS
        verdict, reason = decide(
            d_ms,
            float(compute[k]) / US_PER_MS,
            float(comm[k]) / US_PER_MS,
            float(exposed[k]) / US_PER_MS,
            float(idle[k]) / US_PER_MS,
        )
        out.append(
            StepBreakdown(
                step=int(windows.step[k]),
                start_ms=round((float(s[k]) - origin) / US_PER_MS, 6),
                duration_ms=round(d_ms, 6),
                compute_ms=round(float(compute[k]) / US_PER_MS, 6),
                comm_ms=round(float(comm[k]) / US_PER_MS, 6),
                overlapped_ms=round(float(overlapped[k]) / US_PER_MS, 6),
                exposed_comm_ms=round(float(exposed[k]) / US_PER_MS, 6),
                memcpy_ms=round(float(mem_only[k]) / US_PER_MS, 6),
                idle_ms=round(float(idle[k]) / US_PER_MS, 6),
                host_launch_ms=round(float(launch[k]) / US_PER_MS, 6),
                kernel_count=int(kernel_count[k]),
                verdict=verdict,
                verdict_reason=reason,
            )
        )
    return out


def collective_stats(
    trace: RankTrace, windows: StepWindows, sets: ActivitySets | None = None
) -> list[CollectiveKindStats]:
    """Totals per collective kind on one rank, over the step windows (all steps together)."""
    coll = collectives_of(trace)
    if not len(coll) or not len(windows):
        return []
    sets = sets or ActivitySets(trace)
    ev = coll.event
    in_window = windows.index_of(trace.ts_us[ev]) >= 0
    out = []
    for k in np.unique(coll.kind[in_window]):
        rows = np.flatnonzero(in_window & (coll.kind == k))
        idx = ev[rows]
        kind_set = _union_of(trace, idx)
        exposed = iv.total(iv.subtract(kind_set, sets.compute))
        b = coll.bytes[rows]
        dtypes = sorted({coll.dtype[int(r)] for r in rows if coll.dtype[int(r)]})
        out.append(
            CollectiveKindStats(
                rank=trace.rank,
                kind=coll.kinds[int(k)],
                count=len(rows),
                total_bytes=int(b[b > 0].sum()),
                total_ms=round(iv.total(kind_set) / US_PER_MS, 6),
                exposed_ms=round(exposed / US_PER_MS, 6),
                dtypes=dtypes,
            )
        )
    return out
