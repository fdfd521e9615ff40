"""The per-rank map: one trace in, one frozen `RankAnalysis` out.

`analyze_rank(trace, context)` does every piece of work that needs the trace's events: the step
windows, the per-step breakdown (split by mesh dimension on multi-group ranks), the collectives with their per-call timing, the per-kind
collective totals, the representative-step timeline, the operators and kernels by name, the FSDP unit ledger (its unknown message
sizes filled once, from `context.unit_param_bytes`) and the few facts detectors read from the
events (host syncs, repeated module class, process-group sizes). It reads nothing else, writes
nothing (the trace is left as it was) and returns the warnings it has about the rank.

Everything after it (cross-rank matching, detectors, the Report) works on the compact
`RankSummary` derived from it (analyzers/rank/summary.py), so the map can run anywhere: in this
process, a process pool, inside the training job or on a worker next to the files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec
import numpy as np

from .. import frameworks
from ..inputs.events import RankTrace, as_int64
from ..memory.kineto_memory import kineto_memory
from ..report import (
    CollectiveKindStats,
    MemoryBreakdown,
    MemoryTimeline,
    OperatorTable,
    StepBreakdown,
    StepTimeline,
)
from .breakdown import ActivitySets, breakdown_rank, collective_stats
from .collective_columns import RankCollectives, rank_collectives
from .collective_table import build_collectives, collectives_of
from .comm_dimensions import with_comm_by_dimension
from .declared_groups import ProcessGroupInfo, trace_groups
from .fsdp_labels import labels_by_lane
from .fsdp_ledger import RankLedger, build_rank_ledger
from .host_syncs import HostSyncSites, host_sync_sites
from .module_classes import repeated_module_class
from .operators import operator_table
from .pipeline_times import PipelineStepTimes, pipeline_times
from .step_model import StepModel, build_step_models
from .steps import StepWindows, drop_unfinished_tail, find_steps
from .timeline import step_timeline


@dataclass(frozen=True)
class RankContext:
    """What the run (its manifest) says about one rank, given to the map with its trace.

    - `finished_steps`: steps the rank finished before it ended (a trailing `ProfilerStep`
      window it never finished is left out: the script's teardown after a clean exit, or the
      step a crash, a signal or a hang interrupted), None when unknown.
    - `failure`: how the rank ended when it did not exit cleanly ("raised RuntimeError: ...",
      "ended by SIGTERM", "hung"), None for a clean exit.
    - `collector_errors`: what zdiag's collectors reported on the rank during the run.
    - `unit_param_bytes`: {unit fqn: unsharded parameter bytes}, for the collectives the trace
      recorded without shapes.
    - `thread_groups`: {OS thread id: process-group name}, the gloo worker threads the collectors
      saw each group start, for the gloo calls, which name no group (`collective_table.py`).
    """

    finished_steps: int | None = None
    failure: str | None = None
    collector_errors: tuple[str, ...] = ()
    unit_param_bytes: Mapping[str, int] = field(default_factory=dict)
    thread_groups: Mapping[int, str] = field(default_factory=dict)


class RankFacts(msgspec.Struct, kw_only=True):
    """What the detectors read about a rank besides its ledger and step breakdown."""

    world_size: int | None = None  # from distributedInfo
    host: str | None = None
    host_syncs: int = 0  # CPU sync events + `.item()` ops in the trace
    host_sync_sites: HostSyncSites = msgspec.field(default_factory=HostSyncSites)  # by caller
    module_class: tuple[str, int] | None = None  # most repeated `nn.Module: <Class>_<k>` class
    group_sizes: list[int] = msgspec.field(default_factory=list)  # distinct process-group sizes
    # distributedInfo.pg_config: name, description, declared size, members (process_groups.py)
    process_groups: list[ProcessGroupInfo] = msgspec.field(default_factory=list)
    framework: str | None = None  # the first registered framework whose labels the trace holds
    data_loading_ms: float = 0.0  # the trace's `enumerate(DataLoader)#...` ranges, summed
    # per step, the pipeline stage's work and wait on its micro-batches (pipeline_times.py)
    pipeline: list[PipelineStepTimes] = msgspec.field(default_factory=list)


@dataclass(frozen=True)
class RankAnalysis:
    """One rank's analysis: everything later stages need, computed from its trace alone."""

    rank: int
    source: str
    device: str
    host: str | None
    lanes: tuple[str, ...]  # device lanes, else all lanes (host threads)
    trace_start_us: float
    base_time_ns: int | None
    capacity_bytes: int | None  # the device's total memory, when the trace lists it
    device_name: str | None  # the GPU's name ("NVIDIA A100-SXM4-80GB"), when the trace lists it
    world_size: int | None
    backend: str | None
    rank_source: str
    windows: StepWindows
    breakdown: tuple[StepBreakdown, ...]
    collectives: RankCollectives  # per call: start, end, kind, process group, step
    collective_stats: tuple[CollectiveKindStats, ...]
    ledger: RankLedger
    timeline: StepTimeline | None
    facts: RankFacts
    warnings: tuple[str, ...]
    memory_breakdown: MemoryBreakdown | None = None  # from Kineto `[memory]` events
    memory_timeline: MemoryTimeline | None = None
    operators: OperatorTable | None = None  # operators and kernels by name, per step
    step_models: tuple[StepModel, ...] = ()  # what the what-if replay re-times (step_model.py)


def analyze_rank(trace: RankTrace, context: RankContext | None = None) -> RankAnalysis:
    """The map: one rank's trace (and what the run says about it) -> its RankAnalysis."""
    context = context or RankContext()
    if context.thread_groups:  # the table every part below reads, gloo calls attributed
        trace.collectives = build_collectives(trace, context.thread_groups)
    warnings = list(trace.warnings)
    warnings += [f"zdiag run: {e}" for e in context.collector_errors]
    windows, step_warnings = find_steps(trace)
    warnings += step_warnings
    if context.finished_steps is not None:
        windows, dropped = drop_unfinished_tail(windows, context.finished_steps)
        if dropped and context.failure is None:
            warnings.append(
                f"step {dropped[0]} left out: the run ended inside it (the profiler stopped "
                "during the script's teardown, after its last optimizer step)"
            )
        elif dropped:
            warnings.append(
                f"step {dropped[0]} left out: the rank {context.failure} inside it, so it never "
                "finished (its events are not a step)"
            )
    sets = ActivitySets(trace)
    breakdown = with_comm_by_dimension(trace, windows, sets, breakdown_rank(trace, windows, sets))
    timeline = step_timeline(trace, windows, breakdown, sets)
    warnings += thin_trace_warnings(trace)
    labels = labels_by_lane(trace)  # read once: the ledger and the step models use them
    ledger = build_rank_ledger(
        trace,
        windows.step.tolist(),
        windows.start_us.tolist(),
        windows.end_us.tolist(),
        compute=sets.compute,
        unit_param_bytes=context.unit_param_bytes,
        host_windows=(windows.cpu_start_us.tolist(), windows.cpu_end_us.tolist()),
        labels=labels,
    )
    capacity = device_capacity(trace)
    memory_breakdown, memory_timeline, memory_warnings = kineto_memory(trace, capacity)
    warnings += memory_warnings
    info = trace.distributed_info or {}
    backend = info.get("backend")
    collectives = rank_collectives(trace, windows)
    return RankAnalysis(
        rank=trace.rank,
        source=str(trace.source),
        device=trace.device,
        host=trace.host,
        lanes=tuple(
            [lane.name for lane in trace.lanes if lane.is_device]
            or [lane.name for lane in trace.lanes]
        ),
        trace_start_us=trace.trace_start_us,
        base_time_ns=trace.base_time_ns,
        capacity_bytes=capacity,
        device_name=device_name(trace),
        world_size=trace.world_size,
        backend=str(backend) if backend else None,
        rank_source=trace.rank_source,
        windows=windows,
        breakdown=tuple(breakdown),
        collectives=collectives,
        collective_stats=tuple(collective_stats(trace, windows, sets)),
        ledger=ledger,
        timeline=timeline,
        facts=rank_facts(trace, windows),
        warnings=tuple(warnings),
        memory_breakdown=memory_breakdown,
        memory_timeline=memory_timeline,
        operators=operator_table(trace, windows),
        step_models=tuple(
            build_step_models(trace, windows, sets, collectives, ledger.records, labels)
        ),
    )


def rank_facts(trace: RankTrace, windows: StepWindows | None = None) -> RankFacts:
    """The detector facts of a trace (see RankFacts); the pipeline timings need its steps."""
    sites = host_sync_sites(trace)
    return RankFacts(
        world_size=trace.world_size,
        host=trace.host,
        host_syncs=sites.total,
        host_sync_sites=sites,
        module_class=repeated_module_class(trace),
        group_sizes=sorted({int(g) for g in collectives_of(trace).group_size if int(g) > 0}),
        process_groups=trace_groups(trace),
        framework=fw.name if (fw := frameworks.from_trace(trace.names)) is not None else None,
        data_loading_ms=data_loading_ms(trace),
        pipeline=pipeline_times(trace, windows) if windows is not None else [],
    )


DATALOADER_PREFIX = "enumerate(DataLoader)"
"""torch.profiler's range around each `next()` on a DataLoader iterator."""


def data_loading_ms(trace: RankTrace) -> float:
    """Host time in the trace's DataLoader `next()` ranges (the input pipeline's wait)."""
    nids = [n for n, name in enumerate(trace.names) if name.startswith(DATALOADER_PREFIX)]
    if not nids:
        return 0.0
    sel = np.isin(trace.name_id, np.asarray(nids, dtype=np.int32))
    return round(float(trace.dur_us[sel].sum()) / 1000.0, 4)


def device_capacity(trace: RankTrace) -> int | None:
    """The first listed device's total memory in bytes (`totalGlobalMem`), None when unknown."""
    if not trace.device_properties:
        return None
    mem = as_int64(trace.device_properties[0].get("totalGlobalMem"))
    return mem if mem else None


def device_name(trace: RankTrace) -> str | None:
    """The name of the GPU the rank's kernels ran on (its device lanes' id in the trace's
    `deviceProperties`, else the first listed), None when the trace lists none."""
    props = [p for p in trace.device_properties if p.get("name")]
    if not props:
        return None
    used = {str(lane.pid) for lane in trace.lanes if lane.is_device}
    chosen = next((p for p in props if str(p.get("id")) in used), props[0])
    return str(chosen["name"])


def thin_trace_warnings(t: RankTrace) -> list[str]:
    """Warnings saying what a valid but thin (or unusual) trace lacks."""
    if len(t) == 0:
        return []
    out = []
    gpus = {lane.pid for lane in t.lanes if lane.is_device}
    if len(gpus) > 1:
        out.append(
            f"the trace holds activity of {len(gpus)} GPUs: they are analyzed together as this "
            "rank's device time (one trace per rank and GPU gives per-GPU results)"
        )
    if not t.has_device_events:
        if t.device_properties:
            out.append(
                "the trace lists a GPU but holds no GPU kernels or copies: the breakdown uses host "
                "threads (record with ProfilerActivity.CUDA to see device time)"
            )
        else:
            out.append(
                "no GPU events (CPU-only run): lanes are host threads and communication is the "
                "gloo/c10d ops on them"
            )
    return out
