"""What the live monitor keeps of one rank: compact, bounded step samples and its last record.

Shared by the state (`state`), the live findings (`findings`) and the rank detail. Each sample
carries the analyzers' step verdict (`zdiag.analyzers.rank.verdict.decide`), decided once when
its record is folded in rather than at every view.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from zdiag.analyzers.rank.verdict import decide

HISTORY_STEPS = 60  # step records kept per rank
WINDOW_STEPS = 10  # recent steps the statuses and findings look at

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
