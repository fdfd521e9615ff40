"""The versioned Report: the contract between analysis and presentation.

Analysis builds a `Report`; renderers (text, JSON, HTML, TUI, Perfetto overlay) only read it.
`encode_report` / `decode_report` give the JSON form (`zdiag analyze --json`). The schema string
is versioned: fields may be added with defaults (old files keep loading), never renamed.
Every duration carries its unit in its name (`_ms`, `_us`), every size is in bytes (`_bytes`).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

SCHEMA = "zdiag.report/1"

Severity = Literal["info", "warning", "critical"]
SEVERITY_ORDER: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}

# Verdicts, one per rank and step (thresholds: analyzers/rank/verdict.py).
VERDICTS = ("compute-bound", "comm-bound", "exposed-comm", "host-bound")


class DimensionComm(msgspec.Struct, kw_only=True):
    """One mesh dimension's share of a step's communication on one rank
    (analyzers/rank/comm_dimensions.py): time several dimensions communicate at once is split
    equally between them, so the shares add up to the step's `comm_ms` / `exposed_comm_ms`."""

    dimension: str  # "dp", "tp", "shard", "replicate", "world" (default group), "other"
    comm_ms: float
    exposed_comm_ms: float
    calls: int = 0  # the dimension's collectives starting in the step


class StepBreakdown(msgspec.Struct, kw_only=True):
    """Where one step's time went on one rank (unions over all device lanes).

    `comm_by_dimension` is set only on a rank whose collectives use groups of more than one
    mesh dimension (absent from the JSON otherwise, so single-group reports are as before)."""

    step: int
    start_ms: float = 0.0  # step start, from the rank's first event
    duration_ms: float
    compute_ms: float
    comm_ms: float
    overlapped_ms: float  # compute ∩ comm
    exposed_comm_ms: float  # comm − compute
    memcpy_ms: float = 0.0  # memcpy/memset not covered by compute or comm
    idle_ms: float  # no device activity at all
    host_launch_ms: float = 0.0  # host time in kernel-launch API calls
    kernel_count: int = 0
    verdict: str
    verdict_reason: str = ""  # the numbers and thresholds that decided it
    comm_by_dimension: list[DimensionComm] | UnsetType = UNSET


class RankReport(msgspec.Struct, kw_only=True):
    """One rank: its source file, its device kind, and its steps."""

    rank: int
    source: str = ""
    device: str = "unknown"  # "cuda", "rocm", "cpu"
    device_name: str | None = None  # the GPU's name, when the trace lists it
    host: str | None = None
    lanes: list[str] = msgspec.field(default_factory=list)
    # absolute `ts` (µs) of the rank's first event in its trace: StepBreakdown.start_ms is relative
    # to it; the Perfetto overlay adds it back to line up with the original trace (0.0: unknown)
    trace_start_us: float = 0.0
    steps: list[StepBreakdown] = msgspec.field(default_factory=list)
    warnings: list[str] = msgspec.field(default_factory=list)
    # where the rank number came from: "distributedInfo", "manifest", "file name", "default"
    rank_source: str = ""
    # how steps were found: "ProfilerStep", "optimizer step", "forward marker", "whole trace"
    step_source: str = ""
    # what the trace measured of the host's own waits, over the analyzed trace: the DataLoader's
    # `next()` ranges and the host syncs (CPU sync events and `.item()` ops)
    data_loading_ms: float = 0.0
    host_syncs: int = 0


class FsdpUnit(msgspec.Struct, kw_only=True):
    """One FSDP unit (a `fully_shard`-ed module, or a ZeRO/FSDP1 equivalent) on one rank."""

    name: str  # module fqn, e.g. "layers.3"; "" for the root
    rank: int
    framework: str = "fsdp2"  # "fsdp2", "fsdp1", "deepspeed"
    param_bytes: int | None = None
    all_gather_count: int = 0
    all_gather_bytes: int = 0
    all_gather_ms: float = 0.0
    reduce_count: int = 0
    reduce_bytes: int = 0
    reduce_ms: float = 0.0
    exposed_wait_ms: float = 0.0  # compute stalled waiting for this unit's collectives
    gather_lead_ms: float | None = None  # mean (needed - issued); <= 0: issued only when needed


class CollectiveKindStats(msgspec.Struct, kw_only=True):
    """Totals per collective kind (all_gather, reduce_scatter, all_reduce, ...) on one rank."""

    rank: int
    kind: str
    count: int
    total_bytes: int = 0
    total_ms: float = 0.0
    exposed_ms: float = 0.0
    dtypes: list[str] = msgspec.field(default_factory=list)


class CommDimension(msgspec.Struct, kw_only=True):
    """One mesh dimension the run communicates over (analyzers/run/comm_dimensions.py): its
    label (as in `DimensionComm.dimension`), its role ("dp-shard", "dp-replicate", "dp", "tp",
    "pp", "cp", "ep", "other"), where the role came from ("mesh": the captured model description,
    "name": the dimension's name, "kinds": its collective kinds), its group size (most common
    over ranks; None: unknown), the collective kinds it carried, its ranks and its mean
    communication and exposed communication per step over those ranks."""

    name: str
    role: str
    role_source: str = ""
    group_size: int | None = None
    kinds: list[str] = msgspec.field(default_factory=list)
    ranks: list[int] = msgspec.field(default_factory=list)
    comm_ms_per_step: float = 0.0
    exposed_comm_ms_per_step: float = 0.0


class StragglerStat(msgspec.Struct, kw_only=True):
    """How often a rank arrived last at matched collectives and the waiting it caused."""

    rank: int
    matched_collectives: int
    last_arrivals: int
    wait_caused_ms: float
    mean_skew_ms: float


class ProcessGroupStats(msgspec.Struct, kw_only=True):
    """One process group over the run (analyzers/run/process_groups.py), for the large-run views.

    One entry per group *instance* (its name and members: on a 2-D mesh two groups can share a
    name). `name` is the traces' "Process Group Name" ("" when they do not say); `description`
    and `declared_size` come from `distributedInfo.pg_config` when the traces record it; `ranks`
    are the ranks whose collectives carry the group (on a run with subgroups, a declared group no
    call was attributed to follows with its declared members and no calls). Per rank of the group: the median number of
    calls and the mean collective time per step (summed call durations). From the cross-rank
    matching: its matched collectives, their arrival skew, the waiting caused (above the
    straggler noise) and the rank that caused the most of it.
    """

    name: str
    description: str = ""
    declared_size: int | None = None
    ranks: list[int] = msgspec.field(default_factory=list)
    kinds: list[str] = msgspec.field(default_factory=list)
    calls_per_rank: float = 0.0
    comm_ms_per_step: float = 0.0
    matched_collectives: int = 0
    median_skew_ms: float | None = None
    max_skew_ms: float | None = None
    wait_caused_ms: float = 0.0
    top_waiter: int | None = None
    top_waiter_ms: float = 0.0


class TimelineSpan(msgspec.Struct, array_like=True):
    """One interval of a step timeline; `lane` is "compute", "comm:<kind>", "memcpy" or "fsdp"."""

    lane: str
    name: str
    start_ms: float  # from the step's start
    dur_ms: float


class StepTimeline(msgspec.Struct, kw_only=True):
    """The intervals of one chosen step on one rank, bounded in count (`truncated` says so)."""

    rank: int
    step: int
    spans: list[TimelineSpan] = msgspec.field(default_factory=list)
    truncated: bool = False


class MemoryTimeline(msgspec.Struct, kw_only=True):
    """Memory over time by category (e.g. PARAMETER, ACTIVATION, GRADIENT) on one rank."""

    rank: int
    source: str  # "memory_timeline", "snapshot", "trace"
    times_ms: list[float] = msgspec.field(default_factory=list)
    bytes_by_category: dict[str, list[int]] = msgspec.field(default_factory=dict)
    peak_bytes: int = 0
    peak_category_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    capacity_bytes: int | None = None
    oom: bool = False


class AllocationSite(msgspec.Struct, kw_only=True):
    """Live bytes allocated from one source line (the innermost user frame of the stack)."""

    site: str  # "model.py:88 in forward"
    bytes: int
    blocks: int
    category: str  # the category holding most of its bytes


class WhatIf(msgspec.Struct, kw_only=True):
    """A predicted peak under one change, with the arithmetic behind it."""

    change: str  # "activation checkpointing per block", "micro-batch / 2", ...
    predicted_peak_bytes: int | None  # None: cannot be predicted from what was recorded
    saved_bytes: int | None
    arithmetic: str
    fits: bool | None = None  # under the capacity (None when the capacity is unknown)


class MemoryBreakdown(msgspec.Struct, kw_only=True):
    """One rank's memory from a CUDA snapshot (or Kineto memory events): by category now (the
    end of the recording) and at the peak, reserved versus allocated, top allocation sites."""

    rank: int
    source: str  # "snapshot", "kineto memory events"
    device: int | None = None
    allocated_bytes: int | None = None  # at the end of the recording
    reserved_bytes: int | None = None
    pending_free_bytes: int = 0
    largest_free_block_bytes: int | None = None
    # free bytes in segments that also hold live blocks: the cache cannot release them
    fragmented_bytes: int | None = None
    segments: int = 0
    blocks: int = 0
    blocks_with_stacks: int = 0
    category_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    peak_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_category_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    peak_at: str = ""  # "replayed" (from the allocator history), "end of history"
    peak_time_ms: float | None = None
    history_events: int = 0
    top_sites: list[AllocationSite] = msgspec.field(default_factory=list)
    peak_activation_by_module: dict[str, int] = msgspec.field(default_factory=dict)
    peak_unsharded_by_module: dict[str, int] = msgspec.field(default_factory=dict)
    oom: bool = False
    oom_request_bytes: int | None = None
    capacity_bytes: int | None = None
    what_if: list[WhatIf] = msgspec.field(default_factory=list)
    # what the blocks allocated before recording most likely are, inferred from their total and
    # the captured model's sharded parameter bytes (absent when nothing matches or is known)
    preexisting_inferred: str | UnsetType = UNSET


class OperatorRow(msgspec.Struct, array_like=True):
    """One operator or kernel name's work in the analyzed steps (`OperatorTable`)."""

    name: str
    device: str  # "cpu" (host ops, runtime calls, annotations) or "gpu" (kernels, copies)
    count: float  # calls per step (per rank in `Report.operators`)
    ms: float  # inclusive time per step (nested host ops each count their own time)


class OperatorTable(msgspec.Struct, kw_only=True):
    """Operators and kernels by name, per step: what `zdiag diff` compares op by op (as HTA's
    trace diff does). `complete` is False when names were cut at the table's size limit (the
    least time first), so an absent name may have run below the cut."""

    ranks: int = 1
    steps: int = 0
    complete: bool = True
    rows: list[OperatorRow] = msgspec.field(default_factory=list)


class Finding(msgspec.Struct, kw_only=True):
    """A diagnosed problem, its evidence as numbers, the change to make and the gain to expect."""

    id: str  # stable: "whole-model-wrap", "tiny-layer-wrap", "missing-overlap", ...
    severity: Severity
    title: str
    ranks: list[int] = msgspec.field(default_factory=list)
    steps: list[int] = msgspec.field(default_factory=list)
    units: list[str] = msgspec.field(default_factory=list)
    evidence: dict[str, Any] = msgspec.field(default_factory=dict)
    recommendation: str = ""
    code: str | None = None  # the concrete code / config change
    expected_gain_ms: float | None = None  # per step
    expected_gain_bytes: int | None = None  # peak memory saved
    gain_method: str = ""  # how the gain was estimated


class Report(msgspec.Struct, kw_only=True):
    """Everything `zdiag analyze` found; renderers consume only this."""

    schema: str = SCHEMA
    zdiag_version: str = ""
    inputs: list[str] = msgspec.field(default_factory=list)
    ranks: list[RankReport] = msgspec.field(default_factory=list)
    findings: list[Finding] = msgspec.field(default_factory=list)
    fsdp_units: list[FsdpUnit] = msgspec.field(default_factory=list)
    collectives: list[CollectiveKindStats] = msgspec.field(default_factory=list)
    stragglers: list[StragglerStat] = msgspec.field(default_factory=list)
    timelines: list[StepTimeline] = msgspec.field(default_factory=list)
    memory: list[MemoryTimeline] = msgspec.field(default_factory=list)
    memory_breakdowns: list[MemoryBreakdown] = msgspec.field(default_factory=list)
    thresholds: dict[str, float] = msgspec.field(default_factory=dict)
    warnings: list[str] = msgspec.field(default_factory=list)
    run: dict[str, Any] | None = None  # manifest summary (world size, config, versions)
    process_groups: list[ProcessGroupStats] = msgspec.field(default_factory=list)  # 2+ ranks
    # ids of the rules whose detector crashed (their findings are missing; a warning says why)
    failed_detectors: list[str] = msgspec.field(default_factory=list)
    # the mesh dimensions communication ran over, when some rank used more than one (else absent)
    comm_dimensions: list[CommDimension] | UnsetType = UNSET
    # operators and kernels by name, per rank and step, over every analyzed rank (else absent)
    operators: OperatorTable | UnsetType = UNSET

    def findings_at_least(self, severity: str) -> list[Finding]:
        """Findings whose severity is `severity` or worse."""
        floor = SEVERITY_ORDER[severity]
        return [f for f in self.findings if SEVERITY_ORDER[f.severity] >= floor]


def encode_report(report: Report) -> bytes:
    """The report as indented-free JSON bytes (the `--json` output)."""
    return msgspec.json.encode(report)


def decode_report(data: bytes | str) -> Report:
    """Parse a JSON report; raises ValueError naming the problem for other schemas or bad JSON."""
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a JSON report ({exc})") from exc
    if not isinstance(raw, dict) or not str(raw.get("schema", "")).startswith("zdiag.report/"):
        raise ValueError("not a zdiag report (no 'schema': 'zdiag.report/N' field)")
    if raw["schema"] != SCHEMA:
        raise ValueError(f"report schema {raw['schema']!r} is newer than this zdiag ({SCHEMA})")
    try:
        return msgspec.convert(raw, Report)
    except msgspec.ValidationError as exc:
        raise ValueError(f"malformed zdiag report ({exc})") from exc
