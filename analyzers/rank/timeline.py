"""One representative step per rank as spans (Report.timelines), for the HTML/TUI timelines.

The chosen step is the rank's median-duration step (ties: the earlier one), so the picture shows
a typical step rather than a warm-up outlier. Lanes:

- `compute`: compute kernels (GPU runs), or the host compute blocks (host-only runs);
- `comm:<kind>`: communication kernels / gloo ops, by collective kind (`comm:all_gather`);
- `memcpy`: memcpy and memset;
- `fsdp`: FSDP::... / ZeRO ranges on the host (what the framework was doing).

At most MAX_TIMELINE_SPANS spans are kept (the longest ones, then re-sorted by start);
`truncated` says when some were dropped. Times are ms from the step's start. Runs with more than
MAX_TIMELINE_RANKS ranks get timelines for rank 0 and the slowest ranks only (JSON size).
"""

from __future__ import annotations

import numpy as np

from ..inputs.events import EventKind, RankTrace
from ..report import StepBreakdown, StepTimeline, TimelineSpan
from . import intervals as iv
from .breakdown import ActivitySets
from .collective_table import collectives_of
from .steps import StepWindows

MAX_TIMELINE_SPANS = 3000
"""Spans kept per timeline (the longest ones)."""

MAX_TIMELINE_RANKS = 16
"""Ranks with a timeline in big runs: rank 0 and the ranks with the slowest median step."""

MAX_NAME_CHARS = 160
"""Kernel names are cut to this length (C++ template names run to kilobytes)."""


def representative_step(steps: list[StepBreakdown]) -> int | None:
    """Index of the median-duration step (None when there are no steps)."""
    if not steps:
        return None
    order = sorted(range(len(steps)), key=lambda k: (steps[k].duration_ms, k))
    return order[(len(order) - 1) // 2]


def select_timelines(
    timelines: list[StepTimeline], steps_by_rank: dict[int, list[StepBreakdown]]
) -> list[StepTimeline]:
    """At most MAX_TIMELINE_RANKS timelines: rank 0 first, then the slowest ranks (by the
    duration of the step each timeline shows), in rank order."""
    if len(timelines) <= MAX_TIMELINE_RANKS:
        return timelines

    def shown_ms(tl: StepTimeline) -> float:
        return next(
            (s.duration_ms for s in steps_by_rank.get(tl.rank, []) if s.step == tl.step), 0.0
        )

    first = [tl for tl in timelines if tl.rank == 0][:1]
    rest = sorted((tl for tl in timelines if tl not in first), key=lambda tl: -shown_ms(tl))
    chosen = first + rest[: MAX_TIMELINE_RANKS - len(first)]
    return sorted(chosen, key=lambda tl: tl.rank)


def _name(text: str) -> str:
    return text if len(text) <= MAX_NAME_CHARS else text[: MAX_NAME_CHARS - 1] + "…"


def step_timeline(
    trace: RankTrace,
    windows: StepWindows,
    steps: list[StepBreakdown],
    sets: ActivitySets | None = None,
) -> StepTimeline | None:
    """The spans of the rank's representative step, or None when it has no steps."""
    k = representative_step(steps)
    if k is None:
        return None
    start, end = float(windows.start_us[k]), float(windows.end_us[k])
    sets = sets or ActivitySets(trace)
    lanes: list[str] = []
    names: list[str] = []
    starts: list[float] = []
    durs: list[float] = []

    def add(lane: str, name: str, s: float, d: float) -> None:
        s, d = float(s), float(d)
        s0, e0 = max(s, start), min(s + d, end)
        if e0 > s0:
            lanes.append(lane)
            names.append(name)
            starts.append((s0 - start) / 1000.0)
            durs.append((e0 - s0) / 1000.0)

    ts, dur = trace.ts_us, trace.dur_us
    in_window = (ts < end) & (ts + dur > start)
    coll = collectives_of(trace)
    comm_kind = dict(zip(coll.event.tolist(), coll.kind.tolist(), strict=True))
    if sets.host_only:
        blocks = iv.clip(sets.compute, start, end)
        for s, e in zip(blocks[0].tolist(), blocks[1].tolist(), strict=True):
            add("compute", "host compute", s, e - s)
        for i in coll.event.tolist():
            if in_window[i]:
                add(f"comm:{coll.kinds[comm_kind[i]]}", _name(trace.name(i)), ts[i], dur[i])
    else:
        for kind_value, lane in (
            (EventKind.COMPUTE_KERNEL, "compute"),
            (EventKind.MEMCPY, "memcpy"),
            (EventKind.MEMSET, "memcpy"),
        ):
            for i in np.flatnonzero(in_window & (trace.kind == int(kind_value))).tolist():
                add(lane, _name(trace.name(i)), ts[i], dur[i])
        for i in np.flatnonzero(in_window & (trace.kind == int(EventKind.COMM_KERNEL))).tolist():
            kind = coll.kinds[comm_kind[i]] if i in comm_kind else "unknown"
            add(f"comm:{kind}", _name(trace.name(i)), ts[i], dur[i])
    for i in np.flatnonzero(in_window & (trace.kind == int(EventKind.FSDP_ANNOTATION))).tolist():
        add("fsdp", _name(trace.name(i)), ts[i], dur[i])

    truncated = len(starts) > MAX_TIMELINE_SPANS
    chosen = np.arange(len(starts))
    if truncated:
        chosen = np.argsort(-np.asarray(durs), kind="stable")[:MAX_TIMELINE_SPANS]
    order = sorted(chosen.tolist(), key=lambda j: starts[j])
    spans = [
        TimelineSpan(lanes[j], names[j], round(starts[j], 6), round(durs[j], 6)) for j in order
    ]
    return StepTimeline(rank=trace.rank, step=steps[k].step, spans=spans, truncated=truncated)
