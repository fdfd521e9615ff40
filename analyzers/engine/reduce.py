"""The reduce: rank summaries (and what the run recorded) in, one Report out.

`reduce_run(summaries, run)` never touches a trace: it matches collectives across ranks from the
summaries' per-call columns, builds the detectors' context from values, runs the detectors, and
assembles the Report once at the end from what each stage returned. The same summaries give the
same Report wherever they were computed (in this process, decoded from a cache, from workers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msgspec import UNSET

from zdiag import __version__

from ...collectors.run_records import Manifest
from ..detectors import STRAGGLER_RULE, DetectorContext, build_context, run_context
from ..inputs.model_facts import ModelFacts
from ..inputs.oom_records import OomRecords
from ..rank import verdict
from ..rank.operators import merge_tables
from ..rank.summary import RankSummary
from ..rank.timeline import select_timelines
from ..report import MemoryBreakdown, MemoryTimeline, Report, StepTimeline
from ..run.comm_dimensions import comm_dimensions
from ..run.core_use import HostCores
from ..run.crossrank import CrossRankResult
from ..run.crossrank_match import match_collectives
from ..run.process_groups import process_group_stats
from ..run.run_config import run_config
from ..run.stragglers import straggler_stats
from ..run.wait_graph import HangAnalysis


@dataclass(frozen=True)
class RunFacts:
    """What the reduce knows about the run besides its ranks.

    - `inputs`: the trace files, as given.
    - `manifest` / `run_dir`: the run manifest and directory (None for bare traces).
    - `oom_records`: the out-of-memory records of the run directory (analyzers/inputs/
      oom_records.py), read by the engine before the reduce.
    - `model`: the model description the run captured from the live model
      (analyzers/inputs/model_facts.py), loaded once per run; None when the run has none (the detectors
      then infer the configuration from trace labels, and `Report.run["model_facts"]` says so).
    - `warnings`: run-level warnings from loading (duplicate ranks, skipped memory timelines).
    - `memory`: the memory timelines loaded for the analyzed ranks.
    - `memory_breakdowns`: the CUDA snapshots' (and Kineto memory events') breakdowns.
    - `manifest_summary`: what `Report.run` takes from the manifest (schema, world size,
      versions; `pipeline.manifest_summary`).
    - `flight_recorder` / `flight_recorder_inputs`: the analysis of torch.distributed
      flight-recorder dumps given with the traces, and their paths (the `hang` detector reads it).
    - `flight_recorder_only`: the run is known from its flight-recorder dumps alone (no trace,
      manifest or snapshot): `Report.run` gives the world size their process groups name and
      their versions, and no threshold is reported (no step was analyzed).
    """

    inputs: tuple[str, ...] = ()
    manifest: Manifest | None = None
    run_dir: Path | None = None
    oom_records: OomRecords = field(default_factory=OomRecords)
    model: ModelFacts | None = None
    warnings: tuple[str, ...] = ()
    memory: tuple[MemoryTimeline, ...] = field(default_factory=tuple)
    memory_breakdowns: tuple[MemoryBreakdown, ...] = field(default_factory=tuple)
    manifest_summary: Mapping[str, Any] = field(default_factory=dict)
    flight_recorder: HangAnalysis | None = None
    flight_recorder_inputs: tuple[str, ...] = ()
    flight_recorder_only: bool = False
    host_cores: tuple[HostCores, ...] = ()  # how busy each host's cores were (run/core_use.py)


@dataclass(frozen=True)
class Reduction:
    """The reduce's result: the Report, the cross-rank matching and the detectors' context it
    was built from (what `zdiag plan` reads: the fact sheet and the step models)."""

    report: Report
    crossrank: CrossRankResult
    context: DetectorContext | None = None


def reduce_run(summaries: Sequence[RankSummary], run: RunFacts) -> Reduction:
    """Cross-rank matching, detectors and the Report, from rank summaries alone (rank order)."""
    matching = match_collectives(s.collective_columns() for s in summaries)
    multi_rank = len(matching.ranks) >= 2
    memory, breakdowns = merged_memory(summaries, run)
    ctx = build_context(
        summaries,
        manifest=run.manifest,
        oom_records=run.oom_records,
        model=run.model,
        memory=memory,
        memory_breakdowns=breakdowns,
        crossrank=matching,
        flight_recorder=run.flight_recorder,
        host_cores=run.host_cores,
    )
    detected = run_context(ctx)

    thresholds = {} if run.flight_recorder_only else verdict.thresholds()
    if multi_rank:
        thresholds.update(STRAGGLER_RULE.report_thresholds())
    warnings = list(run.warnings)
    if multi_rank:
        warnings += [f"cross-rank: {w}" for w in matching.warnings]
    for w in ctx.warnings:
        if w not in warnings:
            warnings.append(w)
    warnings += detected.warnings

    report = Report(
        zdiag_version=__version__,
        inputs=list(run.inputs) + list(run.flight_recorder_inputs),
        thresholds=thresholds,
        run=run_summary(summaries, run),
        ranks=[s.rank_report() for s in summaries],
        collectives=[c for s in summaries for c in s.collective_stats],
        timelines=_timelines(summaries),
        memory=memory,
        memory_breakdowns=breakdowns,
        fsdp_units=[u for s in summaries for u in s.rank_ledger().units()],
        stragglers=straggler_stats(matching) if multi_rank else [],
        process_groups=(
            process_group_stats(
                ((s.collective_columns(), len(s.steps), s.facts.process_groups) for s in summaries),
                matching.table,
            )
            if multi_rank
            else []
        ),
        findings=detected.findings,
        warnings=warnings,
        failed_detectors=list(detected.failed),
        comm_dimensions=comm_dimensions(summaries, run.model.mesh if run.model else None),
        operators=merge_tables([s.operators for s in summaries if s.operators]) or UNSET,
    )
    return Reduction(report=report, crossrank=matching, context=ctx)


def merged_memory(
    summaries: Sequence[RankSummary], run: RunFacts
) -> tuple[list[MemoryTimeline], list[MemoryBreakdown]]:
    """Memory timelines and breakdowns by rank: the run's files (memory timeline exports,
    CUDA snapshots) first, then the ranks' Kineto memory events where no file covers them."""
    memory = list(run.memory)
    breakdowns = list(run.memory_breakdowns)
    have_tl = {m.rank for m in memory}
    have_b = {b.rank for b in breakdowns}
    for s in summaries:
        if s.memory_timeline is not None and s.rank not in have_tl:
            memory.append(s.memory_timeline)
        if s.memory_breakdown is not None and s.rank not in have_b:
            breakdowns.append(s.memory_breakdown)
    return sorted(memory, key=lambda m: m.rank), sorted(breakdowns, key=lambda b: b.rank)


def _timelines(summaries: Sequence[RankSummary]) -> list[StepTimeline]:
    timelines = [s.timeline for s in summaries if s.timeline is not None]
    return select_timelines(timelines, {s.rank: list(s.steps) for s in summaries})


def run_summary(summaries: Sequence[RankSummary], run: RunFacts) -> dict[str, Any] | None:
    """`Report.run`: world size and backend from the ranks, then the manifest's own keys."""
    summary: dict[str, Any] = {}
    ws = next((s.world_size for s in summaries if s.world_size), None)
    if ws:
        summary["world_size"] = ws
    backend = next((s.backend for s in summaries if s.backend), None)
    if backend:
        summary["backend"] = backend
    if run.flight_recorder_only and run.flight_recorder is not None:
        summary.update(_dumps_summary(run.flight_recorder))
    if run.run_dir is not None:
        summary["run_dir"] = str(run.run_dir)
    summary.update(run.manifest_summary)
    if run.model is not None:
        summary["model_facts"] = run.model.summary()
    elif summaries and any(s.ledger and s.ledger.records for s in summaries):
        summary["model_facts"] = {
            "source": "inferred from trace labels",
            "captured": [],
            "inferred": ["framework", "unit names", "repeated blocks from unit names"],
            "unknown": ["module tree", "block classes", "framework settings", "optimizer"],
        }
    config = run_config(
        run.manifest,
        run.model.description if run.model is not None else None,
        [s.device for s in summaries],
        [s.host for s in summaries],
    )
    if config:  # the flat configuration `zdiag diff` compares (a dict: the text view skips it)
        summary["config"] = config
    if run.host_cores:  # how busy each host's cores were (run/core_use.py)
        summary["host_cores"] = [h.as_json() for h in run.host_cores]
    if "model_facts" in summary:  # one line for the text view, which shows scalars only
        summary["facts"] = summary["model_facts"]["source"]
    return summary or None


def _dumps_summary(analysis: HangAnalysis) -> dict[str, Any]:
    """`Report.run` of flight-recorder dumps alone: the ranks their process groups name, the
    dump format's and the communication library's versions."""
    out: dict[str, Any] = {
        "world_size": len(analysis.expected_ranks),
        "flight_recorder_version": analysis.version,
    }
    if analysis.comm_lib_version:
        out["comm_lib_version"] = analysis.comm_lib_version
    return out
