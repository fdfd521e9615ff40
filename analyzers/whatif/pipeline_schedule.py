"""The pipeline schedule replay: one step of each pipeline re-timed across its ranks, from the
micro-batch actions each rank ran (analyzers/rank/pipeline_times.py), as measured or changed.

**What is kept from the trace.** Each rank's actions in the order it ran them, each with its
work (the action's time minus the pipeline recv waits inside it) and the host time before it
(the gap since the previous action, recv waits left out). Of the work, what does not shrink
with the micro-batch is marked as fixed: the FSDP all-gathers inside the action (every
micro-batch gathers its stage's parameters again, whatever its size) and its host cost per op
(the Python between its ops and one dispatch per op; analyzers/rank/pipeline_times.py).

**What the replay derives.** Every wait for a neighbour. A forward on micro-batch `i` of stage
`s` starts once stage `s - 1`'s forward on `i` has ended; a backward (full, or for the input)
once stage `s + 1`'s backward on `i` has. When the two stages are on different ranks, the
receiving rank's receive cost is added: a receive whose data was already sent still costs host
time, which on a busy host is milliseconds. That cost is measured per receiving rank: the median
over its receives of the time from the later of the wait's start and the sender's end to the
wait's end (the receive sits at an action's start, or just before it). Ranks on one host share
a clock; across hosts each neighbour's clock offset is estimated from the receives themselves
(`clock_offsets`: no wait ends before its data was sent, in either direction).

Each rank runs its actions in order, each after its predecessor and its gap, all ranks from the
step's start together. A rank that starts its step before the others in the trace (its
previous step ended sooner) only waits longer for them: the step is as long as the rank whose
last action ends last counted from its own start, measured (`measured_phase_us`) and replayed
alike.

**The changes.**

- `more_microbatches`: the same batch cut into `factor` times as many micro-batches. Each
  action's work other than its fixed part shrinks by the factor, the fixed part stays, and the
  order is the schedule's own for the new count (ScheduleGPipe: every forward, then every
  backward; Schedule1F1B: `num_stages - stage` forwards, then one backward and one forward in
  turn; ScheduleInterleaved1F1B and ScheduleLoopedBFS, whose ranks run a loop of stages (stage
  `s` on rank `s % ranks`): torch's own orders, ported and checked against torch's). It is
  refused where a rank's recorded order is not the schedule's own for the recorded count, and
  for the other runtime schedules (the zero-bubble and V-shaped ones). A runtime schedule's
  sends and receives (actions of no micro-batch's compute) are kept with the action after them,
  once per micro-batch.
- `balanced`: every stage does the same work per step (their mean), each action scaled by its
  stage's mean over its own: the model split where the work is equal. The order is kept.
- `moved`: a share of one stage's work moved to another (blocks moved across the split, each
  block an equal share of its stage's work), the actions scaled the same way.

Limits: a micro-batch's work is taken as linear in its size (small micro-batches use a GPU less
well, so more micro-batches gain less there than predicted); a receive's cost does not change
with the micro-batch's bytes; what couples the pipelines (FSDP or DP collectives across them
inside an action) is kept as measured work.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from ..rank.pipeline_times import PipelineAction, PipelineStepTimes

COMPUTE_KINDS = frozenset({"F", "B", "I", "W"})
PRODUCING_KINDS = frozenset({"F", "B", "I"})
"""The actions a neighbour waits for: a forward's output, a backward's (full, or for the input)
gradient; a backward for the weights (W) sends nothing."""
GENERATED_SCHEDULES = frozenset(
    {"ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS"}
)
"""The schedules whose order for another micro-batch count the replay generates."""
Action = tuple[str, int, int]
"""A compute action: kind ("F", "B"), stage, micro-batch."""


class ScheduleError(ValueError):
    """A step the replay cannot re-time (the message says why)."""


@dataclass(frozen=True)
class Op:
    """One action of one rank, as the replay runs it (times in microseconds)."""

    kind: str  # "F", "B", "I", "W", or "" (no micro-batch's compute: runs in place)
    stage: int
    microbatch: int
    work_us: float  # the action minus its recv waits
    fixed_us: float  # of the work: what a smaller micro-batch does not shrink (module docstring)
    gap_us: float  # host time before it on its rank (recv waits left out)


@dataclass(frozen=True)
class PipelineStep:
    """One step of one pipeline: its ranks' actions and measured phases."""

    step: int
    ops: Mapping[int, tuple[Op, ...]]  # per rank, in the order it ran them
    measured_us: Mapping[int, float]  # per rank: its step's start to its last action's end
    recv_us: Mapping[int, float]  # per rank: what a receive from another rank costs it

    @property
    def measured_phase_us(self) -> float:
        """The slowest rank's measured phase."""
        return max(self.measured_us.values())

    @property
    def n_stages(self) -> int:
        """The pipeline's stages: every one of them runs on one of its ranks."""
        return _stage_count(self.ops)


def _stage_count(ops: Mapping[int, Sequence[Op]]) -> int:
    return 1 + max(op.stage for seq in ops.values() for op in seq)


def _key(op: Op) -> tuple[str, int, int]:
    """What a dependent action waits for: the forward, or the backward (full or for input)."""
    return ("F" if op.kind == "F" else "B", op.stage, op.microbatch)


def _needs(op: Op, n_stages: int) -> tuple[str, int, int] | None:
    if op.kind == "F" and op.stage > 0:
        return ("F", op.stage - 1, op.microbatch)
    if op.kind in ("B", "I") and op.stage < n_stages - 1:
        return ("B", op.stage + 1, op.microbatch)
    return None


def replay(step: PipelineStep) -> dict[int, float]:
    """Each rank's replayed phase (µs from the step's start to its last action's end)."""
    ops, n_stages = step.ops, step.n_stages
    produced = {_key(op): r for r, seq in ops.items() for op in seq if op.kind in PRODUCING_KINDS}
    done: dict[tuple[str, int, int], float] = {}
    pos = dict.fromkeys(ops, 0)
    free = dict.fromkeys(ops, 0.0)
    remaining = sum(len(seq) for seq in ops.values())
    while remaining:
        progressed = False
        for r, seq in ops.items():
            while pos[r] < len(seq):
                op = seq[pos[r]]
                start = free[r] + op.gap_us
                need = _needs(op, n_stages)
                if need is not None and need in produced:
                    if need not in done:
                        break
                    if produced[need] != r:
                        start = max(start, done[need]) + step.recv_us.get(r, 0.0)
                free[r] = start + op.work_us
                if op.kind in PRODUCING_KINDS:
                    done[_key(op)] = free[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError(
                "the ranks' recorded actions wait on each other in a circle (a schedule the "
                "replay's dependencies do not describe)"
            )
    return free


def replayed_phase_us(step: PipelineStep) -> float:
    """The slowest rank's replayed phase."""
    return max(replay(step).values())


def pipeline_steps(
    groups: Sequence[Sequence[int]],
    timings: Mapping[int, Sequence[PipelineStepTimes]],
    fixed_us: Callable[[int, PipelineAction], float] | None = None,
    same_clock: Callable[[Sequence[int]], bool] = lambda ranks: False,
) -> list[PipelineStep]:
    """Each pipeline's steps that every one of its ranks timed (a label that names no stage,
    a single-stage schedule's, means the stage of the rank's position in its pipeline: torch
    puts stage `s` on group rank `s`); `fixed_us(rank, action)`: the all-gather time
    inside the action (0 without it; added to the action's host cost per op as the part that
    does not shrink with the micro-batch); `same_clock(ranks)`: whether their timestamps
    compare (one host)."""
    out = []
    for group in groups:
        ranks = [r for r in group if timings.get(r)]
        if len(ranks) < 2 or len(ranks) < len(group):
            continue
        by_step = [{t.step: t for t in timings[r]} for r in ranks]
        for k in sorted(set.intersection(*(set(d) for d in by_step))):
            steps = {r: d[k] for r, d in zip(ranks, by_step, strict=True)}
            if any(not t.timeline for t in steps.values()):
                continue
            ops = {r: _rank_ops(r, t, group.index(r), fixed_us) for r, t in steps.items()}
            measured = {r: t.timeline[-1].end_us - t.start_us for r, t in steps.items()}
            receives = _receives(steps, ops)
            offsets = clock_offsets(ranks, receives, same_clock)
            out.append(PipelineStep(k, ops, measured, _receive_costs(receives, offsets)))
    return out


def _rank_ops(
    rank: int,
    t: PipelineStepTimes,
    own_stage: int,
    fixed_us: Callable[[int, PipelineAction], float] | None,
) -> tuple[Op, ...]:
    """One rank's step as the replay runs it: each action's work and the host gap before it."""
    seq, prev = [], t.start_us
    for a in t.timeline:
        work = max(0.0, a.end_us - a.start_us - a.recv_us)
        gathers = fixed_us(rank, a) if fixed_us is not None else 0.0
        fixed = min(gathers + a.host_fixed_us, work)
        gap = max(0.0, a.start_us - prev - a.recv_before_us)
        stage = a.stage if a.stage >= 0 else own_stage
        seq.append(Op(a.kind, stage, a.microbatch, work, fixed, gap))
        prev = max(prev, a.end_us)
    return tuple(seq)


def _receives(
    steps: Mapping[int, PipelineStepTimes], ops: Mapping[int, tuple[Op, ...]]
) -> list[tuple[int, int, float, float, float]]:
    """Each dependent receive across ranks: (receiver, sender, the wait's start and end on the
    receiver's clock, the sender's action end on the sender's). The receive sits at the
    action's start (recv inside) or just before it (recv before)."""
    ends: dict[tuple[str, int, int], tuple[int, float]] = {}
    for r, t in steps.items():
        for op, a in zip(ops[r], t.timeline, strict=True):
            if op.kind in PRODUCING_KINDS:
                ends[_key(op)] = (r, a.end_us)
    n_stages = _stage_count(ops)
    out = []
    for r, t in steps.items():
        for op, a in zip(ops[r], t.timeline, strict=True):
            need = _needs(op, n_stages) if op.kind in COMPUTE_KINDS else None
            sender = ends.get(need) if need is not None else None
            if sender is not None and sender[0] != r:
                wait = (a.start_us - a.recv_before_us, a.start_us + a.recv_us)
                out.append((r, sender[0], *wait, sender[1]))
    return out


def clock_offsets(
    ranks: Sequence[int],
    receives: Sequence[tuple[int, int, float, float, float]],
    same_clock: Callable[[Sequence[int]], bool],
) -> dict[int, float]:
    """Each rank's clock minus the first rank's, along the pipeline. Ranks on one clock: 0.
    Across clocks, from the receives between neighbours: no wait ends before its data was
    sent, so `d = o_r - o_s <= wait_end_r - send_end_s` for each receive of r from s, and
    `d >= -(wait_end_s - send_end_r)` for each of s from r; `d` is the middle of the tightest
    bounds (the way NTP splits a round trip), or the one bound there is."""
    out = {ranks[0]: 0.0}
    for s, r in itertools.pairwise(ranks):
        if same_clock([s, r]):
            d = 0.0
        else:
            up = [end - sent for rr, ss, _, end, sent in receives if (rr, ss) == (r, s)]
            down = [end - sent for rr, ss, _, end, sent in receives if (rr, ss) == (s, r)]
            if up and down:
                d = (min(up) - min(down)) / 2
            else:
                d = min(up) if up else -min(down) if down else 0.0
        out[r] = out[s] + d
    return out


def _receive_costs(
    receives: Sequence[tuple[int, int, float, float, float]], offsets: Mapping[int, float]
) -> dict[int, float]:
    """Per rank, what a receive from another rank costs it once the data is sent: the median
    over its receives of the time from the later of the wait's start and the sender's end to
    the wait's end, on the first rank's clock."""
    samples: dict[int, list[float]] = {}
    for r, s, start, end, sent in receives:
        sent_here = sent - offsets.get(s, 0.0) + offsets.get(r, 0.0)
        samples.setdefault(r, []).append(max(0.0, end - max(sent_here, start)))
    return {r: statistics.median(v) for r, v in samples.items()}


def more_microbatches(step: PipelineStep, schedule: str, m: int, factor: int = 2) -> PipelineStep:
    """The step with each micro-batch cut in `factor` (module docstring); ScheduleError for a
    schedule whose order is not generated here, for stages not placed as torch places them, or
    for a rank whose recorded actions are not the schedule's own order for `m` (a custom or
    changed schedule: its order for another count is not known)."""
    if schedule not in GENERATED_SCHEDULES:
        raise _not_generated(schedule)
    pp, n_stages = len(step.ops), step.n_stages
    ops = {}
    for r, seq in step.ops.items():
        compute, tail = _folded(seq)
        if any(op.kind not in ("F", "B") for op in compute):
            raise ScheduleError(f"rank {r} runs compute actions other than F and B")
        source = {(op.kind, op.stage, op.microbatch): op for op in compute}
        own = _pipeline_rank(r, {op.stage for op in compute}, pp, n_stages)
        recorded = [(op.kind, op.stage, op.microbatch) for op in compute]
        if recorded != rank_order(schedule, own, pp, n_stages, m):
            raise ScheduleError(
                f"rank {r}'s recorded actions are not {schedule}'s order for {m} micro-batches "
                "(a custom or changed schedule: its order for another count is not known)"
            )
        new = []
        for kind, stage, j in rank_order(schedule, own, pp, n_stages, m * factor):
            src = source[(kind, stage, j // factor)]
            scaled = src.fixed_us + (src.work_us - src.fixed_us) / factor
            new.append(replace(src, microbatch=j, work_us=scaled))
        ops[r] = (*new, *tail)
    return replace(step, ops=ops)


def _folded(seq: Sequence[Op]) -> tuple[list[Op], tuple[Op, ...]]:
    """A rank's compute actions, each with the actions run in place before it (a runtime
    schedule's sends and receives: no micro-batch's compute) added to its host gap, and the
    in-place actions after the last one. Each micro-batch keeps its sends' and receives' cost
    (a receive's cost does not change with its bytes, module docstring)."""
    out: list[Op] = []
    pending: list[Op] = []
    for op in seq:
        if op.kind in COMPUTE_KINDS:
            out.append(replace(op, gap_us=op.gap_us + sum(p.gap_us + p.work_us for p in pending)))
            pending = []
        else:
            pending.append(op)
    return out, tuple(pending)


def _pipeline_rank(rank: int, stages: set[int], pp: int, n_stages: int) -> int:
    """The rank's place in its pipeline from the stages it ran: torch puts stage `s` on
    pipeline rank `s % pp` (one stage per rank, or a loop of them); ScheduleError otherwise."""
    own = min(stages, default=0)
    if n_stages % pp or stages != set(range(own, n_stages, pp)):
        raise ScheduleError(
            f"rank {rank} runs stages {sorted(stages)}: not one stage per rank or a loop of "
            f"them (stage s on pipeline rank s % {pp})"
        )
    return own


def rank_order(schedule: str, rank: int, pp: int, n_stages: int, m: int) -> list[Action]:
    """The compute actions (kind, stage, micro-batch) `schedule` runs on pipeline rank `rank` of
    `pp` for `m` micro-batches, in order: torch.distributed.pipelining's own (the runtime
    schedules' `_calculate_single_rank_operations` less their idle slots); stage `s` on rank
    `s % pp`. ScheduleError for a count the schedule refuses."""
    stages = range(rank, n_stages, pp)
    if schedule == "ScheduleGPipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    if schedule == "Schedule1F1B":
        warmup = min(m, n_stages - rank)
        order = [("F", rank, i) for i in range(warmup)]
        f, b = warmup, 0
        while True:
            order.append(("B", rank, b))
            b += 1
            if f == m:
                break
            order.append(("F", rank, f))
            f += 1
        return order + [("B", rank, i) for i in range(b, m)]
    if schedule == "ScheduleLoopedBFS":
        return [("F", s, i) for s in stages for i in range(m)] + [
            ("B", s, i) for s in reversed(stages) for i in reversed(range(m))
        ]
    if schedule == "ScheduleInterleaved1F1B":
        return _interleaved_1f1b(rank, pp, len(stages), m)
    raise _not_generated(schedule)


def _not_generated(schedule: str) -> ScheduleError:
    return ScheduleError(
        f"{schedule}'s order for another micro-batch count is not generated here (only "
        + ", ".join(sorted(GENERATED_SCHEDULES))
        + ")"
    )


def _interleaved_1f1b(rank: int, pp: int, n_local: int, m: int) -> list[Action]:
    """ScheduleInterleaved1F1B's actions on pipeline rank `rank` (depth first: the micro-batches
    go round the local stages in rounds of `m // rounds`)."""
    rounds = max(1, m // pp)
    if m % rounds:
        raise ScheduleError(
            f"ScheduleInterleaved1F1B refuses {m} micro-batches on {pp} ranks (not a multiple "
            f"of its {rounds} rounds)"
        )
    per_round = m // rounds
    total = n_local * m
    warmup = min((n_local - 1) * per_round + 2 * (pp - 1 - rank), total)
    fwd: dict[int, int] = {}
    bwd: dict[int, int] = {}
    out: list[Action] = []

    def forward(op: int) -> None:
        stage = ((op // per_round) % n_local) * pp + rank
        fwd[stage] = fwd.get(stage, -1) + 1
        out.append(("F", stage, fwd[stage]))

    def backward(op: int) -> None:
        stage = (n_local - 1 - ((op - warmup) // per_round) % n_local) * pp + rank
        bwd[stage] = bwd.get(stage, -1) + 1
        out.append(("B", stage, bwd[stage]))

    for op in range(total + warmup):  # warmup, then 1F1B (total - warmup), then cool-down
        if op < total:
            forward(op)
        if op >= warmup:
            backward(op)
    return out


def stage_work(step: PipelineStep) -> dict[int, float]:
    """Each stage's work in the step (µs, its compute actions summed)."""
    work: dict[int, float] = {}
    for seq in step.ops.values():
        for op in seq:
            if op.kind in COMPUTE_KINDS:
                work[op.stage] = work.get(op.stage, 0.0) + op.work_us
    return work


def rescaled(step: PipelineStep, totals: Mapping[int, float]) -> PipelineStep:
    """The step with each stage's work set to `totals[stage]`, every one of its actions (and
    the gathers inside) scaled alike; the order is kept."""
    work = stage_work(step)
    if not work or min(work.values()) <= 0:
        raise ScheduleError("a stage did no measured work")
    scale = {s: totals.get(s, w) / w for s, w in work.items()}
    ops = {
        r: tuple(
            replace(
                op, work_us=op.work_us * scale[op.stage], fixed_us=op.fixed_us * scale[op.stage]
            )
            if op.kind in COMPUTE_KINDS
            else op
            for op in seq
        )
        for r, seq in step.ops.items()
    }
    return replace(step, ops=ops)


def balanced(step: PipelineStep) -> PipelineStep:
    """The step with every stage's work at the stages' mean (module docstring)."""
    work = stage_work(step)
    mean = statistics.fmean(work.values()) if work else 0.0
    return rescaled(step, dict.fromkeys(work, mean))


def moved(step: PipelineStep, source: int, target: int, share: float) -> PipelineStep:
    """The step with `share` of stage `source`'s work moved to stage `target` (blocks moved
    across the split, each block an equal share of its stage's work)."""
    work = stage_work(step)
    if source not in work or target not in work:
        raise ScheduleError(f"stage {source} or {target} did no measured work")
    delta = work[source] * share
    return rescaled(step, {**work, source: work[source] - delta, target: work[target] + delta})
