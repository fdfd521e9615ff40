"""The loaded run and its analysis.

`RunData` is everything loaded from disk around the traces (the run manifest, memory
timelines, snapshots, OOM records, flight-recorder dumps; `ranks` holds decoded `RankTrace`s
only where a test decodes them, tests/support/stages.py). Nothing the map or the reduce
computes with imports this module: it only holds inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...collectors.run_records import Manifest
from ..inputs.events import RankTrace
from .wait_graph import HangAnalysis


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
