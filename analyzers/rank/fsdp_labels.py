"""Which host ops issue FSDP and ZeRO collectives, and under which framework label.

The first step of the FSDP unit ledger (`fsdp_ledger.py`): the framework labels on each thread
(FSDP2 `FSDP::*` annotations, FSDP1 `FullyShardedDataParallel.*`, DeepSpeed Python ranges), the
threads that run DeepSpeed ZeRO-3's per-module autograd Functions, the outermost host ops that
issue a collective on those threads, the events that execute collectives, and the labels
enclosing each issue.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..frameworks import deepspeed, fsdp1, fsdp2
from ..inputs.events import EventKind, RankTrace
from . import intervals

# Framework labels and ZeRO-3's autograd Functions: analyzers/frameworks/ (one module each).
_FSDP2_RE = fsdp2.LABEL_RE
_FSDP1_RE = fsdp1.LABEL_RE
_DEEPSPEED_RE = deepspeed.LABEL_RE
_ZERO3_OP_RE = deepspeed.AUTOGRAD_FUNCTION_RE
# The autograd engine's per-node op: what runs inside one is backward work.
_BACKWARD_OP_PREFIX = "autograd::engine::evaluate_function: "
# Host ops that issue a collective (the outermost comm op on the training thread).
_ISSUE_RE = re.compile(r"^(c10d::|_c10d_functional::|c10d_functional::|record_param_comms$)")
# Host-only runs: the op that executes a collective on a backend worker thread.
_EXEC_RE = re.compile(r"^(gloo|nccl|mpi|ucc|rccl):")


@dataclass
class Label:
    """A framework label on one thread: its span, framework, phase and module."""

    start: float
    end: float
    framework: str
    phase: str  # FSDP2 phase ("all_gather", "post_backward_reduce", ...) or the FSDP1/DS name
    fqn: str | None  # FSDP2 module fqn ("" root), None when the label names no module


def _parse_label(name: str) -> tuple[str, str, str | None] | None:
    """(framework, phase, fqn) of a framework label, None for other names."""
    m = _FSDP2_RE.match(name)
    if m:
        fqn = m.group("fqn")
        target = m.group("target")
        return "fsdp2", m.group("phase"), fqn if fqn is not None else (target or "")
    if _FSDP1_RE.match(name):
        return "fsdp1", name.split(".", 1)[1], None
    if _DEEPSPEED_RE.search(name):
        return "deepspeed", name, None
    return None


def labels_by_lane(trace: RankTrace) -> dict[int, list[Label]]:
    """Framework labels (FSDP2/FSDP1 annotations, DeepSpeed Python ranges) per lane, by start."""
    cand = trace.of_kind(EventKind.FSDP_ANNOTATION, EventKind.USER_ANNOTATION)
    py = trace.of_kind(EventKind.PYTHON_FUNCTION)
    out: dict[int, list[Label]] = defaultdict(list)
    parsed: dict[int, tuple[str, str, str | None] | None] = {}
    for idx in (cand, py):
        for i in idx:
            nid = int(trace.name_id[i])
            if nid not in parsed:
                name = trace.names[nid]
                p = _parse_label(name)
                if p is not None and p[0] == "fsdp2" and idx is py:
                    p = None
                if p is not None and p[0] == "deepspeed" and idx is not py:
                    p = p if "deepspeed" in name.lower() or "fetch" in name else None
                parsed[nid] = p
            p = parsed[nid]
            if p is None:
                continue
            s = float(trace.ts_us[i])
            out[int(trace.lane_id[i])].append(Label(s, s + float(trace.dur_us[i]), *p))
    for labels in out.values():
        labels.sort(key=lambda lab: (lab.start, -(lab.end - lab.start)))
    return out


def _enclosing_labels(labels: list[Label], times: list[float]) -> list[list[Label]]:
    """For each time (ascending), the labels enclosing it, outermost first.

    One sweep with a stack: record_function ranges on one thread nest properly, so a label
    that ended before t has every label above it on the stack ended too.
    """
    out: list[list[Label]] = []
    stack: list[Label] = []
    k = 0
    for t in times:
        while k < len(labels) and labels[k].start <= t:
            while stack and stack[-1].end < labels[k].start:
                stack.pop()
            stack.append(labels[k])
            k += 1
        while stack and stack[-1].end < t:
            stack.pop()
        out.append([lab for lab in stack if lab.end >= t])
    return out


def zero3_lanes(trace: RankTrace) -> set[int]:
    """Threads that run DeepSpeed ZeRO-3's per-module autograd Functions (their cpu_ops)."""
    ids = np.array([j for j, n in enumerate(trace.names) if _ZERO3_OP_RE.match(n)], dtype=np.int32)
    if not ids.size:
        return set()
    ops = trace.of_kind(EventKind.CPU_OP)
    hit = ops[np.isin(trace.name_id[ops], ids)]
    return {int(x) for x in np.unique(trace.lane_id[hit])}


def backward_spans(trace: RankTrace, lanes: set[int]) -> dict[int, intervals.IntervalSet]:
    """Per lane, where the autograd engine ran a node (`autograd::engine::evaluate_function:`
    ops, union): a collective issued inside one was issued by backward work (a module's
    backward pre-hook refetching its parameters, a gradient hook, recomputation)."""
    ids = np.array(
        [j for j, n in enumerate(trace.names) if n.startswith(_BACKWARD_OP_PREFIX)],
        dtype=np.int32,
    )
    ops = trace.of_kind(EventKind.CPU_OP)
    ops = ops[np.isin(trace.name_id[ops], ids)] if ids.size else ops[:0]
    end_us = trace.end_us
    out = {}
    for lane in lanes:
        on = ops[trace.lane_id[ops] == lane]
        out[lane] = intervals.union(trace.ts_us[on], end_us[on])
    return out


def issue_ops(trace: RankTrace, labels: dict[int, list[Label]], zero3: set[int]) -> list[int]:
    """The outermost collective-issuing host ops on labelled (or ZeRO-3) threads, time-ordered."""
    end_us = trace.end_us  # a computed column: take it once
    issues: list[int] = []
    open_end: dict[int, float] = {}
    for i in trace.of_kind(EventKind.COMM_OP):
        name = trace.name(int(i))
        lane = int(trace.lane_id[i])
        if not _ISSUE_RE.match(name) or (lane not in labels and lane not in zero3):
            continue
        if float(trace.ts_us[i]) < open_end.get(lane, -np.inf):
            continue  # nested inside an issuing op
        open_end[lane] = float(end_us[i])
        issues.append(int(i))
    return issues


def executions(trace: RankTrace, issues: list[int]) -> list[int]:
    """The events that execute collectives: device comm kernels, else backend ops (`gloo:*`,
    ...) on threads other than the issuing ones."""
    if trace.has_device_events:
        return [int(i) for i in trace.of_kind(EventKind.COMM_KERNEL)]
    issue_lanes = {int(trace.lane_id[i]) for i in issues}
    return [
        int(i)
        for i in trace.of_kind(EventKind.COMM_OP)
        if _EXEC_RE.match(trace.name(int(i))) and int(trace.lane_id[i]) not in issue_lanes
    ]


def enclosing_by_issue(
    trace: RankTrace, issues: list[int], labels: dict[int, list[Label]]
) -> dict[int, list[Label]]:
    """For each issue, the framework labels enclosing it on its thread, outermost first."""
    enclosing_of: dict[int, list[Label]] = {}
    by_lane: dict[int, list[int]] = defaultdict(list)
    for i in issues:  # time-ordered
        by_lane[int(trace.lane_id[i])].append(i)
    for lane, idx in by_lane.items():
        times = [float(trace.ts_us[i]) for i in idx]
        for i, enc in zip(idx, _enclosing_labels(labels.get(lane, []), times), strict=True):
            enclosing_of[i] = enc
    return enclosing_of
