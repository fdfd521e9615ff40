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
- `step_ms`: the step window; `actions`: the number of action ranges;
- `neighbour_wait_ms`: the time the training thread waits for its neighbours in the step: the
  recv waits, and the send waits between and after the actions (`gloo:send`: the schedules wait
  there until the neighbour has taken the tensor; inside an action a send runs beside the
  compute);
- `timeline`: each action in the order the rank ran it (`PipelineAction`: what it was, when, its
  recv waits inside and in the gap before it, its host cost per op), which the schedule replay
  re-times (analyzers/whatif/pipeline_schedule.py).

An action's host cost per op (`host_fixed_us`) is what does not shrink with a smaller
micro-batch: the time inside it that no op covers (Python between the ops, recv waits left
out) plus, for each op it runs, the dispatch cost of one op (the median time of the trace's ops
that move no data: views, transposes, detach, ...).

The multi-stage runtime schedules (`PP:` labels) post their receives and sends ahead, as
actions of their own (`PP:2RECV_F1`, `PP:0SEND_F0`), and gloo records each as a range from the
post to its completion, while the thread runs other actions. Such a receive is no wait until
its consumer (`PP:2F1`) starts: from then to its completion (within that action) the thread
waits on it. A send posted ahead is no wait at all (the schedule waits for its sends at the
step's end, in no action).

Schedule1F1B in torch 2.13 wraps its actions in no range: under `zdiag run` the collectors label
its stage's `forward_one_chunk` / `backward_one_chunk` with the same `Forward <i>` / `Backward
<i>` ranges (collectors/pipeline_capture.py); a trace recorded elsewhere gives no timings (the
detector then says the pipeline was captured but not timed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec
import numpy as np

from ..inputs.events import EventKind, RankTrace
from . import intervals as iv
from .steps import StepWindows

ACTION_RE = re.compile(r"^(?:(?:Forward|Backward) \d+|PP:.+)$")
"""The micro-batch action ranges of torch's pipeline schedules."""
LABEL_RE = re.compile(r"^(?:(Forward|Backward) (\d+)|PP:(\d+)(F|I|B|W)(\d+))$")
"""A compute action's label: `Forward 3` (the rank's own stage) or `PP:1B0` (stage 1, full
backward, micro-batch 0; `I` / `W`: backward for input / for weights). Other `PP:` actions
(sends, receives, unshard, reshard, grad reduce) are no micro-batch's compute."""
POST_RE = re.compile(r"^PP:(\d+)(RECV|SEND)_(F|B)(\d+)$")
"""A runtime schedule's action that posts a receive or a send ahead (`PP:2RECV_F1`: stage 2's
receive of micro-batch 1's forward input)."""
NO_DATA_OPS = frozenset(
    {
        "aten::view", "aten::_unsafe_view", "aten::t", "aten::transpose", "aten::permute",
        "aten::as_strided", "aten::detach", "aten::alias", "aten::expand", "aten::unsqueeze",
        "aten::squeeze", "aten::slice", "aten::select",
    }
)  # fmt: skip
"""Ops that only make a new view of their input: their time is the dispatch of one op."""
SEND_NAMES = frozenset({"gloo:send", "c10d::send", "nccl:send"})
"""The pipeline send on the training thread: between actions the thread blocks on it until the
neighbour has taken the tensor (the schedules wait for their sends there)."""
RECV_NAMES = frozenset({"gloo:recv", "c10d::recv_", "c10d::recv", "nccl:recv"})
"""The pipeline receive on the training thread (the wait for a neighbour's tensor)."""


class PipelineAction(msgspec.Struct, array_like=True):
    """One action range of a pipeline rank's step, in trace microseconds."""

    kind: str  # "F", "B", "I", "W" (compute on a micro-batch), else "" (a PP:<action> of no kind)
    stage: int  # the stage it ran (-1: the rank's own, for labels that name none)
    microbatch: int  # -1 for actions on no micro-batch
    start_us: float
    end_us: float
    recv_us: float  # pipeline recv waits inside the action
    recv_before_us: float  # pipeline recv waits between the previous action's end and its start
    host_fixed_us: float = 0.0  # host time that does not shrink with the micro-batch (docstring)


class PipelineStepTimes(msgspec.Struct, kw_only=True):
    """One step of one pipeline rank (module docstring)."""

    step: int
    step_ms: float
    window_ms: float
    busy_ms: float
    wait_ms: float
    actions: int
    start_us: float = 0.0  # the step's start on the host (trace microseconds)
    neighbour_wait_ms: float = 0.0  # recv waits, and send waits outside the actions
    timeline: list[PipelineAction] = msgspec.field(default_factory=list)


def parse_label(name: str) -> tuple[str, int, int]:
    """(kind, stage, micro-batch) of an action's label (module docstring); ("", -1, -1) for
    the actions of no micro-batch."""
    m = LABEL_RE.match(name)
    if m is None:
        return "", -1, -1
    if m.group(1):
        return ("F" if m.group(1) == "Forward" else "B"), -1, int(m.group(2))
    return m.group(4), int(m.group(3)), int(m.group(5))


@dataclass(frozen=True)
class _HostOps:
    """The training thread's ops, sorted by start, and the dispatch cost of one op (µs)."""

    starts: np.ndarray
    ends: np.ndarray
    dispatch_us: float

    @classmethod
    def of(cls, trace: RankTrace, lane: int) -> _HostOps:
        ops = np.flatnonzero((trace.kind == int(EventKind.CPU_OP)) & (trace.lane_id == lane))
        ops = ops[np.argsort(trace.ts_us[ops], kind="stable")]
        no_data = [i for i, n in enumerate(trace.names) if n in NO_DATA_OPS]
        views = ops[np.isin(trace.name_id[ops], np.asarray(no_data, np.int32))]
        durations = trace.end_us[views] - trace.ts_us[views]
        return cls(
            trace.ts_us[ops], trace.end_us[ops], float(np.median(durations)) if len(views) else 0.0
        )

    def fixed_us(self, start: float, end: float, waits: iv.IntervalSet) -> float:
        """The host time of [start, end) that no op covers (waits left out), plus one dispatch
        per op that starts in it."""
        i, j = np.searchsorted(self.starts, [start, end])
        covered = iv.join(iv.union(self.starts[i:j], np.minimum(self.ends[i:j], end)), waits)
        uncovered = (end - start) - iv.total(iv.clip(covered, start, end))
        return float(max(0.0, uncovered) + (j - i) * self.dispatch_us)


def _timeline(
    acts: _StepActions, waits: iv.IntervalSet, lo: float, ops: _HostOps
) -> list[PipelineAction]:
    """The step's actions in the order they ran, each with its recv waits (inside, before) and
    its host cost per op."""
    out = []
    prev = lo
    for start, end, (kind, stage, mb) in zip(acts.starts, acts.ends, acts.labels, strict=True):
        start, end = float(start), float(end)
        inside = iv.total(iv.clip(waits, start, end))
        before = iv.total(iv.clip(waits, prev, start)) if start > prev else 0.0
        fixed = ops.fixed_us(start, end, waits)
        out.append(PipelineAction(kind, stage, mb, start, end, inside, before, fixed))
        prev = max(prev, end)
    return out


@dataclass(frozen=True)
class _StepActions:
    """A step's actions sorted by start: their spans and labels, and which of them post a
    receive or a send ahead."""

    trace: RankTrace
    starts: np.ndarray
    ends: np.ndarray
    labels: list[tuple[str, int, int]]  # per action: parse_label's (kind, stage, micro-batch)
    posts: list[re.Match[str] | None]  # per action: its POST_RE match
    compute: dict[tuple[str, int, int], tuple[float, float]]  # (kind, stage, mb) -> its span

    @classmethod
    def of(cls, trace: RankTrace, acts: np.ndarray) -> _StepActions:
        order = acts[np.argsort(trace.ts_us[acts], kind="stable")]
        names = [trace.names[int(trace.name_id[i])] for i in order]
        starts, ends = trace.ts_us[order], trace.end_us[order]
        labels = [parse_label(name) for name in names]
        compute = {  # a backward for the input consumes the gradient as a full backward does
            ("F" if kind == "F" else "B", stage, mb): (float(a), float(b))
            for (kind, stage, mb), a, b in zip(labels, starts, ends, strict=True)
            if kind
        }
        return cls(trace, starts, ends, labels, [POST_RE.match(n) for n in names], compute)

    def _post(self, t: float) -> re.Match[str] | None:
        """The posting action that holds time `t`, if any."""
        k = int(np.searchsorted(self.starts, t, side="right")) - 1
        return self.posts[k] if k >= 0 and t <= self.ends[k] else None

    def ahead(self, times: np.ndarray) -> np.ndarray:
        """Which of these events (by start) a posting action issued ahead."""
        return np.asarray([self._post(float(t)) is not None for t in times], dtype=bool)

    def recv_waits(self, recvs: np.ndarray) -> iv.IntervalSet:
        """The thread's waits on these receives: a blocking one's range; one posted ahead,
        from its consumer's start to its completion (within the consumer), if it ends later."""
        lo: list[float] = []
        hi: list[float] = []
        for i in recvs:
            start, end = float(self.trace.ts_us[i]), float(self.trace.end_us[i])
            post = self._post(start)
            if post is None:
                lo.append(start)
                hi.append(end)
                continue
            consumer = self.compute.get((post.group(3), int(post.group(1)), int(post.group(4))))
            if consumer is not None and end > consumer[0]:
                lo.append(consumer[0])
                hi.append(min(end, consumer[1]))
        return iv.union(np.asarray(lo, np.float64), np.asarray(hi, np.float64))


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
    send_ids = [i for i, n in enumerate(trace.names) if n in SEND_NAMES]
    is_send = np.isin(trace.name_id, np.asarray(send_ids, np.int32))
    acts = np.flatnonzero(is_action)
    lane = np.bincount(trace.lane_id[acts]).argmax()  # the training thread
    acts = acts[trace.lane_id[acts] == lane]
    recvs = np.flatnonzero(is_recv & (trace.lane_id == lane))
    sends = np.flatnonzero(is_send & (trace.lane_id == lane))
    starts, ends = trace.ts_us, trace.end_us
    ops = _HostOps.of(trace, int(lane))
    out = []
    for k in range(len(windows)):
        lo, hi = float(windows.cpu_start_us[k]), float(windows.cpu_end_us[k])
        a = acts[(starts[acts] >= lo) & (starts[acts] < hi)]
        if not len(a):
            continue
        span = iv.union(starts[a], ends[a])
        r = recvs[(starts[recvs] >= lo) & (starts[recvs] < hi)]
        sent = sends[(starts[sends] >= lo) & (starts[sends] < hi)]
        actions = _StepActions.of(trace, a)
        sent = sent[~actions.ahead(starts[sent])]
        send_waits = iv.subtract(iv.union(starts[sent], np.minimum(ends[sent], hi)), span)
        all_waits = actions.recv_waits(r)
        neighbours = iv.join(all_waits, send_waits)
        waits = iv.intersect(all_waits, span)
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
                start_us=lo,
                neighbour_wait_ms=round(iv.total(iv.clip(neighbours, lo, hi)) / 1000.0, 4),
                timeline=_timeline(actions, all_waits, lo, ops),
            )
        )
    return out
