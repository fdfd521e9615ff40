"""A step's kernels and ops, added up by name: what the terminal browser's ops table shows for
the step it highlights (from the Report's `StepTimeline`: the view adds, the analysis measured).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from zdiag.analyzers.report import StepTimeline


@dataclass(frozen=True)
class OpTotal:
    """The spans of one name on one lane of a step timeline, added up."""

    lane: str
    name: str
    count: int
    total_ms: float
    max_ms: float


def aggregate_ops(timeline: StepTimeline) -> list[OpTotal]:
    """A step's timeline spans grouped by lane and name, the largest total time first."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for span in timeline.spans:
        groups[(span.lane, span.name)].append(span.dur_ms)
    totals = [
        OpTotal(lane, name, len(durs), sum(durs), max(durs))
        for (lane, name), durs in groups.items()
    ]
    return sorted(totals, key=lambda o: (-o.total_ms, o.lane, o.name))
