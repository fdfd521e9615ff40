"""The replayed step as a Perfetto / chrome://tracing overlay (`zdiag whatif --perfetto FILE`).

Two processes for the representative step of one rank: "what-if · rank N · as measured" (the
unchanged replay, which is the measured step) and "what-if · rank N · <change>". Each has a
"training lane" thread, whose slices are the waits on collectives, and one thread per comm lane
(process group | kind) with its collectives. Timestamps are the original trace's (the step's
start plus the replayed offsets), so the overlay lines up with the rank's Kineto trace.
"""

from __future__ import annotations

from typing import Any

from zdiag.analyzers.rank.step_model import StepModel
from zdiag.analyzers.whatif.replay import Replay
from zdiag.analyzers.whatif.run_whatif import WhatIfResult
from zdiag.render.whatif_text import lane_label

PID_BASE = 2_000_000_000
LANE_TID = 1


def _process(pid: int, name: str, model: StepModel, rep: Replay) -> list[dict[str, Any]]:
    t0 = model.start_us
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}},
        {
            "ph": "M",
            "name": "thread_name",
            "pid": pid,
            "tid": LANE_TID,
            "args": {"name": "training lane (waits)"},
        },
        {
            "ph": "X",
            "name": f"step {model.step}",
            "pid": pid,
            "tid": LANE_TID,
            "ts": t0,
            "dur": rep.duration_us,
            "args": {"waited_us": round(rep.waited_us, 1)},
        },
    ]
    tids: dict[str, int] = {}
    for op, timing in zip(model.ops, rep.ops, strict=True):
        tid = tids.setdefault(op.lane, LANE_TID + 1 + len(tids))
        label = f"{op.kind} {op.unit}".strip()
        events.append(
            {
                "ph": "X",
                "name": label,
                "pid": pid,
                "tid": tid,
                "ts": t0 + timing.start_us,
                "dur": max(timing.end_us - timing.start_us, 0.0),
                "args": {"issued_at_us": round(timing.issued_us, 1), "bytes": op.bytes},
            }
        )
        if timing.waited_us > 0:
            events.append(
                {
                    "ph": "X",
                    "name": f"wait {label}",
                    "pid": pid,
                    "tid": LANE_TID,
                    "ts": t0 + timing.end_us - timing.waited_us,
                    "dur": timing.waited_us,
                }
            )
    for lane, tid in tids.items():
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": pid,
                "tid": tid,
                "args": {"name": lane_label(lane)},
            }
        )
    return events


def whatif_trace(result: WhatIfResult) -> dict[str, Any]:
    """The overlay as a Chrome trace-event object (empty when no step was replayed)."""
    tl = result.timeline
    if tl is None:
        return {"traceEvents": []}
    events = _process(
        PID_BASE + 2 * tl.rank, f"what-if · rank {tl.rank} · as measured", tl.model, tl.measured
    )
    events += _process(
        PID_BASE + 2 * tl.rank + 1,
        f"what-if · rank {tl.rank} · {result.change.label()}",
        tl.changed_model,
        tl.changed,
    )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"zdiag": "what-if replay", "change": result.change.label()},
    }
