"""What every detector reads, computed once per analysis: FSDP ledgers, manifest facts, memory.

Detectors are pure functions of a `DetectorContext`. `build_context` is the only place that
reads the pipeline's `RunData` / `Analysis` (and the small run-dir files they point to: OOM
records), so detectors can be tested on hand-built contexts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zdiag.analyzers.events import RankTrace
from zdiag.analyzers.fsdp_ledger import (
    RankLedger,
    cached_rank_ledger,
    fill_missing_bytes,
    manifest_unit_bytes,
)
from zdiag.analyzers.memory_snapshot import read_snapshot, summarize_snapshot
from zdiag.analyzers.report import MemoryTimeline, Report, StepBreakdown
from zdiag.analyzers.run_data import Analysis, RunData
from zdiag.collectors.rundir import (
    FsdpUnitRecord,
    Manifest,
    OomRecord,
    RankEntry,
    read_run_json,
    run_file,
)
from zdiag.errors import InputError

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


@dataclass
class DetectorContext:
    """The analyzed run as the detectors see it."""

    ledgers: dict[int, RankLedger]  # rank -> ledger (empty ledgers for non-FSDP traces)
    breakdowns: dict[int, list[StepBreakdown]] = field(default_factory=dict)
    traces: dict[int, RankTrace] = field(default_factory=dict)
    manifest: Manifest | None = None
    memory: list[MemoryEvidence] = field(default_factory=list)
    report: Report | None = None
    run: RunData | None = None  # the pipeline's (for detectors that delegate, e.g. straggler)
    analysis: Analysis | None = None

    @property
    def harness(self) -> dict[str, Any]:
        """The harness options recorded in the manifest ({} for other scripts)."""
        return dict(self.manifest.harness or {}) if self.manifest else {}

    @property
    def world_size(self) -> int | None:
        """World size from the manifest or the traces."""
        if self.manifest is not None:
            return self.manifest.world_size
        for t in self.traces.values():
            if t.world_size:
                return t.world_size
        return None

    @property
    def nnodes(self) -> int | None:
        """Number of nodes (manifest `nnodes`, else distinct hosts), None when unknown."""
        if self.manifest is not None:
            return self.manifest.nnodes
        hosts = {t.host for t in self.traces.values() if t.host}
        return len(hosts) if hosts else None

    def fsdp_ledgers(self) -> list[RankLedger]:
        """Ledgers of the ranks that show FSDP/ZeRO traffic, by rank."""
        return [lg for _, lg in sorted(self.ledgers.items()) if lg.framework and lg.records]

    def manifest_units(self) -> tuple[FsdpUnitRecord, ...]:
        """The manifest's `fsdp_units` (name, param_count, param_bytes), () when absent."""
        return self.manifest.fsdp_units if self.manifest is not None else ()


def build_context(run: RunData, analysis: Analysis) -> DetectorContext:
    """The DetectorContext of a pipeline `RunData` and `Analysis` (see analyzers/run_data.py)."""
    traces: dict[int, RankTrace] = {t.rank: t for t in run.ranks}
    ledgers: dict[int, RankLedger] = {}
    for rank, t in traces.items():
        w = analysis.steps.get(rank)
        if w is not None and len(w):
            ledgers[rank] = cached_rank_ledger(
                t, w.step.tolist(), w.start_us.tolist(), w.end_us.tolist()
            )
        else:
            ledgers[rank] = cached_rank_ledger(t)
    report = analysis.report
    ctx = DetectorContext(
        ledgers=ledgers,
        breakdowns=dict(analysis.breakdowns),
        traces=traces,
        manifest=run.manifest,
        report=report,
        run=run,
        analysis=analysis,
    )
    ctx.memory = _memory_evidence(ctx, run.run_dir, report)
    fill_unit_bytes_from_manifest(ctx)
    return ctx


def fill_unit_bytes_from_manifest(ctx: DetectorContext) -> None:
    """Size the collectives the trace recorded without shapes from the manifest's units."""
    sizes = manifest_unit_bytes(ctx.manifest)
    if sizes:
        for lg in ctx.ledgers.values():
            fill_missing_bytes(lg, sizes)


# --- memory evidence ------------------------------------------------------------------------

# The harness's emulated OOM message and torch's wording are parsed for their numbers.
_OOM_ACT_RE = re.compile(r"([\d.]+) MiB activations")
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
    allowed = _OOM_ALLOWED_RE.search(text)
    m = _OOM_CAPACITY_RE.search(text)
    if allowed:
        ev.capacity_bytes = int(float(allowed.group(1)) * _UNIT[allowed.group(2)])
    elif m:
        ev.capacity_bytes = int(float(m.group(1)) * 1024**3)
    m = _OOM_ALLOC_RE.search(text)
    if ev.category_bytes:
        ev.peak_bytes = sum(ev.category_bytes.values())
        if m:
            ev.peak_bytes += int(float(m.group(1)) * _UNIT[m.group(2)])
    return ev


def _memory_evidence(
    ctx: DetectorContext, run_dir: Path | None, report: Report | None
) -> list[MemoryEvidence]:
    """One MemoryEvidence per rank with memory data, merging the OOM record (what was in use at
    the failure: preferred for categories), else the CUDA snapshot taken at the failure, else the
    memory timeline (the peak by category), and the manifest's per-rank `oom` flag."""
    by_rank: dict[int, MemoryEvidence] = {}
    entries = ctx.manifest.ranks if ctx.manifest is not None else ()
    for entry in entries:
        rec = _read_oom_record(ctx, run_dir, entry) if run_dir is not None else None
        if rec is not None:
            ev = parse_oom_message(entry.rank, rec.error)
            if ev.capacity_bytes is None and rec.memory_budget_bytes is not None:
                ev.capacity_bytes = rec.memory_budget_bytes
            by_rank[entry.rank] = ev
        elif entry.oom:
            by_rank[entry.rank] = parse_oom_message(entry.rank, entry.error or "", "manifest")
    if run_dir is not None:
        _add_snapshot_categories(ctx, by_rank, entries, run_dir)
    timelines: list[MemoryTimeline] = list(report.memory) if report is not None else []
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


# Snapshots with allocation history can be hundreds of MB each, and when one rank runs out of
# memory its peers usually do too: a few ranks tell what filled the memory.
MAX_SNAPSHOTS = 4


def _add_snapshot_categories(
    ctx: DetectorContext,
    by_rank: dict[int, MemoryEvidence],
    entries: tuple[RankEntry, ...],
    run_dir: Path,
) -> None:
    """Fill out-of-memory ranks' categories from their CUDA snapshots (taken at the failure),
    for the analyzed ranks (all of them in a run without traces), on the device each trained on."""
    analyzed = set(ctx.traces)
    todo = []
    for entry in entries:
        ev = by_rank.get(entry.rank)
        if ev is None or ev.category_bytes or entry.memory_snapshot is None:
            continue
        if not analyzed or entry.rank in analyzed:
            try:
                path = run_file(run_dir, entry.memory_snapshot)
            except InputError as exc:
                _warn(ctx, f"memory snapshot skipped: {exc.message}")
                continue
            todo.append((ev, path, _cuda_index(entry.device)))
    if len(todo) > MAX_SNAPSHOTS:
        _warn(
            ctx,
            f"{len(todo)} ranks ran out of memory; the CUDA snapshots of ranks "
            f"{', '.join(str(ev.rank) for ev, _, _ in todo[:MAX_SNAPSHOTS])} were read "
            "(pick others with --rank)",
        )
    no_stacks = []
    for ev, path, device in todo[:MAX_SNAPSHOTS]:
        try:
            mem = summarize_snapshot(read_snapshot(path), device)
        except InputError as exc:
            _warn(ctx, f"memory snapshot skipped: {exc.message}")
            continue
        if not mem.has_stacks:
            no_stacks.append(ev.rank)
            continue
        ev.category_bytes = dict(mem.category_bytes)
        ev.peak_bytes = mem.in_use_bytes + (mem.oom_request_bytes or 0)
        ev.source = f"{ev.source} + snapshot"
    if no_stacks:
        _warn(
            ctx,
            f"rank(s) {', '.join(map(str, no_stacks))} ran out of memory, but their CUDA snapshots "
            "have no allocation stacks, so what filled the memory is unknown; re-run with "
            "`zdiag run --profile-memory`.",
        )


def _cuda_index(device: str | None) -> int | None:
    """3 for the manifest's "cuda:3"; None when unknown (the snapshot's busiest device is used)."""
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def _warn(ctx: DetectorContext, message: str) -> None:
    if ctx.report is not None and message not in ctx.report.warnings:
        ctx.report.warnings.append(message)


def _read_oom_record(ctx: DetectorContext, run_dir: Path, entry: RankEntry) -> OomRecord | None:
    """The rank's OOM record (None without one); a damaged or refused one is a warning."""
    if entry.oom_record is None:
        return None
    warnings: list[str] = []
    try:
        data = read_run_json(run_dir, entry.oom_record)
        record = OomRecord.from_json(
            data, entry.oom_record, warnings, ctx.manifest.world_size if ctx.manifest else None
        )
    except InputError as exc:
        _warn(ctx, f"out-of-memory record skipped: {exc.message}")
        return None
    for w in warnings:
        _warn(ctx, w)
    return record
