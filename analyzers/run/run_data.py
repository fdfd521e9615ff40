"""The loaded run and its analysis.

`RunData` is everything loaded from disk (one `RankTrace` per rank, the run manifest, memory
timelines). `Analysis` is what `pipeline.analyze_run` returns: the per-rank map's results
(`RankAnalysis`, rank_analysis.py), their summaries (summary.py), and the reduce's results (the
cross-rank matching and the finished `Report`, reduce.py). Nothing the map or the reduce
computes with imports this module: it only holds their results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...collectors.run_records import Manifest
from ..inputs.events import RankTrace
from ..rank.rank_analysis import RankAnalysis
from ..rank.steps import StepWindows
from ..rank.summary import RankSummary
from ..report import Report, StepBreakdown
from .crossrank import CrossRankResult
from .flight_recorder import HangAnalysis


@dataclass
class RunData:
    """Everything loaded for one `zdiag analyze` call.

    - `ranks`: one RankTrace per input trace, sorted by rank.
    - `manifest`: RUN_DIR/manifest.json (typed, `zdiag.collectors.run_records.Manifest`), when the
      input was a run directory.
    - `run_dir`: that directory, else None.
    - `memory_timelines`: rank -> path of RUN_DIR/memory/rank-N.timeline.json.gz, if present.
    - `snapshots`: rank -> path of its CUDA memory snapshot (given, or RUN_DIR/memory/).
    - `step_logs`: rank -> path of RUN_DIR/steps/rank-N.jsonl, if present.
    - `warnings`: run-level warnings (per-rank ones are on each RankTrace).
    - `flight_recorder` / `flight_recorder_inputs`: flight-recorder dumps given with the traces:
      their analysis and paths.
    """

    ranks: list[RankTrace]
    manifest: Manifest | None = None
    run_dir: Path | None = None
    inputs: list[Path] = field(default_factory=list)
    memory_timelines: dict[int, Path] = field(default_factory=dict)
    snapshots: dict[int, Path] = field(default_factory=dict)
    step_logs: dict[int, Path] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    flight_recorder: HangAnalysis | None = None
    flight_recorder_inputs: list[str] = field(default_factory=list)

    def rank(self, rank: int) -> RankTrace:
        """The trace of one rank (KeyError when absent)."""
        for t in self.ranks:
            if t.rank == rank:
                return t
        raise KeyError(rank)


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
