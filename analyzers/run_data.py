"""The loaded run and its core analysis: what detectors, the FSDP ledger and cross-rank code read.

`RunData` is everything loaded from disk (one `RankTrace` per rank, the run manifest, memory
timelines). `Analysis` is the per-rank step segmentation and breakdown computed from it, plus the
`Report` being assembled. Both are plain containers; the functions that fill them live in
`pipeline.py`, `steps.py` and `breakdown.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from zdiag.analyzers.events import RankTrace
from zdiag.analyzers.report import Report, StepBreakdown
from zdiag.collectors.rundir import Manifest

if TYPE_CHECKING:
    from zdiag.analyzers.crossrank import CrossRankResult


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
    - `step_logs`: rank -> path of RUN_DIR/steps/rank-N.jsonl, if present.
    - `warnings`: run-level warnings (per-rank ones are on each RankTrace).
    """

    ranks: list[RankTrace]
    manifest: Manifest | None = None
    run_dir: Path | None = None
    inputs: list[Path] = field(default_factory=list)
    memory_timelines: dict[int, Path] = field(default_factory=dict)
    step_logs: dict[int, Path] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def rank(self, rank: int) -> RankTrace:
        """The trace of one rank (KeyError when absent)."""
        for t in self.ranks:
            if t.rank == rank:
                return t
        raise KeyError(rank)


@dataclass
class Analysis:
    """The core analysis of a RunData; `report` is the Report being assembled.

    - `steps`: rank -> StepWindows
    - `breakdowns`: rank -> list of StepBreakdown (the same objects as in report.ranks[*].steps)
    - `report`: ranks, steps and thresholds are filled before detectors/ledger/cross-rank run;
      they append findings, fsdp_units, collectives, stragglers to it.
    - `crossrank`: the collectives matched across ranks, kept by the cross-rank stage so the
      straggler detector does not match them a second time (None before that stage).
    """

    steps: dict[int, StepWindows]
    breakdowns: dict[int, list[StepBreakdown]]
    report: Report
    crossrank: CrossRankResult | None = None
