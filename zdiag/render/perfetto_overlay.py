"""The Perfetto overlay: step verdicts and findings as tracks (the renderer, perfetto.py, merges it
into the ranks' traces).

A compact Chrome trace-event JSON file (it opens in ui.perfetto.dev and chrome://tracing). Per rank
there is one process, "zdiag · rank N", with:

- a "step verdicts" thread: one complete event ("ph": "X") per step, named `step N: <verdict>`
  (Perfetto colors slices by name without digits, so one color per verdict; chrome://tracing uses
  `cname`), its breakdown in `args` (up to MAX_DETAILED_STEPS slices in all);
- a counter ("ph": "C") "exposed comm (ms)", one sample per step;
- a "findings" thread: an instant marker ("ph": "i") per finding at the steps it concerns
  (at most MAX_MARKERS_PER_FINDING per rank), with evidence and recommendation in `args`.
  Findings that name no rank are global markers.

Timestamps are the original trace's: `trace_start_us` of the rank + StepBreakdown.start_ms * 1000`,
so the overlay lines up with the rank's Kineto trace when both are loaded together (see
docs/reports.md). Process ids are OVERLAY_PID_BASE + rank so they never collide with real pids.
"""

from __future__ import annotations

import math
from typing import Any

from zdiag.analyzers.report import Finding, Report, StepBreakdown
from zdiag.render.columns import step_values
from zdiag.render.format import fmt_ints, unit_label
from zdiag.render.stats import RankView

OVERLAY_PID_BASE = 1_000_000_000  # above any real pid (Linux pid_max <= 2**22)
STEP_TID = 1
FINDING_TID = 2
MAX_MARKERS_PER_FINDING = 16  # per rank
# Beyond this many rank x step slices, slices carry only their step number (the name keeps the
# verdict, the counter the exposed comm) so the file stays small; otherData says so.
MAX_DETAILED_STEPS = 50_000
# chrome://tracing reserved color names (Perfetto ignores cname and colors by name).
VERDICT_CNAME = {
    "compute-bound": "good",
    "exposed-comm": "bad",
    "comm-bound": "terrible",
    "host-bound": "grey",
}
SEVERITY_CNAME = {"info": "generic_work", "warning": "bad", "critical": "terrible"}


def _us(value: float) -> float:
    """A number rounded to 3 decimals (µs: to the ns); non-finite values (bad input) become 0."""
    return round(value, 3) if math.isfinite(value) else 0.0


def _metadata(pid: int, rank: RankView) -> list[dict[str, Any]]:
    label = f"zdiag · rank {rank.rank}" + (f" ({rank.host})" if rank.host else "")
    return [
        {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": label}},
        {
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "name": "process_sort_index",
            "args": {"sort_index": -1000 + rank.rank},
        },
        {
            "ph": "M",
            "pid": pid,
            "tid": STEP_TID,
            "name": "thread_name",
            "args": {"name": "step verdicts"},
        },
        {
            "ph": "M",
            "pid": pid,
            "tid": FINDING_TID,
            "name": "thread_name",
            "args": {"name": "findings"},
        },
        {
            "ph": "M",
            "pid": pid,
            "tid": STEP_TID,
            "name": "thread_sort_index",
            "args": {"sort_index": 0},
        },
        {
            "ph": "M",
            "pid": pid,
            "tid": FINDING_TID,
            "name": "thread_sort_index",
            "args": {"sort_index": 1},
        },
    ]


def _step_events(pid: int, rank: RankView, detailed: bool) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    end_us = None
    ordered = sorted(rank.steps, key=lambda s: s.start_ms)
    for i, s in enumerate(ordered):
        ts = _us(rank.trace_start_us + s.start_ms * 1000.0)
        dur = max(s.duration_ms, 0.0) * 1000.0
        if i + 1 < len(ordered):  # slices on one track must not overlap (rounding, bad input)
            next_ts = _us(rank.trace_start_us + ordered[i + 1].start_ms * 1000.0)
            dur = max(min(dur, next_ts - ts), 0.0)
        events.append(
            {
                "ph": "X",
                "pid": pid,
                "tid": STEP_TID,
                "ts": ts,
                "dur": _us(dur),
                "name": f"step {s.step}: {s.verdict}",
                "cat": "zdiag.step",
                "cname": VERDICT_CNAME.get(s.verdict, "generic_work"),
                **({"args": _step_args(s)} if detailed else {}),
            }
        )
        events.append(
            {
                "ph": "C",
                "pid": pid,
                "ts": ts,
                "name": "exposed comm (ms)",
                "args": {"ms": _us(s.exposed_comm_ms)},
            }
        )
        end_us = _us(ts + dur)
    if end_us is not None:  # close the counters after the last step
        events.append(
            {"ph": "C", "pid": pid, "ts": end_us, "name": "exposed comm (ms)", "args": {"ms": 0}}
        )
    return events


def _step_args(s: StepBreakdown) -> dict[str, Any]:
    """The step's breakdown, shown when a slice is selected: every step column, and the reason."""
    return {**step_values(s), "verdict_reason": s.verdict_reason}


def _finding_args(f: Finding) -> dict[str, Any]:
    args: dict[str, Any] = {
        "id": f.id,
        "severity": f.severity,
        "title": f.title,
        "ranks": fmt_ints(f.ranks, 40) if f.ranks else "all",
        "steps": fmt_ints(f.steps, 40) if f.steps else "all",
        "units": [unit_label(u) for u in f.units[:40]],
        "evidence": f.evidence,
        "recommendation": f.recommendation,
    }
    if f.code:
        args["code"] = f.code
    if f.expected_gain_ms is not None:
        args["expected_gain_ms"] = f.expected_gain_ms
    if f.expected_gain_bytes is not None:
        args["expected_gain_bytes"] = f.expected_gain_bytes
    if f.gain_method:
        args["gain_method"] = f.gain_method
    return args


def _finding_events(report: Report) -> list[dict[str, Any]]:
    by_rank = {r.rank: r for r in report.ranks}
    starts = [r.trace_start_us + s.start_ms * 1000.0 for r in report.ranks for s in r.steps]
    run_start = _us(min(starts)) if starts else 0.0
    events: list[dict[str, Any]] = []
    for f in report.findings:
        name = f"{f.severity}: {f.id}"
        base = {
            "ph": "i",
            "name": name,
            "cat": "zdiag.finding",
            "cname": SEVERITY_CNAME.get(f.severity, "generic_work"),
        }
        args = _finding_args(f)
        short = {"id": f.id, "title": f.title, "details": "on this finding's first marker"}
        targets = [by_rank[r] for r in f.ranks if r in by_rank]
        if not targets:
            events.append(
                {**base, "s": "g", "pid": OVERLAY_PID_BASE, "tid": 0, "ts": run_start, "args": args}
            )
            continue
        wanted = set(f.steps)
        for rank in targets:
            steps = [s for s in rank.steps if not wanted or s.step in wanted]
            times = [
                rank.trace_start_us + s.start_ms * 1000.0 for s in steps[:MAX_MARKERS_PER_FINDING]
            ]
            for k, ts in enumerate(times or [rank.trace_start_us]):
                events.append(
                    {
                        **base,
                        "s": "t",
                        "pid": OVERLAY_PID_BASE + rank.rank,
                        "tid": FINDING_TID,
                        "ts": _us(ts),
                        # the full evidence once per rank; later markers point back to it
                        "args": args if k == 0 else short,
                    }
                )
    return events


def overlay_events(report: Report) -> dict[str, Any]:
    """The overlay as a Chrome trace-event JSON object (`traceEvents` plus `otherData`)."""
    events: list[dict[str, Any]] = []
    detailed = sum(len(r.steps) for r in report.ranks) <= MAX_DETAILED_STEPS
    for rank in sorted(report.ranks, key=lambda r: r.rank):
        pid = OVERLAY_PID_BASE + rank.rank
        events += _metadata(pid, rank)
        events += _step_events(pid, rank, detailed)
    events += _finding_events(report)
    aligned = bool(report.ranks) and all(r.trace_start_us for r in report.ranks)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "zdiag overlay",
            "zdiag_version": report.zdiag_version,
            "report_schema": report.schema,
            "aligned_to_trace_timestamps": aligned,
            "step_args": "full breakdown"
            if detailed
            else "none (large run: the slice name has step and verdict)",
            "inputs": report.inputs[:64],
        },
    }
