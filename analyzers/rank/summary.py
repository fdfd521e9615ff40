"""`RankSummary`: one rank's analysis as a compact, versioned, serializable value.

`summarize(analysis)` keeps from a `RankAnalysis` what the reduce (cross-rank matching, the
detectors, the Report) reads, and nothing that needs the trace again: the rank's identity and
step table, its collectives with per-call timing (as packed columns), the per-kind totals, the
representative-step timeline, the operators and kernels by name (at most 1000), the FSDP unit
ledger, the step models the what-if replay re-times (step_model.py: the first MAX_MODEL_STEPS
steps), the detector facts and, for traces recorded
with `profile_memory=True`, the memory breakdown and timeline from their Kineto `[memory]`
events (kineto_memory.py; at most 2000 timeline points). `encode_summary` /
`decode_summary` write and read it as zlib-compressed msgpack under the schema
`zdiag.rank-summary/1`, so a summary computed inside a training job or on a worker can be cached
and merged later.

Size: what grows with the trace is the per-call columns (8 + 8 + 2 + 2 + 4 bytes per collective
before compression), the ledger (one record per FSDP collective, ~120 bytes before compression),
the step models (one row per collective of a modelled step, ~100 bytes, plus the host-sync and
FSDP-range chunks; at most MAX_MODEL_STEPS steps and MAX_OPS_PER_STEP collectives a step)
and the step table; the timeline is capped at MAX_TIMELINE_SPANS spans and the operator table at
MAX_OPERATORS names (one row per distinct name, not per call); nothing grows with the number of
kernels or host ops. zlib (level 1, ~20 ms per MB) shrinks the whole 4x
(bench/summary_size.py measures it; figures in docs/benchmarks.md).
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import msgspec
import numpy as np

from ..report import (
    CollectiveKindStats,
    MemoryBreakdown,
    MemoryTimeline,
    OperatorTable,
    RankReport,
    StepBreakdown,
    StepTimeline,
)
from .collective_columns import RankCollectives, RankColumns
from .declared_groups import group_members
from .fsdp_ledger import RankLedger
from .rank_analysis import RankAnalysis, RankFacts
from .step_model import StepModel

SUMMARY_SCHEMA = "zdiag.rank-summary/1"

_F64 = np.dtype("<f8")
_I32 = np.dtype("<i4")
_U16 = np.dtype("<u2")


class CollectiveCalls(msgspec.Struct, kw_only=True):
    """One rank's collectives in start order, as little-endian packed columns.

    `kind` and `group` index `kinds` / `groups`; `step` is the step holding the call (-1: none).
    """

    start_us: bytes = b""  # float64
    end_us: bytes = b""  # float64
    kind: bytes = b""  # uint16 into kinds
    group: bytes = b""  # uint16 into groups
    step: bytes = b""  # int32
    kinds: list[str] = msgspec.field(default_factory=list)
    groups: list[str] = msgspec.field(default_factory=list)
    ends_align: bool = True

    @staticmethod
    def of(rc: RankCollectives) -> CollectiveCalls:
        """The packed columns of a RankCollectives."""
        kinds = sorted(set(rc.kind))
        groups = sorted(set(rc.process_group))
        k_of = {k: j for j, k in enumerate(kinds)}
        g_of = {g: j for j, g in enumerate(groups)}
        return CollectiveCalls(
            start_us=np.asarray(rc.start_us, dtype=_F64).tobytes(),
            end_us=np.asarray(rc.end_us, dtype=_F64).tobytes(),
            kind=np.fromiter((k_of[k] for k in rc.kind), _U16, len(rc.kind)).tobytes(),
            group=np.fromiter((g_of[g] for g in rc.process_group), _U16, len(rc)).tobytes(),
            step=np.asarray(rc.step, dtype=_I32).tobytes(),
            kinds=kinds,
            groups=groups,
            ends_align=rc.ends_align,
        )

    def columns(self, rank: int) -> RankColumns:
        """The columns the cross-rank matching reads: views of the packed bytes, no copy."""
        return RankColumns(
            rank=rank,
            start_us=np.frombuffer(self.start_us, dtype=_F64),
            end_us=np.frombuffer(self.end_us, dtype=_F64),
            kind=np.frombuffer(self.kind, dtype=_U16),
            kinds=self.kinds,
            group=np.frombuffer(self.group, dtype=_U16),
            groups=self.groups,
            step=np.frombuffer(self.step, dtype=_I32),
            ends_align=self.ends_align,
        )


class RankSummary(msgspec.Struct, kw_only=True):
    """What the reduce needs of one rank (see the module docstring)."""

    schema: str = SUMMARY_SCHEMA
    rank: int
    source: str = ""
    device: str = "unknown"
    host: str | None = None
    lanes: list[str] = msgspec.field(default_factory=list)
    trace_start_us: float = 0.0
    base_time_ns: int | None = None
    capacity_bytes: int | None = None
    device_name: str | None = None
    world_size: int | None = None
    backend: str | None = None
    rank_source: str = ""
    step_source: str = ""
    steps: list[StepBreakdown] = msgspec.field(default_factory=list)
    collectives: CollectiveCalls = msgspec.field(default_factory=CollectiveCalls)
    collective_stats: list[CollectiveKindStats] = msgspec.field(default_factory=list)
    timeline: StepTimeline | None = None
    ledger: RankLedger | None = None
    facts: RankFacts = msgspec.field(default_factory=RankFacts)
    warnings: list[str] = msgspec.field(default_factory=list)
    # from Kineto `[memory]` events (profile_memory=True); timeline capped at 2000 points
    memory_breakdown: MemoryBreakdown | None = None
    memory_timeline: MemoryTimeline | None = None
    operators: OperatorTable | None = None  # by name, per step (at most MAX_OPERATORS names)
    step_models: list[StepModel] = msgspec.field(default_factory=list)  # for the what-if replay

    def collective_columns(self) -> RankColumns:
        """The rank's collectives for the cross-rank matching (views of the summary's bytes)."""
        cols = self.collectives.columns(self.rank)
        members, unattributed = group_members(self.facts.process_groups, cols.groups)
        return replace(cols, group_members=members, unattributed=frozenset(unattributed))

    def rank_ledger(self) -> RankLedger:
        """The rank's FSDP ledger (an empty one when the summary holds none)."""
        return self.ledger or RankLedger(rank=self.rank, framework=None, device=self.device)

    def rank_report(self) -> RankReport:
        """The rank's entry in `Report.ranks`."""
        return RankReport(
            rank=self.rank,
            source=self.source,
            device=self.device,
            device_name=self.device_name,
            host=self.host,
            lanes=list(self.lanes),
            steps=list(self.steps),
            warnings=list(self.warnings),
            trace_start_us=self.trace_start_us,
            rank_source=self.rank_source,
            step_source=self.step_source,
            data_loading_ms=self.facts.data_loading_ms,
            host_syncs=self.facts.host_syncs,
        )


def summarize(analysis: RankAnalysis) -> RankSummary:
    """The RankSummary of a RankAnalysis."""
    return RankSummary(
        rank=analysis.rank,
        source=analysis.source,
        device=analysis.device,
        host=analysis.host,
        lanes=list(analysis.lanes),
        trace_start_us=analysis.trace_start_us,
        base_time_ns=analysis.base_time_ns,
        capacity_bytes=analysis.capacity_bytes,
        device_name=analysis.device_name,
        world_size=analysis.world_size,
        backend=analysis.backend,
        rank_source=analysis.rank_source,
        step_source=analysis.windows.source,
        steps=list(analysis.breakdown),
        collectives=CollectiveCalls.of(analysis.collectives),
        collective_stats=list(analysis.collective_stats),
        timeline=analysis.timeline,
        ledger=analysis.ledger if analysis.ledger.records else None,
        facts=analysis.facts,
        warnings=list(analysis.warnings),
        memory_breakdown=analysis.memory_breakdown,
        memory_timeline=analysis.memory_timeline,
        operators=analysis.operators,
        step_models=list(analysis.step_models),
    )


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(RankSummary)
ZLIB_LEVEL = 1
"""Level 1 compresses a summary about as well as level 6 (within 4%) three times faster."""


def encode_summary(summary: RankSummary) -> bytes:
    """The summary as bytes: msgpack, zlib-compressed."""
    return zlib.compress(_ENCODER.encode(summary), ZLIB_LEVEL)


def decode_summary(data: bytes, *, compressed: bool = True) -> RankSummary:
    """A summary from `encode_summary`'s bytes (`summary_msgpack`'s with compressed=False);
    ValueError when they are not a `zdiag.rank-summary/1` summary."""
    try:
        summary = _DECODER.decode(zlib.decompress(data) if compressed else data)
    except (zlib.error, msgspec.DecodeError) as exc:
        raise ValueError(f"not a zdiag rank summary ({exc})") from exc
    if summary.schema != SUMMARY_SCHEMA:
        raise ValueError(
            f"unsupported rank-summary schema {summary.schema!r} (want {SUMMARY_SCHEMA})"
        )
    return summary


class _TimelineHead(msgspec.Struct, kw_only=True):
    """A StepTimeline's rank and step, its spans skipped by the decoder."""

    rank: int
    step: int
    truncated: bool = False


class _SummaryWithoutSpans(RankSummary, kw_only=True):
    """A RankSummary decoded with its timeline's spans skipped (same encoding)."""

    timeline: _TimelineHead | None = None  # type: ignore[assignment]


_HEAD_DECODER = msgspec.msgpack.Decoder(_SummaryWithoutSpans)


def summary_msgpack(summary: RankSummary) -> bytes:
    """The summary as uncompressed msgpack (`encode_summary` without zlib), for stores that
    decode it often: `decode_summary_without_spans(data, compressed=False)` then skips the
    timeline's spans without inflating them."""
    return _ENCODER.encode(summary)


def inflate_summary(data: bytes) -> bytes:
    """`encode_summary` bytes as `summary_msgpack` bytes (ValueError when not zlib data)."""
    try:
        return zlib.decompress(data)
    except zlib.error as exc:
        raise ValueError(f"not a zdiag rank summary ({exc})") from exc


def decode_summary_without_spans(data: bytes, *, compressed: bool = True) -> RankSummary:
    """`decode_summary`, except that the timeline keeps its rank and step but no spans (a
    summary's timeline is most of its size; the reduce shows a few ranks' timelines only:
    decode those with `decode_summary`). `compressed=False` reads `summary_msgpack` bytes.
    ValueError as decode_summary."""
    try:
        head = _HEAD_DECODER.decode(zlib.decompress(data) if compressed else data)
    except (zlib.error, msgspec.DecodeError) as exc:
        raise ValueError(f"not a zdiag rank summary ({exc})") from exc
    if head.schema != SUMMARY_SCHEMA:
        raise ValueError(f"unsupported rank-summary schema {head.schema!r} (want {SUMMARY_SCHEMA})")
    fields = {f: getattr(head, f) for f in head.__struct_fields__ if f != "timeline"}
    tl = head.timeline
    timeline = (
        None if tl is None else StepTimeline(rank=tl.rank, step=tl.step, truncated=tl.truncated)
    )
    return RankSummary(**fields, timeline=timeline)
