"""Per step, how a pipeline stage's rank spends its pipeline phase: working on micro-batches or
waiting for its neighbours (`torch.distributed.pipelining`).

torch's schedules wrap each micro-batch action in a `record_function` range on the training
thread: `Forward <i>` / `Backward <i>` (ScheduleGPipe, the forward-only schedule) or
`PP:<action>` (`PP:0F3`, `PP:1B0`: the multi-stage runtime schedules). Inside an action the
stage first waits for its input (the activation from the previous stage, or the gradient from
the next), computes, then posts its send. The wait is the pipeline recv on the same thread:
`gloo:recv` (gloo: the blocking receive) and `c10d::recv_` (the receive call, which on a busy
host can hold the wait itself); on NCCL, `nccl:recv` (only the host side of it: a device trace
shows the stage's device idle instead, which these ranges do not measure).

Per step (the rank's step windows), over the actions in it:

- `window_ms`: from the first action's start to the last action's end (the pipeline phase);
- `busy_ms`: the union of the actions minus the recv waits inside them (the stage's work on
  its micro-batches, its FSDP/DP collectives inside them included);
- `wait_ms` = `window_ms - busy_ms`: recv waits, send waits and gaps between actions
  (the bubble);
- `step_ms`: the step window; `actions`: the number of action ranges.

Schedule1F1B in torch 2.13 wraps its actions in no range: under `zdiag run` the collectors label
its stage's `forward_one_chunk` / `backward_one_chunk` with the same `Forward <i>` / `Backward
<i>` ranges (collectors/pipeline_capture.py); a trace recorded elsewhere gives no timings (the
detector then says the pipeline was captured but not timed).
"""

from __future__ import annotations

import re

import msgspec
import numpy as np

from ..inputs.events import EventKind, RankTrace
from . import intervals as iv
from .steps import StepWindows

ACTION_RE = re.compile(r"^(?:(?:Forward|Backward) \d+|PP:.+)$")
"""The micro-batch action ranges of torch's pipeline schedules."""
RECV_NAMES = frozenset({"gloo:recv", "c10d::recv_", "c10d::recv", "nccl:recv"})
"""The pipeline receive on the training thread (the wait for a neighbour's tensor)."""


class PipelineStepTimes(msgspec.Struct, kw_only=True):
    """One step of one pipeline rank (module docstring)."""

    step: int
    step_ms: float
    window_ms: float
    busy_ms: float
    wait_ms: float
    actions: int


def pipeline_times(trace: RankTrace, windows: StepWindows) -> list[PipelineStepTimes]:
    """The rank's pipeline timings per step; [] when its trace holds no pipeline action."""
    action_ids = [i for i, n in enumerate(trace.names) if ACTION_RE.match(n)]
    if not action_ids or not len(windows):
        return []
    kinds = np.asarray([int(EventKind.USER_ANNOTATION), int(EventKind.CPU_OP)], np.uint8)
    is_action = np.isin(trace.name_id, np.asarray(action_ids, np.int32)) & np.isin(
        trace.kind, kinds
    )
    recv_ids = [i for i, n in enumerate(trace.names) if n in RECV_NAMES]
    is_recv = np.isin(trace.name_id, np.asarray(recv_ids, np.int32))
    acts = np.flatnonzero(is_action)
    lane = np.bincount(trace.lane_id[acts]).argmax()  # the training thread
    acts = acts[trace.lane_id[acts] == lane]
    recvs = np.flatnonzero(is_recv & (trace.lane_id == lane))
    starts, ends = trace.ts_us, trace.end_us
    out = []
    for k in range(len(windows)):
        lo, hi = float(windows.cpu_start_us[k]), float(windows.cpu_end_us[k])
        a = acts[(starts[acts] >= lo) & (starts[acts] < hi)]
        if not len(a):
            continue
        span = iv.union(starts[a], ends[a])
        r = recvs[(starts[recvs] >= lo) & (starts[recvs] < hi)]
        waits = iv.intersect(iv.union(starts[r], ends[r]), span)
        window = float(ends[a].max() - starts[a].min())
        busy = iv.total(span) - iv.total(waits)
        out.append(
            PipelineStepTimes(
                step=int(windows.step[k]),
                step_ms=round((hi - lo) / 1000.0, 4),
                window_ms=round(window / 1000.0, 4),
                busy_ms=round(busy / 1000.0, 4),
                wait_ms=round(max(0.0, window - busy) / 1000.0, 4),
                actions=len(a),
            )
        )
    return out
