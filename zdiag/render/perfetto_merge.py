"""One file for ui.perfetto.dev: the ranks' own Kineto traces with zdiag's overlay merged in.

`merged_trace(report, ranks)` reads each chosen rank's trace (`RankReport.source`, .json or
.json.gz) as it is, through the analysis' bounded input reader (`analyzers/inputs/raw_events.py`:
regular files only, within the size limits), moves its processes to their own ids (GPU
"processes" are device numbers, equal on every rank; flow ids repeat across ranks too) and names
them "rank N · <name>", then adds the overlay of `perfetto_overlay.py` (step verdicts, exposed-comm counter, findings) and
**finding markers on the events they are about**: for each finding, a track "finding: <id>" in
the rank's zdiag process with one slice over each event the finding concerns, in the steps it
names (`MARKED_KINDS`): the all-gathers of `missing-overlap` and the wrap findings, every
collective of the straggler rank, of `fp32-collectives`, `comm-bound`, ... Findings about memory
have no event to sit on and keep their step markers.

Nothing here analyses: events are matched by their names (collective annotations `nccl:<kind>`,
`gloo:<kind>`, NCCL kernels), in the time windows the Report gives.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zdiag.analyzers.detectors import RULES
from zdiag.analyzers.inputs.raw_events import read_raw_events
from zdiag.analyzers.report import Finding, Report
from zdiag.errors import InputError
from zdiag.render.perfetto_overlay import OVERLAY_PID_BASE, overlay_events
from zdiag.render.stats import RankView

MAX_MERGED_RANKS = 8
"""Ranks whose traces go into one merged file (rank 0 and the slowest): ui.perfetto.dev keeps
a JSON trace in browser memory. Every rank keeps its overlay tracks; `{rank}` in the file name
writes one file per rank instead."""
MAX_MARKERS_PER_FINDING = 400
"""Event markers per finding and rank (the first ones in time)."""
PID_STRIDE = 1000
"""A rank's processes get ids rank * PID_STRIDE + k (k: the order they appear in its trace)."""
FLOW_ID_STRIDE = 1 << 40
"""Flow event ids are moved by rank * FLOW_ID_STRIDE so arrows never join two ranks."""

MARKED_KINDS: dict[str, tuple[str, ...] | None] = {
    r.id: r.markers or None for r in RULES if r.markers is not None
}
"""Finding id -> the collective kinds its markers sit on (None: every collective), from the
rules' `markers` (analyzers/detectors/)."""

_ANNOTATION = re.compile(r"^(?:nccl|gloo|xccl|rccl):([a-z_]+)")
_KERNEL = re.compile(
    r"^(?:nccl|rccl)\w*?_(AllGather|ReduceScatter|AllReduce|Broadcast|SendRecv|Reduce)"
)
_KERNEL_KIND = {
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "AllReduce": "all_reduce",
    "Broadcast": "broadcast",
    "SendRecv": "send_recv",
    "Reduce": "reduce",
}


def collective_kind(name: str) -> str | None:
    """The collective kind an event name stands for ("all_gather", ...), or None."""
    if found := _ANNOTATION.match(name):
        return found.group(1)
    if found := _KERNEL.match(name):
        return _KERNEL_KIND[found.group(1)]
    return None


def _trace_events(source: str) -> list[dict[str, Any]] | None:
    """The events of the rank's trace file `source` (read within the input limits), or None
    when there is none or it cannot be read."""
    if not source:
        return None
    try:
        return read_raw_events(Path(source))
    except (InputError, OSError):
        return None


def _relabel(rank: int, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rank's events with their own process ids, process names and flow ids."""
    pids: dict[Any, int] = {}

    def pid_of(pid: Any) -> int:
        if pid not in pids:
            pids[pid] = rank * PID_STRIDE + len(pids) + 1
        return pids[pid]

    named: set[int] = set()
    out: list[dict[str, Any]] = []
    for ev in events:
        ev = dict(ev)
        original = ev.get("pid")
        ev["pid"] = pid_of(original)
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            label = (ev.get("args") or {}).get("name") or original
            ev["args"] = {"name": f"rank {rank} · {label}"}
            named.add(ev["pid"])
        elif ev.get("ph") == "M" and ev.get("name") == "process_sort_index":
            ev["args"] = {
                "sort_index": rank * PID_STRIDE
                + int((ev.get("args") or {}).get("sort_index", 0) or 0) % PID_STRIDE
            }
        if ev.get("ph") in ("s", "t", "f") and isinstance(ev.get("id"), int):
            ev["id"] = ev["id"] + rank * FLOW_ID_STRIDE
        out.append(ev)
    for original, pid in pids.items():
        if pid not in named:
            out.append(
                {
                    "ph": "M",
                    "pid": pid,
                    "tid": 0,
                    "name": "process_name",
                    "args": {"name": f"rank {rank} · {original}"},
                }
            )
    return out


def _windows(rank: RankView, finding: Finding) -> list[tuple[float, float]]:
    """The time windows (trace µs) of the steps `finding` names on `rank` (all steps if none)."""
    wanted = set(finding.steps)
    return [
        (
            rank.trace_start_us + s.start_ms * 1000.0,
            rank.trace_start_us + (s.start_ms + s.duration_ms) * 1000.0,
        )
        for s in rank.steps
        if not wanted or s.step in wanted
    ]


def event_markers(
    report: Report, rank: RankView, events: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Slices marking the events each finding is about on `rank` (see the module docstring)."""
    pid = OVERLAY_PID_BASE + rank.rank
    collectives = []
    for ev in events:
        if ev.get("ph") != "X" or not isinstance(ev.get("ts"), int | float):
            continue
        kind = collective_kind(str(ev.get("name", "")))
        if kind is not None:
            collectives.append((float(ev["ts"]), float(ev.get("dur", 0) or 0), kind, ev))
    collectives.sort(key=lambda c: c[0])
    out: list[dict[str, Any]] = []
    for index, f in enumerate(report.findings):
        if f.id not in MARKED_KINDS or (f.ranks and rank.rank not in f.ranks):
            continue
        kinds = MARKED_KINDS[f.id]
        windows = _windows(rank, f)
        tid = 100 + index
        marks = []
        end = float("-inf")
        for ts, dur, kind, ev in collectives:
            if kinds is not None and kind not in kinds:
                continue
            if not any(lo <= ts < hi for lo, hi in windows) or ts < end:
                continue  # outside the finding's steps, or overlapping the previous mark
            end = ts + dur
            marks.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": ts,
                    "dur": dur,
                    "name": f"{f.id}: {ev.get('name', '')}",
                    "cat": "zdiag.finding",
                    "args": {"finding": f.id, "title": f.title, "event": ev.get("name", "")},
                }
            )
            if len(marks) >= MAX_MARKERS_PER_FINDING:
                break
        if marks:
            out.append(
                {
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "name": "thread_name",
                    "args": {"name": f"finding: {f.id}"},
                }
            )
            out += marks
    return out


def merged_trace(report: Report, ranks: Sequence[RankView]) -> tuple[dict[str, Any], list[int]]:
    """The overlay of every rank plus the traces and event markers of `ranks`; returns the trace
    object and the ranks whose trace file could not be read (their overlay is there alone)."""
    overlay = overlay_events(report)
    events: list[dict[str, Any]] = list(overlay["traceEvents"])
    missing: list[int] = []
    merged: list[int] = []
    for rank in ranks:
        raw = _trace_events(rank.source)
        if raw is None:
            missing.append(rank.rank)
            continue
        events += _relabel(rank.rank, raw)
        events += event_markers(report, rank, raw)
        merged.append(rank.rank)
    other = dict(overlay["otherData"])
    other["producer"] = "zdiag merged trace"
    other["ranks_with_their_trace"] = merged
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}, missing
