"""The loaded run and its analysis.

`RunData` is everything loaded from disk (one `RankTrace` per rank, the run manifest, memory
timelines). `Analysis` is what `pipeline.analyze_run` returns: the per-rank map's results
(`RankAnalysis`, rank_analysis.py), their summaries (summary.py), and the reduce's results (the
cross-rank matching and the finished `Report`, reduce.py). `StepWindows` is one rank's step
segmentation (steps.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..collectors.rundir import Manifest
from .events import RankTrace
from .flight_recorder import HangAnalysis

if TYPE_CHECKING:
    from .crossrank import CrossRankResult
    from .rank_analysis import RankAnalysis
    from .report import Report, StepBreakdown
    from .summary import RankSummary


@dataclass
class StepWindows:
    """One rank's steps: step number and [start_us, end_us) on the trace clock.

    `source` says how the steps were found: "ProfilerStep", "optimizer step",
    "step log", or "whole trace" (no step markers: one window with a warning).
    `cpu_start_us`/`cpu_end_us` are the host-side marker spans; `start_us`/`end_us` are the
    windows used for the device breakdown (see steps.py for how GPU lag is handled).
    """

    step: npt.NDArray[np.int64]
    start_us: npt.NDArray[np.float64]
    end_us: npt.NDArray[np.float64]
    cpu_start_us: npt.NDArray[np.float64]
    cpu_end_us: npt.NDArray[np.float64]
    source: str

    def __len__(self) -> int:
        return len(self.step)

    def index_of(self, ts_us: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
        """For each time, the index of the window holding it, or -1 when none does."""
        pos = np.searchsorted(self.start_us, ts_us, side="right") - 1
        ok = (pos >= 0) & (ts_us < self.end_us[np.clip(pos, 0, None)])
        return np.where(ok, pos, -1)


@dataclass
class RunData:
    """Everything loaded for one `zdiag analyze` call.

    - `ranks`: one RankTrace per input trace, sorted by rank.
    - `manifest`: RUN_DIR/manifest.json (typed, `zdiag.collectors.rundir.Manifest`), when the
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
