"""The analysis stages called one by one, for tests that look at their intermediate values.

`zdiag analyze` has one pipeline (`analyzers/engine/summary_pipeline.py`; tests that check a
Report call `summary_pipeline.analyze_paths`). Tests of a stage's own values (the decoded
`RankTrace`s, the per-rank `RankAnalysis`, the cross-rank matching) need those values, which the
pipeline does not keep: these two functions call the same stage functions in the same order,
in this process, and return what the pipeline throws away.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zdiag.analyzers.engine.pipeline import load_model_facts, run_facts, run_level_data
from zdiag.analyzers.engine.reduce import reduce_run
from zdiag.analyzers.engine.summary_map import RunContexts, assign_rank
from zdiag.analyzers.inputs.discovery import discover, manifest_ranks
from zdiag.analyzers.inputs.events import RankTrace
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.rank.rank_analysis import RankAnalysis, analyze_rank
from zdiag.analyzers.rank.steps import StepWindows
from zdiag.analyzers.rank.summary import RankSummary, summarize
from zdiag.analyzers.report import Report, StepBreakdown
from zdiag.analyzers.run.crossrank import CrossRankResult
from zdiag.analyzers.run.run_data import RunData
from zdiag.errors import InputError


@dataclass(frozen=True)
class Analysis:
    """The analysis of a RunData (every stage's result, none written into another's).

    - `ranks`: the map's result per trace, in the run's rank order
    - `summaries`: their `RankSummary`s, what the reduce read
    - `crossrank`: the collectives matched across ranks
    - `report`: the Report assembled from all of the above
    """

    ranks: list[RankAnalysis]
    summaries: list[RankSummary]
    crossrank: CrossRankResult
    report: Report

    @property
    def steps(self) -> dict[int, StepWindows]:
        """rank -> its step windows."""
        return {a.rank: a.windows for a in self.ranks}

    @property
    def breakdowns(self) -> dict[int, list[StepBreakdown]]:
        """rank -> its step table (the Report's `ranks[*].steps`)."""
        return {a.rank: list(a.breakdown) for a in self.ranks}


def load_run(paths: list[Path]) -> RunData:
    """Every trace under `paths` decoded (`RankTrace`), ranked as the pipeline ranks them, with
    what the run recorded beside them."""
    found = discover([Path(p) for p in paths])
    traces: list[RankTrace] = [load_rank_trace(f) for f in found.traces]
    warnings = list(found.warnings)
    manifest, run_dir = found.manifest, found.run_dir
    by_path = manifest_ranks(manifest, run_dir, warnings) if manifest and run_dir else {}
    for t in traces:
        world = manifest.world_size if manifest else None
        assign_rank(t, by_path.get(t.source.resolve()), world)
    traces.sort(key=lambda t: (t.rank, str(t.source)))
    run = run_level_data(found, [t.rank for t in traces], warnings)
    run.ranks = traces
    return run


def analyze_run(run: RunData, *, ranks: list[int] | None = None) -> Analysis:
    """The map on every rank, then the reduce on their summaries, keeping the per-rank values."""
    if ranks:
        missing = sorted(set(ranks) - {t.rank for t in run.ranks})
        if missing:
            raise InputError(f"rank(s) {missing} not found in the input")
        run.ranks = [t for t in run.ranks if t.rank in set(ranks)]
    model, model_warnings = load_model_facts(run.run_dir)
    contexts = RunContexts.of(run.manifest, model)
    analyses = [analyze_rank(t, contexts.for_rank(t.rank)) for t in run.ranks]
    summaries = [summarize(a) for a in analyses]
    reduction = reduce_run(summaries, run_facts(run, summaries, model, model_warnings))
    return Analysis(
        ranks=analyses,
        summaries=summaries,
        crossrank=reduction.crossrank,
        report=reduction.report,
    )
