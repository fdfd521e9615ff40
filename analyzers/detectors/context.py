"""What every detector reads, computed once per analysis: FSDP ledgers, manifest facts, memory.

Detectors are pure functions of a `DetectorContext`, a value built by `build_context` from the
ranks' summaries (analyzers/rank/summary.py), the cross-rank matching, the run manifest, the
out-of-memory records the engine read (analyzers/inputs/oom_records.py) and the memory stage's
breakdowns; it holds no trace, reads no file and keeps no reference to the pipeline's objects,
so detectors can be tested on hand-built contexts. Its `sheet` (detectors/fact_sheet.py) holds
the run's facts (framework, settings, the captured model, device), derived once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from ...collectors.run_records import FsdpUnitRecord, Manifest, RankEntry
from ..inputs.model_facts import ModelFacts
from ..inputs.oom_records import OomRecords
from ..rank.declared_groups import Members
from ..rank.fsdp_ledger import CollectiveRecord, RankLedger
from ..rank.host_syncs import HostSyncSites
from ..rank.step_model import with_unit_paths
from ..report import MemoryBreakdown, MemoryTimeline, StepBreakdown
from .fact_sheet import RunFactSheet, build_fact_sheet
from .mesh_dims import TP, group_roles, tensor_parallel

if TYPE_CHECKING:
    from ..rank.rank_analysis import RankFacts
    from ..rank.step_model import StepModel
    from ..rank.summary import RankSummary
    from ..run.core_use import HostCores
    from ..run.crossrank import CrossRankResult
    from ..run.wait_graph import HangAnalysis
    from ..whatif.run_whatif import Change, WhatIfResult

MIB = 1024**2


@dataclass
class MemoryEvidence:
    """What is known about one rank's memory at its peak or at its out-of-memory error."""

    rank: int
    source: str  # "memory_timeline", "oom record", "manifest"
    oom: bool = False
    capacity_bytes: int | None = None
    peak_bytes: int | None = None
    category_bytes: dict[str, int] = field(default_factory=dict)  # ACTIVATION, PARAMETER, ...
    message: str = ""
    # the OOM record's failure point: the module paths whose call was running, outermost first,
    # and whether it came inside backward
    modules: tuple[str, ...] = ()
    in_backward: bool = False


@dataclass(frozen=True)
class DetectorContext:
    """The analyzed run as the detectors see it (values only).

    - `ledgers`: rank -> FSDP ledger (empty ledgers for non-FSDP traces)
    - `breakdowns`: rank -> its step table
    - `facts`: rank -> what detectors read from its events (host syncs, module class, groups)
    - `manifest`: the run manifest, when the input was a run directory
    - `model`: the model description captured from the live model (None: the detectors infer
      the configuration from trace labels, the manifest and the harness's options)
    - `memory`: per-rank memory evidence (OOM records, snapshots, memory timelines)
    - `crossrank`: the collectives matched across ranks (None for one rank)
    - `flight_recorder`: the analysis of flight-recorder dumps given as input (None without)
    - `warnings`: what building the context found (damaged OOM records, snapshots without
      stacks, ...)
    - `memory_breakdowns`: per-rank memory breakdowns (CUDA snapshots, Kineto memory events)
    - `record_members`: rank -> {a ledger record's execution start (us, rounded to the ns):
      the members of the process group that ran it}, where the trace says (gloo calls: by the
      thread the collectors recorded); what tells a mesh dimension's collectives apart
    - `step_models`: rank -> its modelled steps (rank/step_model.py), what the what-if replay
      re-times for the findings' expected gains (detectors/replayed_gain.py), their FSDP units
      named by module path where the captured model says (FSDP1's are named by position in a
      trace); `device`: the ranks' device kind
    - `host_cores`: how busy each host's CPU cores were, where the run's step logs and manifest
      say (run/core_use.py)
    - `sheet`: the run's facts, derived once from the values above (detectors/fact_sheet.py)
    - `group_roles`: {group members: mesh role} (detectors/mesh_dims.py); `tensor_parallel`:
      whether the run has a TP dimension (derived)
    """

    ledgers: dict[int, RankLedger]
    breakdowns: dict[int, list[StepBreakdown]] = field(default_factory=dict)
    facts: dict[int, RankFacts] = field(default_factory=dict)
    manifest: Manifest | None = None
    model: ModelFacts | None = None
    memory: list[MemoryEvidence] = field(default_factory=list)
    crossrank: CrossRankResult | None = None
    flight_recorder: HangAnalysis | None = None
    warnings: list[str] = field(default_factory=list)
    memory_breakdowns: list[MemoryBreakdown] = field(default_factory=list)
    record_members: dict[int, dict[float, Members]] = field(default_factory=dict)
    step_models: dict[int, list[StepModel]] = field(default_factory=dict)
    device: str = "unknown"
    host_cores: tuple[HostCores, ...] = ()
    sheet: RunFactSheet = field(init=False)
    group_roles: dict[Members, str] = field(init=False, repr=False)
    tensor_parallel: bool = field(init=False, repr=False)
    _tp_groups: frozenset[Members] = field(init=False, repr=False)
    # the what-if replays the detectors asked for, by change (detectors/replayed_gain.py): a
    # change two findings price (missing-overlap, exposed-comm) is replayed once
    replays: dict[Change, WhatIfResult | None] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sheet = build_fact_sheet(
            ledgers=self.ledgers,
            breakdowns=self.breakdowns,
            facts=self.facts,
            manifest=self.manifest,
            model=self.model,
        )
        object.__setattr__(self, "sheet", sheet)
        roles = group_roles(sheet.mesh, self.facts.values())
        object.__setattr__(self, "group_roles", roles)
        object.__setattr__(self, "tensor_parallel", tensor_parallel(sheet.mesh, roles))
        tp = frozenset(m for m, role in roles.items() if role == TP)
        object.__setattr__(self, "_tp_groups", tp)
        object.__setattr__(self, "replays", {})

    def module_class(self, rank: int) -> tuple[str, int] | None:
        """(class, instances) of the rank's most repeated module class (`with_stack` traces)."""
        f = self.facts.get(rank)
        return f.module_class if f is not None else None

    def host_syncs(self, rank: int) -> int:
        """Host syncs (`.item()`, synchronize) in the rank's model code (FSDP units, the
        wrapper's forward): not the optimizer's own, not the loop's (0 when unknown)."""
        f = self.facts.get(rank)
        return f.host_sync_sites.in_model if f is not None else 0

    def host_sync_sites(self, rank: int) -> HostSyncSites:
        """The rank's host syncs by caller (analyzers/rank/host_syncs.py); empty when unknown."""
        f = self.facts.get(rank)
        return f.host_sync_sites if f is not None else HostSyncSites()

    def group_sizes(self, rank: int) -> list[int]:
        """Distinct process-group sizes of the rank's collectives ([] when unrecorded)."""
        f = self.facts.get(rank)
        return list(f.group_sizes) if f is not None else []

    def members_of(self, rank: int, record: CollectiveRecord) -> Members | None:
        """The members of the process group that ran a ledger record (None: not known)."""
        return self.record_members.get(rank, {}).get(round(record.start_us, 3))

    def fsdp_ledgers(self) -> list[RankLedger]:
        """Ledgers of the ranks that show FSDP/ZeRO traffic, by rank; a record that ran in a
        tensor-parallel group is no FSDP traffic and is left out (`record_members`)."""
        out = []
        for rank, lg in sorted(self.ledgers.items()):
            if not (lg.framework and lg.records):
                continue
            if self._tp_groups:
                kept = [r for r in lg.records if self.members_of(rank, r) not in self._tp_groups]
                if not kept:
                    continue
                if len(kept) < len(lg.records):
                    lg = msgspec.structs.replace(lg, records=kept)
            out.append(lg)
        return out

    def manifest_units(self) -> tuple[FsdpUnitRecord, ...]:
        """The manifest's `fsdp_units` (name, param_count, param_bytes), () when absent."""
        return self.manifest.fsdp_units if self.manifest is not None else ()


def build_context(
    summaries: Sequence[RankSummary],
    *,
    manifest: Manifest | None = None,
    oom_records: OomRecords | None = None,
    model: ModelFacts | None = None,
    memory: Sequence[MemoryTimeline] = (),
    memory_breakdowns: Sequence[MemoryBreakdown] = (),
    crossrank: CrossRankResult | None = None,
    flight_recorder: HangAnalysis | None = None,
    host_cores: Sequence[HostCores] = (),
) -> DetectorContext:
    """The DetectorContext of a run's rank summaries, its matching, manifest, the OOM records
    the engine read and the memory data."""
    records = oom_records or OomRecords()
    warnings = list(records.warnings)
    evidence = _memory_evidence(
        manifest,
        {s.rank for s in summaries},
        records,
        list(memory),
        warnings,
        memory_breakdowns,
    )
    ledgers = {s.rank: s.rank_ledger() for s in summaries}
    paths = model.trace_unit_paths() if model is not None else {}  # FSDP1 units by module path
    return DetectorContext(
        ledgers=ledgers,
        breakdowns={s.rank: list(s.steps) for s in summaries},
        facts={s.rank: s.facts for s in summaries},
        manifest=manifest,
        model=model,
        memory=evidence,
        crossrank=crossrank,
        flight_recorder=flight_recorder,
        warnings=warnings,
        memory_breakdowns=list(memory_breakdowns),
        record_members={s.rank: _record_members(s, ledgers[s.rank]) for s in summaries},
        step_models={
            s.rank: with_unit_paths(s.step_models, paths) for s in summaries if s.step_models
        },
        device=summaries[0].device if summaries else "unknown",
        host_cores=tuple(host_cores),
    )


def _record_members(summary: RankSummary, ledger: RankLedger) -> dict[float, Members]:
    """{execution start (us, rounded to the ns): group members} of the ledger's records, from
    the rank's collectives table (calls whose group's members are known)."""
    if not ledger.records:
        return {}
    cols = summary.collective_columns()
    starts = np.round(cols.start_us, 3)
    wanted = np.isin(starts, [round(r.start_us, 3) for r in ledger.records])
    out: dict[float, Members] = {}
    for j in np.flatnonzero(wanted).tolist():
        members = cols.members_of(int(cols.group[j]))
        if members:
            out[float(starts[j])] = tuple(members)
    return out


# --- memory evidence ------------------------------------------------------------------------

# The harness's emulated OOM message and torch's wording are parsed for their numbers.
# A memory-budget hook's own wording ("29.27 MiB held by saved activations", "budget 48.0 MiB")
# names the same numbers: the activations held and the budget that counts as the capacity.
_OOM_ACT_RE = re.compile(r"([\d.]+) MiB (?:held by )?(?:saved )?activations")
_OOM_BUDGET_RE = re.compile(r"budget (?:of )?([\d.]+) (GiB|MiB|KiB)")
_OOM_UNSHARDED_RE = re.compile(r"([\d.]+) MiB unsharded parameters")
_OOM_STATE_RE = re.compile(r"([\d.]+) MiB sharded parameters, gradients and optimizer state")
_OOM_CAPACITY_RE = re.compile(r"total capacity of ([\d.]+) GiB")
# With torch.cuda.set_per_process_memory_fraction the allocator's cap: the capacity that counts.
_OOM_ALLOWED_RE = re.compile(r"([\d.]+) (GiB|MiB|KiB) allowed")
_OOM_ALLOC_RE = re.compile(r"Tried to allocate ([\d.]+) (MiB|GiB|KiB)")
_UNIT = {"KiB": 1024, "MiB": MIB, "GiB": 1024**3}


def _mib(rx: re.Pattern[str], text: str) -> int | None:
    m = rx.search(text)
    return int(float(m.group(1)) * MIB) if m else None


def parse_oom_message(rank: int, text: str, source: str = "oom record") -> MemoryEvidence:
    """MemoryEvidence from an out-of-memory message (torch's CUDA wording or zdiag's harness)."""
    ev = MemoryEvidence(rank=rank, source=source, oom=True, message=text[:300])
    for cat, rx in (
        ("ACTIVATION", _OOM_ACT_RE),
        ("PARAMETER_UNSHARDED", _OOM_UNSHARDED_RE),
        ("MODEL_STATE", _OOM_STATE_RE),
    ):
        v = _mib(rx, text)
        if v is not None:
            ev.category_bytes[cat] = v
    allowed = _OOM_ALLOWED_RE.search(text) or _OOM_BUDGET_RE.search(text)
    m = _OOM_CAPACITY_RE.search(text)
    if allowed:
        ev.capacity_bytes = int(float(allowed.group(1)) * _UNIT[allowed.group(2)])
    elif m:
        ev.capacity_bytes = int(float(m.group(1)) * 1024**3)
    m = _OOM_ALLOC_RE.search(text)
    request = int(float(m.group(1)) * _UNIT[m.group(2)]) if m else 0
    if set(ev.category_bytes) == {"ACTIVATION"} and ev.capacity_bytes is not None:
        # only the activations are named: the rest of what was in use (capacity minus the
        # request that failed) is counted as OTHER, so the activations' share is not 100%
        rest = ev.capacity_bytes - request - ev.category_bytes["ACTIVATION"]
        if rest > 0:
            ev.category_bytes["OTHER"] = rest
    if ev.category_bytes:
        ev.peak_bytes = sum(ev.category_bytes.values()) + request
    return ev


def _memory_evidence(
    manifest: Manifest | None,
    analyzed: set[int],
    oom_records: OomRecords,
    timelines: list[MemoryTimeline],
    warnings: list[str],
    breakdowns: Sequence[MemoryBreakdown] = (),
) -> list[MemoryEvidence]:
    """One MemoryEvidence per rank with memory data, merging the OOM record (what was in use at
    the failure: preferred for categories), else the CUDA snapshot's breakdown (the memory
    stage's categories at the peak), else the memory timeline (the peak by category), and the
    manifest's per-rank `oom` flag."""
    by_rank: dict[int, MemoryEvidence] = {}
    entries = manifest.ranks if manifest is not None else ()
    for entry in entries:
        rec = oom_records.by_rank.get(entry.rank)
        if rec is not None:
            ev = parse_oom_message(entry.rank, rec.error)
            if ev.capacity_bytes is None and rec.memory_budget_bytes is not None:
                ev.capacity_bytes = rec.memory_budget_bytes
            ev.modules, ev.in_backward = rec.modules, rec.in_backward
            by_rank[entry.rank] = ev
        elif entry.oom:
            by_rank[entry.rank] = parse_oom_message(entry.rank, entry.error or "", "manifest")
    add_breakdown_evidence(by_rank, breakdowns)
    _warn_snapshots_without_stacks(analyzed, by_rank, entries, breakdowns, warnings)
    for tl in timelines:
        known = by_rank.get(tl.rank)
        if known is None:
            by_rank[tl.rank] = MemoryEvidence(
                rank=tl.rank,
                source=tl.source,
                oom=tl.oom,
                capacity_bytes=tl.capacity_bytes,
                peak_bytes=tl.peak_bytes or None,
                category_bytes=dict(tl.peak_category_bytes),
            )
            continue
        known.oom = known.oom or tl.oom
        if known.capacity_bytes is None:
            known.capacity_bytes = tl.capacity_bytes
        if not known.category_bytes and tl.peak_category_bytes:
            known.category_bytes = dict(tl.peak_category_bytes)
            known.peak_bytes = tl.peak_bytes or None
            known.source = f"{known.source} + {tl.source}"
    return [by_rank[r] for r in sorted(by_rank)]


def _warn_snapshots_without_stacks(
    analyzed: set[int],
    by_rank: dict[int, MemoryEvidence],
    entries: tuple[RankEntry, ...],
    breakdowns: Sequence[MemoryBreakdown],
    warnings: list[str],
) -> None:
    """A warning naming the out-of-memory ranks (of the analyzed ones) whose failure is
    unexplained because their CUDA snapshot, the one evidence left, has no allocation stacks."""
    snapshots = {b.rank: b for b in breakdowns if b.source.startswith("snapshot")}
    no_stacks = []
    for entry in entries:
        ev = by_rank.get(entry.rank)
        if ev is None or ev.category_bytes or entry.memory_snapshot is None:
            continue
        snap = snapshots.get(entry.rank)
        if snap is not None and not snap.blocks_with_stacks:
            if not analyzed or entry.rank in analyzed:
                no_stacks.append(entry.rank)
    if no_stacks:
        _warn(
            warnings,
            f"rank(s) {', '.join(map(str, no_stacks))} ran out of memory, but their CUDA snapshots "
            "have no allocation stacks, so what filled the memory is unknown; re-run with "
            "`zdiag run --profile-memory`.",
        )


def _warn(warnings: list[str], message: str) -> None:
    if message not in warnings:
        warnings.append(message)


def add_breakdown_evidence(
    by_rank: dict[int, MemoryEvidence], breakdowns: Sequence[MemoryBreakdown]
) -> None:
    """Categories at the peak from the snapshots' breakdowns (with stacks), for ranks whose OOM
    record named none; a rank known only from its snapshot gets its evidence from it."""
    for b in breakdowns:
        if not b.blocks_with_stacks and b.source.startswith("snapshot"):
            continue
        cats = dict(b.peak_category_bytes)
        known = by_rank.get(b.rank)
        if known is None:
            by_rank[b.rank] = MemoryEvidence(
                rank=b.rank,
                source=b.source,
                oom=b.oom,
                capacity_bytes=b.capacity_bytes,
                peak_bytes=(b.peak_bytes or 0) + (b.oom_request_bytes or 0) or None,
                category_bytes=cats,
            )
            continue
        known.oom = known.oom or b.oom
        if known.capacity_bytes is None:
            known.capacity_bytes = b.capacity_bytes
        if not known.category_bytes and cats:
            known.category_bytes = cats
            known.peak_bytes = (b.peak_bytes or 0) + (b.oom_request_bytes or 0) or None
            known.source = f"{known.source} + {b.source}"
