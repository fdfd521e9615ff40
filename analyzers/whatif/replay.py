"""The replay engine: walk a step model's progress and re-time its collectives.

The compute lane advances one microsecond of progress per microsecond of time, except at a wait,
where it stands until the awaited collective ends. A collective starts when it is issued (the
time the lane reached its issue position), or, when it queued behind an earlier op on its comm
lane, when the lane is free; then its measured latency (`delay_us`) and its duration follow.
At one position, issues come before waits, so a blocking collective (issued and awaited at the
same position) runs on the lane's time. With nothing changed this gives back the measured step.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rank.step_model import StepModel

_ISSUE, _WAIT = 0, 1


@dataclass(frozen=True)
class ReplayedOp:
    """One op's replayed times (µs from the step start)."""

    index: int
    issued_us: float
    start_us: float
    end_us: float
    waited_us: float  # how long the lane stood waiting for it


@dataclass(frozen=True)
class Replay:
    """A replayed step: its duration, the time the lane waited, and each op's times."""

    step: int
    duration_us: float
    waited_us: float
    ops: tuple[ReplayedOp, ...]


def replay(model: StepModel) -> Replay:
    """The replayed step of `model` (see the module docstring)."""
    events: list[tuple[float, int, int]] = []
    for j, op in enumerate(model.ops):
        events.append((min(op.issue_pos_us, model.work_us), _ISSUE, j))
        if op.wait_pos_us is not None:
            events.append((min(op.wait_pos_us, model.work_us), _WAIT, j))
    events.sort()
    n = len(model.ops)
    issued = [0.0] * n
    start = [0.0] * n
    end = [0.0] * n
    waited = [0.0] * n
    lane_free: dict[str, float] = {}
    t = pos = waited_total = 0.0
    for p, what, j in events:
        t += p - pos
        pos = p
        op = model.ops[j]
        if what == _ISSUE:
            begin = t
            if op.after >= 0:
                begin = max(begin, lane_free.get(op.lane, 0.0))
            issued[j] = t
            start[j] = begin + op.delay_us
            end[j] = start[j] + op.dur_us
            lane_free[op.lane] = max(lane_free.get(op.lane, 0.0), end[j])
        elif end[j] > t:
            waited[j] = end[j] - t
            waited_total += waited[j]
            t = end[j]
    t += max(0.0, model.work_us - pos)
    return Replay(
        step=model.step,
        duration_us=t,
        waited_us=waited_total,
        ops=tuple(ReplayedOp(j, issued[j], start[j], end[j], waited[j]) for j in range(n)),
    )
