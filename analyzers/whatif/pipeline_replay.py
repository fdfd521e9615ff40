"""The pipeline schedule replay of a run: every pipeline's timed steps (the map's
`PipelineStepTimes`, each rank's actions) re-timed by analyzers/whatif/pipeline_schedule.py as
measured, with more micro-batches, and with the split rebalanced; the figures are medians over
steps of the slowest pipeline's phase. `pipeline-bubble` takes its gains from it, `zdiag whatif
--pipeline-microbatches N` / `--pipeline-rebalance` print it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import median

import numpy as np

from ..inputs.pipeline_facts import PipelineFacts
from ..rank import intervals as iv
from ..rank.fsdp_ledger import RankLedger
from ..rank.pipeline_times import PipelineAction, PipelineStepTimes
from . import pipeline_schedule as ps


@dataclass(frozen=True)
class Move:
    """Blocks moved across the split: `count` of the source stage's `of` blocks to `target`."""

    source: int
    target: int
    count: int
    of: int

    @property
    def args(self) -> tuple[int, int, float]:
        """(source, target, share of the source's work) for `pipeline_schedule.moved`."""
        return self.source, self.target, self.count / self.of


@dataclass(frozen=True)
class Replayed:
    """The schedule replay of a run (ms: over steps, the median of the slowest pipeline's
    phase)."""

    steps: int
    measured_ms: float
    unchanged_ms: float
    more_mb_ms: float | None  # with `factor` times the micro-batches (None: see `more_mb_why`)
    balanced_ms: float | None
    more_mb_why: str = ""
    move: Move | None = None  # how the split was rebalanced (None: every stage at the mean)
    factor: int = 2

    @property
    def error(self) -> float:
        """The unchanged replay's relative error against the measured phase."""
        return abs(self.unchanged_ms - self.measured_ms) / self.measured_ms

    @property
    def gain_mb(self) -> float | None:
        """More micro-batches: the replayed phase saved (negative: lost)."""
        return None if self.more_mb_ms is None else self.unchanged_ms - self.more_mb_ms

    @property
    def gain_bal(self) -> float | None:
        """A balanced split: the replayed phase saved."""
        return None if self.balanced_ms is None else self.unchanged_ms - self.balanced_ms


def gather_time(ledgers: Mapping[int, RankLedger]) -> Callable[[int, PipelineAction], float]:
    """(rank, action) -> the rank's FSDP all-gather time inside the action (µs)."""
    sets = {}
    for rank, lg in ledgers.items():
        g = lg.gathers
        sets[rank] = iv.union(
            np.array([r.start_us for r in g], np.float64),
            np.array([r.end_us for r in g], np.float64),
        )

    def inside(rank: int, a: PipelineAction) -> float:
        got = sets.get(rank)
        return iv.total(iv.clip(got, a.start_us, a.end_us)) if got is not None else 0.0

    return inside


def replay_pipeline(
    pf: PipelineFacts,
    timings: Mapping[int, Sequence[PipelineStepTimes]],
    gathers: Callable[[int, PipelineAction], float] | None = None,
    hosts: Mapping[int, str | None] | None = None,
    move: Move | None = None,
    factor: int = 2,
) -> Replayed | str:
    """The schedule replay of every pipeline's timed steps, unchanged, with `factor` times the
    micro-batches and rebalanced (`move`, else every stage at the mean); a sentence saying why
    when it cannot run. `hosts`: each rank's host (ranks on one named host share a clock)."""
    known = hosts or {}

    def same_clock(ranks: Sequence[int]) -> bool:
        names = {known.get(r) for r in ranks}
        return len(names) == 1 and None not in names

    m = pf.n_microbatches or 0
    cls = pf.schedule.cls if pf.schedule is not None else "?"
    steps = ps.pipeline_steps(pf.groups, timings, gathers, same_clock)
    if not steps:
        return "no step's actions were timed on every rank of a pipeline"
    by_step: dict[int, list[ps.PipelineStep]] = {}
    for st in steps:
        by_step.setdefault(st.step, []).append(st)
    measured, unchanged, more, bal = [], [], [], []
    why = ""
    try:
        for group in by_step.values():
            measured.append(max(st.measured_phase_us for st in group))
            unchanged.append(max(ps.replayed_phase_us(st) for st in group))
            even = [ps.moved(st, *move.args) if move else ps.balanced(st) for st in group]
            bal.append(max(ps.replayed_phase_us(st) for st in even))
            if not why:
                try:
                    doubled = [ps.more_microbatches(st, cls, m, factor) for st in group]
                    more.append(max(ps.replayed_phase_us(st) for st in doubled))
                except ps.ScheduleError as exc:
                    why = str(exc)
    except ps.ScheduleError as exc:
        return str(exc)
    return Replayed(
        steps=len(by_step),
        measured_ms=median(measured) / 1e3,
        unchanged_ms=median(unchanged) / 1e3,
        more_mb_ms=None if why else median(more) / 1e3,
        balanced_ms=median(bal) / 1e3,
        more_mb_why=why,
        move=move,
        factor=factor,
    )
