"""What the live monitor keeps of one rank: compact, bounded step samples and its last record.

Shared by the state (`state`), the live findings (`findings`) and the rank detail. Each sample
carries the analyzers' step verdict (`zdiag.analyzers.rank.verdict.decide`), decided once when
its record is folded in rather than at every view.

The history view (step time over steps, per rank and for the job) reads a longer and much
smaller record: each rank's last `TIMELINE_STEPS` step times (`StepTimes`, 12 bytes a step), put
side by side by step number on demand (`job_history`).
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from zdiag.analyzers.rank.verdict import decide

HISTORY_STEPS = 60  # step records kept per rank
WINDOW_STEPS = 10  # recent steps the statuses and findings look at
TIMELINE_STEPS = 600
"""Step times kept per rank for the history view (`StepTimes`: 12 bytes a step, 7 KiB a rank)."""
_MAX_STEP_MS = 3.0e38  # float32's range (a custom source's absurd figure is clipped, not inf)
_INT64 = (-(2**63), 2**63 - 1)

LAST_FIELDS = (
    "step",
    "step_time_ms",
    "exposed_comm_ms",
    "mem_allocated_bytes",
    "mem_peak_bytes",
    "mem_reserved_bytes",
    "dropped",
    "hung_in",
    "ended",
    "last_collective",
    "mem_source",
    "comm_by_dim",
    "capture_id",
    "capture_state",
    "capture_path",
)
"""What the monitor keeps of each rank's last record (the table's and the detail's figures)."""
NUMBER_LAST_FIELDS = LAST_FIELDS[1:6]
"""The `LAST_FIELDS` that are numbers (checked finite when a record is folded in)."""


class StepSample(NamedTuple):
    """The figures of one step the model keeps (compact: the full record is not retained)."""

    step: int
    ts: float
    step_time_ms: float | None
    compute_ms: float | None
    comm_ms: float | None
    exposed_comm_ms: float | None
    mem_allocated_bytes: float | None
    verdict: str | None  # the analyzers' step verdict; None without the whole split

    @classmethod
    def of(cls, rec: dict[str, Any]) -> StepSample:
        """The sample of a decoded record."""
        step_ms, compute, comm, exposed, mem = (rec.get(k) for k in cls._fields[2:7])
        return cls(
            int(rec["step"]),
            float(rec["ts"]),
            step_ms,
            compute,
            comm,
            exposed,
            mem,
            step_verdict(step_ms, compute, comm, exposed),
        )

    def numbers(self) -> tuple[float | None, ...]:
        """The sample's figures (its timestamp and measurements; not the verdict)."""
        return self[1:7]


def step_verdict(
    step_ms: float | None, compute_ms: float | None, comm_ms: float | None, exposed_ms: float | None
) -> str | None:
    """The analyzers' verdict (`verdict.decide`) of a step with the whole split, else None.

    The live split is the host's: compute is the step minus its waits, so the idle the verdict
    weighs is what the step holds beyond compute and exposed communication (0 when the
    collectors measured the split; a custom publisher's figures may leave some)."""
    figures = (step_ms, compute_ms, comm_ms, exposed_ms)
    if any(v is None or not math.isfinite(v) for v in figures):
        return None
    step, compute, comm, exposed = (float(v) for v in figures)  # type: ignore[arg-type]
    return decide(step, compute, comm, exposed, max(0.0, step - compute - exposed))[0]


_SAMPLE_INDEX = {name: i for i, name in enumerate(StepSample._fields)}


class StepTimes:
    """One rank's last `TIMELINE_STEPS` (step, step time) pairs: a ring of two typed arrays
    (int64 steps, float32 milliseconds), so a long history costs 12 bytes a step."""

    __slots__ = ("_ms", "_next", "_steps")

    def __init__(self) -> None:
        """An empty ring."""
        self._steps = array("q")
        self._ms = array("f")
        self._next = 0  # where the next pair goes once the ring is full

    def __len__(self) -> int:
        """Pairs kept."""
        return len(self._steps)

    def append(self, step: int, step_ms: float) -> None:
        """Keep one step's time (the oldest pair goes once `TIMELINE_STEPS` are kept); a step
        number outside int64 is ignored."""
        if not _INT64[0] <= step <= _INT64[1]:
            return
        ms = min(float(step_ms), _MAX_STEP_MS)
        if len(self._steps) < TIMELINE_STEPS:
            self._steps.append(step)
            self._ms.append(ms)
            return
        self._next %= len(self._steps)
        self._steps[self._next] = step
        self._ms[self._next] = ms
        self._next += 1

    def items(self) -> list[tuple[int, float]]:
        """The pairs kept, oldest first."""
        order = itertools.chain(range(self._next, len(self)), range(self._next))
        return [(self._steps[i], float(self._ms[i])) for i in order]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The steps and step times kept (copies, in ring order: not sorted)."""
        return np.array(self._steps, dtype=np.int64), np.array(self._ms, dtype=np.float64)

    def clear(self) -> None:
        """Forget every pair (the rank restarted)."""
        self._steps = array("q")
        self._ms = array("f")
        self._next = 0


@dataclass
class RankState:
    """What the monitor knows about one rank of one job (bounded histories)."""

    rank: int
    host: str = "?"
    job: str = ""
    pid: int | None = None
    last: dict[str, Any] = field(default_factory=dict)  # the `LAST_FIELDS` of the last record
    first_seen: float = 0.0
    last_recv: float = 0.0
    restarts: int = 0
    steps: deque[StepSample] = field(default_factory=lambda: deque(maxlen=HISTORY_STEPS))
    times: StepTimes = field(default_factory=StepTimes)  # the longer step-time history

    def recent(self, key: str, n: int = WINDOW_STEPS) -> list[float]:
        """The non-missing values of `key` (a `StepSample` field) in the last `n` samples, oldest
        first. Walks the history from its newest end (the view calls this for every rank)."""
        i = _SAMPLE_INDEX[key]
        return [float(v) for s in self.tail(n) if (v := s[i]) is not None]

    def verdicts(self, n: int = WINDOW_STEPS) -> list[str]:
        """The step verdicts of the last `n` samples that have one, oldest first."""
        return [v for s in self.tail(n) if (v := s.verdict) is not None]

    def tail(self, n: int = WINDOW_STEPS) -> list[StepSample]:
        """The last `n` samples, oldest first."""
        newest_first = list(itertools.islice(reversed(self.steps), n))
        newest_first.reverse()
        return newest_first


@dataclass(frozen=True)
class JobHistory:
    """Step time over steps of one job's ranks, side by side by step number: the consecutive
    step numbers `steps` and, for each of them, the median over the ranks that reported it, the
    slowest rank and its time, and every rank's time (None: no time for that step)."""

    job: str
    steps: tuple[int, ...]
    median_ms: tuple[float | None, ...]
    slowest_ms: tuple[float | None, ...]
    slowest_rank: tuple[int | None, ...]
    ranks: dict[int, tuple[float | None, ...]]  # by rank, in rank order

    def to_json(self) -> dict[str, Any]:
        """The history as plain JSON-able data (rank keys as strings, as JSON has them)."""
        return {
            "job": self.job,
            "steps": list(self.steps),
            "median_ms": list(self.median_ms),
            "slowest_ms": list(self.slowest_ms),
            "slowest_rank": list(self.slowest_rank),
            "ranks": {str(r): list(v) for r, v in self.ranks.items()},
        }


def job_history(ranks: Iterable[RankState], job: str, steps: int = TIMELINE_STEPS) -> JobHistory:
    """The last `steps` step numbers up to the latest one any rank reported (fewer when the
    ranks kept fewer), each rank's time at each of them, and the job's median and slowest rank
    per step. Costs one ranks x steps array (numpy), computed only when asked."""
    kept = [(s.rank, *s.times.arrays()) for s in sorted(ranks, key=lambda s: s.rank)]
    present = [st for _, st, _ in kept if len(st)]
    if not present or steps < 1:
        return JobHistory(job, (), (), (), (), {r: () for r, _, _ in kept})
    last = max(int(st.max()) for st in present)
    floor = last - steps + 1
    first = min(int(st[st >= floor].min()) for st in present if (st >= floor).any())
    n = last - first + 1
    grid = np.full((len(kept), n), np.nan)
    for row, (_, st, ms) in enumerate(kept):
        inside = (st >= first) & (st <= last)
        grid[row, st[inside] - first] = ms[inside]
    seen = ~np.isnan(grid)
    any_seen = seen.any(axis=0)
    median = np.full(n, np.nan)
    if any_seen.any():
        median[any_seen] = np.nanmedian(grid[:, any_seen], axis=0)
    filled = np.where(seen, grid, -np.inf)
    top_row = filled.argmax(axis=0)
    top = filled.max(axis=0)
    rank_ids = [r for r, _, _ in kept]
    return JobHistory(
        job=job,
        steps=tuple(range(first, last + 1)),
        median_ms=tuple(float(v) if ok else None for v, ok in zip(median, any_seen, strict=True)),
        slowest_ms=tuple(float(v) if ok else None for v, ok in zip(top, any_seen, strict=True)),
        slowest_rank=tuple(
            rank_ids[i] if ok else None for i, ok in zip(top_row, any_seen, strict=True)
        ),
        ranks={  # NaN (no time) as None; `v != v` only for NaN
            rank: tuple(None if v != v else v for v in grid[i].tolist())
            for i, rank in enumerate(rank_ids)
        },
    )
