"""The FSDP unit ledger: per sharded unit, what it gathered and reduced, when, and what it cost.

Input is one rank's columnar trace (`RankTrace`); output is one `FsdpUnit` per unit plus, in
`RankLedger`, the per-collective records the detectors replay. Patterns behind it are in
docs/fsdp-patterns.md. Behaviour first, labels as hints:

1. Collectives are found from the trace's communication: the host op that *issues* a collective
   (`c10d::_allgather_base_`, `c10d::_reduce_scatter_base_`, ...) and the event that *executes*
   it (an NCCL kernel linked by `correlation` to the launch inside the host op, or on gloo the
   `gloo:*` op on a worker thread, paired in issue order per collective family and size).
2. Each issue is attributed to a unit by the innermost framework label enclosing it on the
   issuing thread: FSDP2 `FSDP::all_gather (<fqn>)` / `FSDP::post_backward_reduce (<fqn>)`,
   FSDP1 `FullyShardedDataParallel.*` (units numbered in issue order within a step), DeepSpeed
   ZeRO Python ranges (`fetch_sub_module`, `__all_gather_params`, `reduce_*`, only in
   `with_stack` traces). DeepSpeed ZeRO-3 records no range Kineto sees (its ranges are NVTX), so
   a thread that runs ZeRO-3's per-module autograd Functions (`PreBackwardFunctionForModule`,
   `PostBackwardFunctionModule`, `LinearFunctionForZeroStage3`) makes every collective it
   issues ZeRO-3 traffic, except one-element reductions (overflow check, gradient norm) when
   the trace records the element count (NCCL always, gloo only with `record_shapes`); those are
   named by position (`zero-gather-<k>` / `zero-reduce-<k>`, k-th of its step). Collectives
   with no such label are not FSDP traffic and are left out.
3. Per gather: issued = host issue start; needed = start of the consuming
   `FSDP::pre_forward (<fqn>)` / `FSDP::pre_backward (<fqn>)` (FSDP2 only); lead = needed - issued;
   exposed = the part of the collective's execution not covered by compute on any lane, where
   "compute" is the breakdown's (`breakdown.ActivitySets.compute`: compute kernels on GPU runs,
   the self time of computing host ops on host-only runs), so a unit's exposed time and the
   step table's exposed communication use one definition.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from ..inputs.events import EventKind, RankTrace, collective_kind, dtype_size
from ..report import FsdpUnit
from . import intervals
from .breakdown import ActivitySets
from .collective_table import collectives_of, input_dtype, input_tensors
from .fsdp_labels import (
    Label,
    backward_spans,
    enclosing_by_issue,
    executions,
    issue_ops,
    labels_by_lane,
    zero3_lanes,
)

GATHER_FAMILY = "all_gather"
REDUCE_FAMILY = "reduce"


class CollectiveRecord(msgspec.Struct, kw_only=True, array_like=True):
    """One FSDP collective on one rank: who issued it, when it ran, and what it cost.

    A msgspec Struct (encoded as an array) so a rank's ledger travels in its `RankSummary`."""

    unit: str  # module fqn ("" = root), "fsdp1-unit-<k>", "zero-gather-<k>" / "zero-reduce-<k>"
    framework: str  # "fsdp2", "fsdp1", "deepspeed"
    family: str  # "all_gather" or "reduce"
    kind: str  # collective kind of the execution ("all_gather", "reduce_scatter", "all_reduce")
    phase: str  # "forward", "backward" or "" (unknown)
    step: int  # step number, -1 outside every step window
    issued_us: float  # host issue start
    issue_end_us: float  # host issue op end
    start_us: float  # execution start (kernel / worker op)
    end_us: float  # execution end
    bytes: int  # message bytes (gathered output / reduced input), -1 unknown
    dtype: str
    needed_us: float | None = None  # when the consuming pre_forward / pre_backward started
    exposed_us: float = 0.0  # execution time not covered by compute
    prefetched: bool = False  # issued under an explicit FSDP prefetch label
    # time between the previous gather of the same step and pass and this one (execution
    # times) that no collective fills: what a prefetch of this gather could hide it under
    window_before_us: float | None = None

    @property
    def dur_us(self) -> float:
        """Execution duration."""
        return self.end_us - self.start_us

    @property
    def lead_us(self) -> float | None:
        """needed - issued: > 0 the gather was issued ahead of its use."""
        return None if self.needed_us is None else self.needed_us - self.issued_us


class RankLedger(msgspec.Struct, kw_only=True):
    """The ledger of one rank: its FSDP collectives in issue order and per-unit totals."""

    rank: int
    framework: str | None  # None when the trace holds no FSDP/ZeRO traffic
    device: str
    records: list[CollectiveRecord] = msgspec.field(default_factory=list)
    unit_order: list[str] = msgspec.field(default_factory=list)  # units in first-issue order
    steps: list[int] = msgspec.field(default_factory=list)  # step numbers covered
    compute_us: float = 0.0  # compute union inside the analyzed windows
    window_us: float = 0.0  # summed length of the analyzed windows

    @property
    def gathers(self) -> list[CollectiveRecord]:
        """All-gather records in issue order."""
        return [r for r in self.records if r.family == GATHER_FAMILY]

    @property
    def reduces(self) -> list[CollectiveRecord]:
        """Gradient-reduction records in issue order."""
        return [r for r in self.records if r.family == REDUCE_FAMILY]

    def units(self) -> list[FsdpUnit]:
        """One FsdpUnit per unit, in first-issue order."""
        out = []
        for name in self.unit_order:
            recs = [r for r in self.records if r.unit == name]
            gathers = [r for r in recs if r.family == GATHER_FAMILY]
            reduces = [r for r in recs if r.family == REDUCE_FAMILY]
            leads = [r.lead_us for r in gathers if r.lead_us is not None]
            gather_bytes = [r.bytes for r in gathers if r.bytes > 0]
            out.append(
                FsdpUnit(
                    name=name,
                    rank=self.rank,
                    framework=recs[0].framework if recs else (self.framework or "fsdp2"),
                    param_bytes=max(gather_bytes) if gather_bytes else None,
                    all_gather_count=len(gathers),
                    all_gather_bytes=int(sum(max(r.bytes, 0) for r in gathers)),
                    all_gather_ms=sum(r.dur_us for r in gathers) / 1e3,
                    reduce_count=len(reduces),
                    reduce_bytes=int(sum(max(r.bytes, 0) for r in reduces)),
                    reduce_ms=sum(r.dur_us for r in reduces) / 1e3,
                    exposed_wait_ms=sum(r.exposed_us for r in recs) / 1e3,
                    gather_lead_ms=(sum(leads) / len(leads) / 1e3) if leads else None,
                )
            )
        return out


def _elems_and_dtype(trace: RankTrace, i: int) -> tuple[int, str, int]:
    """(largest tensor's element count, dtype, tensors with known shapes) from an op's
    `Input Dims` / `Input type` args (-1, "", 0 without `record_shapes`); see
    `collective_table.input_tensors` (a TensorList is one tensor, a 0-dim tensor one element)."""
    a = trace.args.get(int(i), {})
    tensors = input_tensors(a)
    best = max((n for n, _ in tensors), default=-1)
    return best, input_dtype(a), len(tensors)


def _message(
    trace: RankTrace, issue: int, execution: int, row: int | None, gather: bool
) -> tuple[int, int, str]:
    """(elements, bytes, dtype) of one collective's full message: the gathered output of an
    all-gather, the unreduced input of a reduction (the larger of input and output either
    way); -1 when unknown.

    Read in order: the issuing `c10d::` op's `Input Dims` (`_allgather_base_` lists output and
    input); the execution's collective row (`In/Out msg nelems` x `dtype`, recorded on NCCL
    with or without `record_shapes`); the execution's own `Input Dims`. When only one tensor of
    an all-gather is known (the list form `c10d::allgather_`, or `gloo:all_gather`) it is the
    shard: times the group size. A gloo run without `record_shapes` records none of these.
    """
    coll = collectives_of(trace)
    group = int(coll.group_size[row]) if row is not None else 0
    group = group if group > 0 else (trace.world_size or 1)
    row_dt = coll.dtype[row] if row is not None else ""
    row_n = max(int(coll.in_nelems[row]), int(coll.out_nelems[row])) if row is not None else -1
    row_bytes = int(coll.bytes[row]) if row is not None else -1
    n, dt, tensors = _elems_and_dtype(trace, issue)
    if n > 0:
        elems, dt = n * (group if gather and tensors < 2 else 1), dt or row_dt
    elif row_n >= 0:
        elems, dt = row_n, row_dt or dt
    else:
        elems = -1
    if elems < 0 or not dt:
        n, exec_dt, tensors = _elems_and_dtype(trace, execution)
        if elems < 0 and n > 0:
            elems = n * (group if gather and tensors < 2 else 1)
        dt = dt or row_dt or exec_dt
    size = dtype_size(dt) if dt else None
    if elems >= 0 and size is not None:
        return elems, elems * size, dt
    return elems, (row_bytes if row_bytes > 0 else -1), dt


def _family(kind: str) -> str | None:
    if kind == "all_gather":
        return GATHER_FAMILY
    if kind in ("reduce_scatter", "all_reduce", "reduce"):
        return REDUCE_FAMILY
    return None


@dataclass(frozen=True)
class _Windows:
    """Step windows as arrays (number, [start, end) on the trace clock); empty = no windows."""

    number: npt.NDArray[np.int64]
    start: npt.NDArray[np.float64]
    end: npt.NDArray[np.float64]
    host_start: npt.NDArray[np.float64]  # the same steps on the host (where issues happen)
    host_end: npt.NDArray[np.float64]

    @staticmethod
    def of(
        numbers: list[int] | None,
        starts: list[float] | None,
        ends: list[float] | None,
        host: tuple[list[float], list[float]] | None = None,
    ) -> _Windows:
        if numbers is None or starts is None or ends is None:
            empty = np.zeros(0)
            return _Windows(np.zeros(0, np.int64), empty, empty, empty, empty)
        start = np.asarray(starts, dtype=np.float64)
        end = np.asarray(ends, dtype=np.float64)
        return _Windows(
            np.asarray(numbers, dtype=np.int64),
            start,
            end,
            start if host is None else np.asarray(host[0], dtype=np.float64),
            end if host is None else np.asarray(host[1], dtype=np.float64),
        )

    def step_at(self, t: float) -> int | None:
        """The step number holding host time t (an issue); -1 when there are no windows, None
        outside them."""
        if not len(self.number):
            return -1
        k = int(np.searchsorted(self.host_start, t, side="right")) - 1
        if k < 0 or t >= self.host_end[k]:
            return None
        return int(self.number[k])


def build_rank_ledger(
    trace: RankTrace,
    step_numbers: list[int] | None = None,
    step_starts_us: list[float] | None = None,
    step_ends_us: list[float] | None = None,
    *,
    compute: intervals.IntervalSet | None = None,
    unit_param_bytes: Mapping[str, int] | None = None,
    host_windows: tuple[list[float], list[float]] | None = None,
    labels: dict[int, list[Label]] | None = None,
) -> RankLedger:
    """The FSDP ledger of one rank, limited to the given step windows (all events when None).

    Steps are given as parallel lists (number, start, end on the trace clock), e.g. from the
    pipeline's `StepWindows` (`.step`, `.start_us`, `.end_us`); `host_windows` (starts, ends)
    are the same steps on the host (`.cpu_start_us`, `.cpu_end_us`), which decide the step of a
    collective by its host issue (on a GPU trace the device windows lag the host's). `compute` is where compute ran
    (the breakdown's `ActivitySets.compute`, so a unit's exposed time agrees with the step
    table; built from the trace when not given). `unit_param_bytes` (e.g. the manifest's
    `fsdp_units`) sizes the collectives the trace recorded without shapes (`fill_missing_bytes`).
    `labels`: the trace's `labels_by_lane`, when the caller has them already.
    """
    ledger = RankLedger(rank=trace.rank, framework=None, device=trace.device)
    labels = labels_by_lane(trace) if labels is None else labels
    fsdp_labelled = any(lab.framework != "deepspeed" for labs in labels.values() for lab in labs)
    zero3 = set() if fsdp_labelled else zero3_lanes(trace)
    if not labels and not zero3:
        return ledger
    issues = issue_ops(trace, labels, zero3)
    if not issues:
        return ledger
    execs = executions(trace, issues)
    coll_row = {int(e): j for j, e in enumerate(collectives_of(trace).event)}
    if trace.has_device_events:
        pairing = _pair_by_correlation(trace, issues, execs)
    else:
        pairing = _pair_in_issue_order(trace, issues, execs, coll_row)
    if compute is None:
        compute = ActivitySets(trace).compute
    windows = _Windows.of(step_numbers, step_starts_us, step_ends_us, host_windows)
    records = _records(trace, issues, labels, zero3, pairing, coll_row, compute, windows)
    if not records:
        return ledger
    _name_fsdp1_units([r for r in records if r.framework == "fsdp1"])
    _name_zero_units([r for r in records if r.framework == "deepspeed"])
    _attach_needs(records, labels)
    _attach_windows(records)
    ledger.records = records
    if unit_param_bytes:
        fill_missing_bytes(ledger, unit_param_bytes)
    _set_totals(ledger, compute, windows)
    return ledger


def _exec_kind(trace: RankTrace, coll_row: dict[int, int], e: int) -> str:
    """The collective kind of an execution (its collectives-table row, else its name)."""
    j = coll_row.get(e)
    if j is not None and collectives_of(trace).kind_name(j) != "unknown":
        return collectives_of(trace).kind_name(j)
    return collective_kind(trace.name(e))


def _pair_by_correlation(trace: RankTrace, issues: list[int], execs: list[int]) -> dict[int, int]:
    """Issue -> execution on device runs: the kernel's launch (same correlation id) lies inside
    the issuing op on the same thread."""
    end_us = trace.end_us
    launch_of_corr: dict[int, int] = {}
    for i in trace.of_kind(EventKind.RUNTIME_LAUNCH):
        c = int(trace.correlation[i])
        if c >= 0:
            launch_of_corr[c] = int(i)
    issue_arr = np.asarray(issues)
    pairing: dict[int, int] = {}
    for e in execs:
        launch = launch_of_corr.get(int(trace.correlation[e]))
        if launch is None:
            continue
        t = float(trace.ts_us[launch])
        lane = trace.lane_id[launch]
        hit = issue_arr[
            (trace.lane_id[issue_arr] == lane)
            & (trace.ts_us[issue_arr] <= t)
            & (end_us[issue_arr] >= t)
        ]
        if len(hit) and int(hit[-1]) not in pairing:
            pairing[int(hit[-1])] = e
    return pairing


def _pair_in_issue_order(
    trace: RankTrace, issues: list[int], execs: list[int], coll_row: dict[int, int]
) -> dict[int, int]:
    """Issue -> execution on host-only runs: FIFO per collective family (backends run one
    process group's collectives in issue order)."""
    queues: dict[str, list[int]] = defaultdict(list)
    for e in sorted(execs, key=lambda e: float(trace.ts_us[e])):
        fam = _family(_exec_kind(trace, coll_row, e))
        if fam:
            queues[fam].append(e)
    pos: dict[str, int] = defaultdict(int)
    pairing: dict[int, int] = {}
    for i in issues:
        fam = _family(collective_kind(trace.name(i)))
        if fam is None:
            continue
        q = queues[fam]
        k = pos[fam]
        while k < len(q) and float(trace.ts_us[q[k]]) < float(trace.ts_us[i]):
            k += 1  # an execution that started before this issue belongs to no FSDP issue
        if k < len(q):
            pairing[i] = q[k]
            pos[fam] = k + 1
    return pairing


class _PhaseOfZero:
    """DeepSpeed's pass of an issue: reductions are backward; a gather is backward when issued
    inside an autograd node (spans built on first use: most traces are not DeepSpeed)."""

    def __init__(self, trace: RankTrace, issues: list[int]) -> None:
        self._trace = trace
        self._issues = issues
        self._spans: dict[int, intervals.IntervalSet] | None = None

    def __call__(self, lane: int, t: float, family: str) -> str:
        if self._spans is None:
            lanes = {int(self._trace.lane_id[x]) for x in self._issues}
            self._spans = backward_spans(self._trace, lanes)
        in_backward = lane in self._spans and bool(
            intervals.covers(self._spans[lane], np.array([t]))[0]
        )
        return "backward" if family == REDUCE_FAMILY or in_backward else "forward"


def _records(
    trace: RankTrace,
    issues: list[int],
    labels: dict[int, list[Label]],
    zero3: set[int],
    pairing: dict[int, int],
    coll_row: dict[int, int],
    compute: intervals.IntervalSet,
    windows: _Windows,
) -> list[CollectiveRecord]:
    """One CollectiveRecord per FSDP/ZeRO issue inside the windows (units named later)."""
    end_us = trace.end_us
    enclosing_of = enclosing_by_issue(trace, issues, labels)
    zero_phase = _PhaseOfZero(trace, issues)
    records: list[CollectiveRecord] = []
    for i in issues:
        t = float(trace.ts_us[i])
        enclosing = enclosing_of[i]
        lane = int(trace.lane_id[i])
        if enclosing:
            framework = enclosing[-1].framework
        elif lane in zero3:
            framework = "deepspeed"
        else:
            continue
        kind_name = collective_kind(trace.name(i))
        fam = _family(kind_name)
        if fam is None:
            continue
        step = windows.step_at(t)
        if step is None:
            continue
        e = pairing.get(i, i)
        elems, nbytes, dt = _message(trace, i, e, coll_row.get(e), fam == GATHER_FAMILY)
        unit = ""  # FSDP1 and ZeRO units are named by position afterwards
        if framework == "fsdp2":
            inner = enclosing[-1]
            unit = inner.fqn if inner.fqn is not None else ""
            phase = ""
        elif framework == "fsdp1":
            names = " ".join(lab.phase for lab in enclosing)
            phase = "backward" if "backward" in names else "forward"
        else:
            if fam == REDUCE_FAMILY and 0 <= elems <= 1:
                continue  # overflow check / gradient norm, not gradient traffic
            phase = zero_phase(lane, t, fam)
        start = float(trace.ts_us[e])
        end = float(end_us[e])
        covered = intervals.total(intervals.clip(compute, start, end))
        records.append(
            CollectiveRecord(
                unit=unit,
                framework=framework,
                family=fam,
                kind=_exec_kind(trace, coll_row, e) if e != i else kind_name,
                phase=phase,
                step=step,
                issued_us=t,
                issue_end_us=float(end_us[i]),
                start_us=start,
                end_us=end,
                bytes=nbytes,
                dtype=dt,
                exposed_us=max(0.0, (end - start) - covered),
                prefetched=any(lab.phase.endswith("_prefetch") for lab in enclosing),
            )
        )
    return records


def _set_totals(ledger: RankLedger, compute: intervals.IntervalSet, windows: _Windows) -> None:
    """The ledger's framework, unit order, covered steps, window length and compute inside it."""
    records = ledger.records
    frameworks = {r.framework for r in records}
    ledger.framework = "fsdp2" if "fsdp2" in frameworks else sorted(frameworks)[0]
    ledger.unit_order = list(dict.fromkeys(r.unit for r in records))
    if len(windows.number):
        covered_steps = sorted({r.step for r in records})
        ledger.steps = covered_steps
        mask = np.isin(windows.number, covered_steps)
        w_s, w_e = windows.start[mask], windows.end[mask]
        ledger.window_us = float((w_e - w_s).sum())
        ledger.compute_us = float(intervals.clipped_totals(compute, w_s, w_e).sum())
    else:
        lo = min(r.issued_us for r in records)
        hi = max(r.end_us for r in records)
        ledger.window_us = hi - lo
        ledger.compute_us = intervals.total(intervals.clip(compute, lo, hi))


def _name_fsdp1_units(records: list[CollectiveRecord]) -> None:
    """FSDP1 labels name no module: a unit is its position in the forward pass
    (`fsdp1-unit-<k>`). Each backward gather and gradient reduction goes to the latest forward
    unit of the same iteration with the same message size that it has not yet been matched to
    (backward runs in reverse), else to the latest unmatched one."""
    forward: list[CollectiveRecord] = []
    used: dict[str, set[int]] = {GATHER_FAMILY: set(), REDUCE_FAMILY: set()}
    in_backward = False
    for r in records:  # issue order
        if r.family == GATHER_FAMILY and r.phase == "forward":
            if in_backward:  # a new iteration
                forward, in_backward = [], False
                used = {GATHER_FAMILY: set(), REDUCE_FAMILY: set()}
            r.unit = f"fsdp1-unit-{len(forward)}"
            forward.append(r)
            continue
        in_backward = True
        taken = used[r.family]
        free = [k for k in range(len(forward) - 1, -1, -1) if k not in taken]
        same = [k for k in free if forward[k].bytes == r.bytes and r.bytes > 0]
        pick = same[0] if same else (free[0] if free else None)
        if pick is None:
            r.unit = "fsdp1-unit-?"
            continue
        taken.add(pick)
        r.unit = forward[pick].unit


def _name_zero_units(records: list[CollectiveRecord]) -> None:
    """DeepSpeed ZeRO names no unit in Kineto, and its collectives are not per module: ZeRO-3
    fetches (possibly coalesced) module parameters and reduces gradients in buckets. Each is
    named by its position in its step: the k-th all-gather `zero-gather-<k>`, the k-th
    reduction `zero-reduce-<k>` (DeepSpeed replays the same fetch order every step, so the same
    name is the same parameters across steps)."""
    counter: dict[tuple[int, str], int] = defaultdict(int)
    for r in records:  # issue order
        key = (r.step, r.family)
        prefix = "zero-gather" if r.family == GATHER_FAMILY else "zero-reduce"
        r.unit = f"{prefix}-{counter[key]}"
        counter[key] += 1


def _attach_windows(records: list[CollectiveRecord]) -> None:
    """Each gather's `window_before_us`: the time between the previous gather's execution end
    (same step and pass, execution order) and this gather's execution start that no collective
    fills (compute, and idle time: a gather issued one unit ahead runs during both; another
    collective, such as a reduce-scatter in backward, holds the same communicator)."""
    by_pass: dict[tuple[int, str], list[CollectiveRecord]] = defaultdict(list)
    for r in records:
        if r.family == GATHER_FAMILY:
            by_pass[(r.step, r.phase)].append(r)
    comm = intervals.union(
        np.array([r.start_us for r in records], dtype=float),
        np.array([r.end_us for r in records], dtype=float),
    )
    for recs in by_pass.values():
        recs.sort(key=lambda r: r.start_us)
        for prev, cur in itertools.pairwise(recs):
            lo, hi = prev.end_us, max(prev.end_us, cur.start_us)
            cur.window_before_us = (hi - lo) - intervals.total(intervals.clip(comm, lo, hi))


def _attach_needs(records: list[CollectiveRecord], labels: dict[int, list[Label]]) -> None:
    """FSDP2: set each gather's `needed_us` and phase from the unit's next pre_forward /
    pre_backward label (the hook that blocks until the parameters are there)."""
    consumers: dict[str, list[Label]] = defaultdict(list)
    for labs in labels.values():
        for lab in labs:
            if lab.framework == "fsdp2" and lab.phase in ("pre_forward", "pre_backward"):
                consumers[lab.fqn or ""].append(lab)
    ends: dict[str, list[float]] = {}
    for fqn, labs in consumers.items():
        labs.sort(key=lambda lab: lab.start)
        ends[fqn] = [lab.end for lab in labs]  # one unit's hooks never overlap: ends ascend
    for r in records:
        if r.framework != "fsdp2":
            continue
        if r.family != GATHER_FAMILY:
            r.phase = "backward"
            continue
        labs = consumers.get(r.unit, [])
        k = bisect.bisect_left(ends.get(r.unit, []), r.issued_us)
        if k < len(labs):
            r.needed_us = labs[k].start
            r.phase = "forward" if labs[k].phase == "pre_forward" else "backward"


def fill_missing_bytes(ledger: RankLedger, unit_param_bytes: Mapping[str, int]) -> None:
    """Collectives whose size the trace does not record (gloo without `record_shapes`) take
    their unit's unsharded parameter bytes (e.g. the run manifest's `fsdp_units`).

    An all-gather and its gradient reduction both move the unit's full parameter count; those
    bytes are at the parameters' storage dtype, so under bf16 gathers they overstate a gather
    2x: sizes recorded in the trace always win.
    """
    for r in ledger.records:
        if r.bytes <= 0 and unit_param_bytes.get(r.unit, 0) > 0:
            r.bytes = unit_param_bytes[r.unit]
