"""The step model: one rank's step as the what-if replay reads it (the map's side).

A step is a walk along the rank's *progress*: the time its compute lanes spend on anything but
waiting for a collective. `build_step_models` cuts each step window at its *waits*, the exposed
communication intervals (comm not covered by compute, `breakdown.py`) that end when a collective
ends (the lane stood still until that collective finished), or that end at most WAKE_MATCH_US
after a collective ended inside them (a CPU thread blocked on a gloo call resumes once woken,
while another call may still run: the wait ends at the collective's end). What remains is work: compute,
memcpy, host gaps and exposed intervals that end for another reason (compute resumed while a
collective still ran), kept as measured. Positions (`*_pos_us`) are microseconds of progress from
the step's start: `P(t) = |[start, t] - waits|`.

Each collective of the step becomes a `ModelOp`: where it was issued (a progress position), the
comm lane it runs on (its process group and kind; the previous op it queued behind there, when it
started at or after that op's end), the latency between being able to start and starting (what
the lane, the peers or the launch added, measured), its duration, and the position at which the
lane waits for it (its exposed wait, or, for an FSDP all-gather that was hidden, the position at
which its consumer ran: a wait that does not bind as measured but binds once the gather moves
later). FSDP collectives carry their unit, pass and message bytes from the ledger.

Host syncs (`.item()`, stream synchronizes) are kept as progress chunks (`syncs`): the op's own
time on the host and, on a device trace, the device idle that follows it until the next kernel,
each marked the model's own (inside an FSDP unit or a wrapper's forward) or not (the optimizer's,
the training loop's). So are the optimizer steps (`optimizer`: the progress inside the `Optimizer.step#...` ranges the
profiler records), whose work grows with the shard a rank holds (a mesh-shape what-if scales them).

The replay (`analyzers/whatif/replay.py`) walks these positions; with nothing changed it gives
back the measured step (to rounding), which `bench/whatif_replay.py` checks on every trace.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from ..inputs.events import RankTrace
from . import intervals as iv
from .breakdown import ActivitySets
from .collective_columns import RankCollectives
from .fsdp_labels import Label
from .fsdp_ledger import CollectiveRecord
from .host_syncs import in_model_mask, sync_events
from .steps import StepWindows

END_MATCH_US = 1.0
"""An exposed interval is a wait on a collective when it ends within this of the collective's end."""

WAKE_MATCH_US = 1000.0
"""Or when the collective ended inside it at most this long before the lane resumed: a thread
blocked on a gloo call wakes some tens to hundreds of microseconds after the call completes
(measured: 100 µs on a 2-core host under DDP); the wake-up stays the lane's own time."""

MAX_OPS_PER_STEP = 20_000
"""Ops kept per step (a step with more keeps its first ones and is marked `truncated`)."""

MAX_MODEL_STEPS = 64
"""Steps modelled per rank (the first ones): the replay reports medians over them."""

MAX_UNIT_CHUNKS = 5_000
"""FSDP machinery chunks kept per step."""


class ModelOp(msgspec.Struct, kw_only=True, array_like=True):
    """One collective of a step, as the replay re-times it (times in µs, relative to the step)."""

    kind: str  # "all_gather", "reduce_scatter", "all_reduce", "send", ...
    lane: str  # comm lane: "<process group>|<kind>"
    issue_pos_us: float  # progress position at which it was issued
    after: int  # the op it queued behind on its lane (-1: none; the replay queues it behind its
    # lane's latest op)
    delay_us: float  # measured start - max(issue, lane free): launch, peers, queueing
    dur_us: float  # measured execution time
    wait_pos_us: float | None = None  # progress position the lane waits for its end
    waited_us: float = 0.0  # measured wait (the exposed interval it ended)
    bytes: int = -1  # message bytes, -1 unknown
    unit: str = ""  # FSDP unit fqn, "" when not an FSDP collective
    family: str = ""  # FSDP ledger family: "all_gather" / "reduce", "" otherwise
    phase: str = ""  # "forward" / "backward" / ""
    start_us: float = 0.0  # measured execution start, relative to the step start
    start_pos_us: float = -1.0  # progress position at the measured start (-1: as issue_pos_us)
    prefetched: bool = False  # issued under an FSDP prefetch label (the ledger's)
    # progress position at which its consumer's pre-forward / pre-backward began (gathers whose
    # ledger names the consumer; None: unknown): a gather issued there or later, inside its own
    # unit's hooks, was not issued ahead however much hook work lies before its wait
    needed_pos_us: float | None = None


class StepModel(msgspec.Struct, kw_only=True):
    """One step of one rank: its progress, its ops and its host-sync chunks."""

    step: int
    start_us: float  # absolute step start (trace clock)
    duration_us: float  # measured
    work_us: float  # progress: duration less the waits
    ops: list[ModelOp] = msgspec.field(default_factory=list)
    # (pos, length, the model's own: inside an FSDP unit or a wrapper's forward, not the
    # optimizer's or the training loop's)
    syncs: list[tuple[float, float, bool]] = msgspec.field(default_factory=list)
    # CPU traces: progress inside each FSDP2 unit's own ranges (hooks, copy-in/out): (pos, length,
    # unit), what a coarser wrap changes besides the collectives
    unit_chunks: list[tuple[float, float, str]] = msgspec.field(default_factory=list)
    truncated: bool = False
    # progress inside the optimizer-step ranges: (pos, length); empty when the trace has none
    optimizer: list[tuple[float, float]] = msgspec.field(default_factory=list)


def _waited_on(
    begin: float, end: float, starts: npt.NDArray[np.float64], ends: npt.NDArray[np.float64]
) -> npt.NDArray[np.int64]:
    """The collectives an exposed interval [begin, end] waited on: those ending at its end
    (within END_MATCH_US), else the last to end inside it no more than WAKE_MATCH_US before its
    end (the lane blocked on it and resumed once woken: CPU/gloo)."""
    cand = np.flatnonzero((np.abs(ends - end) <= END_MATCH_US) & (starts < end))
    if len(cand):
        return cand
    inside = np.flatnonzero((ends >= begin) & (ends <= end) & (ends >= end - WAKE_MATCH_US))
    if not len(inside):
        return inside
    return inside[ends[inside] >= float(ends[inside].max()) - END_MATCH_US]


def _progress(waits: iv.IntervalSet) -> tuple[npt.NDArray[np.float64], ...]:
    """Arrays for P(t): wait starts, ends, and the waited time before each wait."""
    ws, we = waits
    before = np.concatenate([[0.0], np.cumsum(we - ws)])[:-1] if len(ws) else np.zeros(0)
    return ws, we, before


def _pos(t: float, start: float, ws: npt.NDArray[np.float64], we: npt.NDArray[np.float64],
         before: npt.NDArray[np.float64]) -> float:  # fmt: skip
    """Progress position of time t: t - start less the waited time up to t."""
    k = int(np.searchsorted(ws, t, side="right")) - 1
    if k < 0:
        return max(0.0, t - start)
    waited = float(before[k] + min(t, float(we[k])) - ws[k])
    return max(0.0, t - start - waited)


def _match_ledger(
    records: Sequence[CollectiveRecord],
    starts: npt.NDArray[np.float64],
    ends: npt.NDArray[np.float64],
    kinds: Sequence[str],
) -> dict[int, CollectiveRecord]:
    """The ledger record of each of a step's collectives (by position in `starts`): same
    execution times first; the rest in order per kind when both sides have as many (a trace
    whose ledger times the FSDP op and whose collective table times the worker's op)."""
    by_time = {(round(r.start_us, 3), round(r.end_us, 3)): r for r in records}
    out: dict[int, CollectiveRecord] = {}
    for j, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        rec = by_time.pop((round(a, 3), round(b, 3)), None)
        if rec is not None:
            out[j] = rec
    left: dict[str, list[CollectiveRecord]] = defaultdict(list)
    for r in sorted(by_time.values(), key=lambda r: r.start_us):
        left[r.kind].append(r)
    for kind, recs in left.items():
        ops = [j for j in range(len(starts)) if j not in out and kinds[j] == kind]
        if len(ops) == len(recs):
            out.update(zip(ops, recs, strict=True))
    return out


def _sync_chunks(
    trace: RankTrace, sets: ActivitySets, windows: StepWindows
) -> dict[int, list[tuple[float, float, bool]]]:
    """Per step index: (time, length, the model's own) of each host sync's cost (host op;
    device idle after it)."""
    idx = sync_events(trace)
    out: dict[int, list[tuple[float, float, bool]]] = defaultdict(list)
    if not len(idx) or not len(windows):
        return out
    ts = np.asarray(trace.ts_us, dtype=np.float64)[idx]
    ends = ts + np.asarray(trace.dur_us, dtype=np.float64)[idx]
    at = windows.index_of(ts)
    mine = in_model_mask(trace, idx)
    busy_s, busy_e = sets.busy
    for t0, t1, k, own in zip(ts.tolist(), ends.tolist(), at.tolist(), mine, strict=True):
        if k < 0:
            continue
        if sets.host_only:
            out[k].append((t0, t1 - t0, own))
            continue
        # the device idles from the sync's end until its next activity starts
        j = int(np.searchsorted(busy_s, t1, side="left"))
        inside = j > 0 and busy_e[j - 1] > t1
        if not inside and j < len(busy_s):
            out[k].append((t1, min(float(busy_s[j]), float(windows.end_us[k])) - t1, own))
    return out


OPTIMIZER_STEP_RE = r"^Optimizer\.step#"
"""The profiler's range around each optimizer step (`Optimizer.step#AdamW.step`)."""


def _optimizer_spans(trace: RankTrace) -> iv.IntervalSet:
    """The union of the trace's optimizer-step ranges (nested or repeated ones count once)."""
    idx = trace.matching(OPTIMIZER_STEP_RE)
    ts = np.asarray(trace.ts_us, dtype=np.float64)[idx]
    return iv.union(ts, ts + np.asarray(trace.dur_us, dtype=np.float64)[idx])


def _unit_spans(labels_by_lane: Mapping[int, list[Label]]) -> dict[str, iv.IntervalSet]:
    """Per FSDP2 unit, the union of its labelled ranges (`FSDP::pre_forward (<fqn>)`, ...)."""
    spans: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for labels in labels_by_lane.values():
        for lb in labels:
            if lb.framework == "fsdp2" and lb.fqn is not None:
                spans[lb.fqn][0].append(lb.start)
                spans[lb.fqn][1].append(lb.end)
    return {u: iv.union(np.array(a), np.array(b)) for u, (a, b) in spans.items()}


def build_step_models(
    trace: RankTrace,
    windows: StepWindows,
    sets: ActivitySets,
    collectives: RankCollectives,
    records: Sequence[CollectiveRecord],
    labels: Mapping[int, list[Label]],
) -> list[StepModel]:
    """The step models of one rank's first MAX_MODEL_STEPS steps (see the module docstring);
    `labels` are the trace's framework labels (`fsdp_labels.labels_by_lane`)."""
    by_step: dict[int, list[CollectiveRecord]] = defaultdict(list)
    for r in records:
        by_step[r.step].append(r)
    syncs = _sync_chunks(trace, sets, windows)
    unit_spans = _unit_spans(labels) if sets.host_only else {}
    optimizer_spans = _optimizer_spans(trace)
    out: list[StepModel] = []
    for k in range(min(len(windows), MAX_MODEL_STEPS)):
        step = int(windows.step[k])
        s, e = float(windows.start_us[k]), float(windows.end_us[k])
        sel = np.flatnonzero(collectives.step == step)
        truncated = len(sel) > MAX_OPS_PER_STEP
        sel = sel[:MAX_OPS_PER_STEP]
        starts = collectives.start_us[sel]
        ends = collectives.end_us[sel]
        kinds = [collectives.kind[c] for c in sel.tolist()]
        ledger = _match_ledger(by_step.get(step, []), starts, ends, kinds)
        exp_s, exp_e = iv.clip(sets.exposed, s, e)
        # each exposed interval that ends where a collective ends is a wait on that collective
        wait_of: dict[int, tuple[float, float]] = {}
        for a, b in zip(exp_s.tolist(), exp_e.tolist(), strict=True):
            cand = _waited_on(a, b, starts, ends)
            if len(cand):
                j = int(cand[np.argmax(starts[cand])])
                b = min(b, float(ends[j]))  # a wake-up after the end is the lane's own time
                prev = wait_of.get(j)
                wait_of[j] = (a, b) if prev is None else (min(prev[0], a), b)
        waits = iv.union(
            np.array([w[0] for w in wait_of.values()]), np.array([w[1] for w in wait_of.values()])
        )
        ws, we, before = _progress(waits)
        work = (e - s) - iv.total(waits)
        ops: list[ModelOp] = []
        lane_last: dict[str, int] = {}
        for j, c in enumerate(sel.tolist()):
            st, en = float(starts[j]), float(ends[j])
            kind = collectives.kind[c]
            lane = f"{collectives.process_group[c]}|{kind}"
            rec = ledger.get(j)
            issued = min(rec.issued_us, st) if rec is not None else st
            issue_pos = _pos(issued, s, ws, we, before)
            # the measured time at that position, before any wait there (T(P(issued)))
            issue_t = _time_at(issue_pos, s, ws, we, before)
            last = lane_last.get(lane, -1)
            queued = last >= 0 and st >= s + ops[last].start_us + ops[last].dur_us - END_MATCH_US
            after = last if queued else -1
            free = s + ops[after].start_us + ops[after].dur_us if after >= 0 else issue_t
            delay = max(0.0, st - max(issue_t, free))
            wait = wait_of.get(j)
            wait_pos: float | None = None
            if wait is not None:
                wait_pos = _pos(wait[0], s, ws, we, before)
            elif rec is not None and rec.family == "all_gather" and rec.needed_us is not None:
                wait_pos = _pos(max(rec.needed_us, en), s, ws, we, before)
            ops.append(
                ModelOp(
                    kind=kind,
                    lane=lane,
                    issue_pos_us=round(issue_pos, 3),
                    after=after,
                    delay_us=round(delay, 3),
                    dur_us=round(en - st, 3),
                    wait_pos_us=None if wait_pos is None else round(max(wait_pos, issue_pos), 3),
                    waited_us=round(wait[1] - wait[0], 3) if wait is not None else 0.0,
                    bytes=rec.bytes if rec is not None else -1,
                    unit=rec.unit if rec is not None else "",
                    family=rec.family if rec is not None else "",
                    phase=rec.phase if rec is not None else "",
                    start_us=round(st - s, 3),
                    start_pos_us=round(_pos(st, s, ws, we, before), 3),
                    prefetched=rec.prefetched if rec is not None else False,
                    needed_pos_us=(
                        round(_pos(rec.needed_us, s, ws, we, before), 3)
                        if rec is not None and rec.needed_us is not None
                        else None
                    ),
                )
            )
            lane_last[lane] = j
        chunks = [
            (round(_pos(t, s, ws, we, before), 3), round(length, 3), own)
            for t, length, own in syncs.get(k, [])
            if length > 0
        ]
        unit_chunks: list[tuple[float, float, str]] = []
        for unit, span in unit_spans.items():
            a_s, a_e = iv.subtract(iv.clip(span, s, e), waits)
            for a, b in zip(a_s.tolist(), a_e.tolist(), strict=True):
                unit_chunks.append((round(_pos(a, s, ws, we, before), 3), round(b - a, 3), unit))
        unit_chunks.sort()
        o_s, o_e = iv.subtract(iv.clip(optimizer_spans, s, e), waits)
        optimizer = [
            (round(_pos(a, s, ws, we, before), 3), round(b - a, 3))
            for a, b in zip(o_s.tolist(), o_e.tolist(), strict=True)
            if b > a
        ]
        out.append(
            StepModel(
                step=step,
                start_us=s,
                duration_us=round(e - s, 3),
                work_us=round(work, 3),
                ops=ops,
                syncs=chunks,
                unit_chunks=unit_chunks[:MAX_UNIT_CHUNKS],
                truncated=truncated or len(unit_chunks) > MAX_UNIT_CHUNKS,
                optimizer=optimizer[:MAX_UNIT_CHUNKS],
            )
        )
    return out


def fill_missing_op_bytes(models: Sequence[StepModel], unit_param_bytes: Mapping[str, int]) -> None:
    """FSDP ops whose size the trace did not record take their unit's unsharded parameter
    bytes, as the ledger's records do (`fsdp_ledger.fill_missing_bytes`); for a summary computed
    before those sizes were known (inside the job). Changes the models in place."""
    for m in models:
        for op in m.ops:
            if op.family and op.bytes <= 0 and unit_param_bytes.get(op.unit, 0) > 0:
                op.bytes = unit_param_bytes[op.unit]


def _time_at(pos: float, start: float, ws: npt.NDArray[np.float64], we: npt.NDArray[np.float64],
             before: npt.NDArray[np.float64]) -> float:  # fmt: skip
    """The measured time at progress position `pos`, before any wait that starts there."""
    if not len(ws):
        return start + pos
    wpos = ws - start - before  # position of each wait
    k = int(np.searchsorted(wpos, pos, side="right")) - 1  # waits at positions <= pos
    # waits strictly before pos have been waited; one exactly at pos has not
    waited = 0.0
    if k >= 0:
        waited = float(before[k] + (we[k] - ws[k]))
        if wpos[k] >= pos:
            waited = float(before[k])
    return float(start + pos + waited)


def with_unit_paths(models: Sequence[StepModel], paths: Mapping[str, str]) -> list[StepModel]:
    """`models` with each FSDP unit renamed to its module path (`paths`: {name in the trace:
    module path}, from the captured model: FSDP1 names its units by position,
    `fsdp1-unit-<k>`); the models themselves when no unit needs a new name. A coarser wrap or
    checkpointing picks units by module path, so it needs the paths."""
    rename = {name: path for name, path in paths.items() if name != path}
    if not any(op.unit in rename for m in models for op in m.ops):
        return list(models)
    return [
        msgspec.structs.replace(
            m,
            ops=[
                msgspec.structs.replace(op, unit=rename[op.unit]) if op.unit in rename else op
                for op in m.ops
            ],
            unit_chunks=[(p, length, rename.get(u, u)) for p, length, u in m.unit_chunks],
        )
        for m in models
    ]
