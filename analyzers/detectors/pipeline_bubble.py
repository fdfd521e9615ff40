"""`pipeline-bubble`: a pipeline-parallel run's stages wait for each other a large share of the step.

The model description says which stages the script built and with which schedule
(collectors/pipeline_capture.py; analyzers/inputs/pipeline_facts.py places every stage on its
ranks); the map times each rank's micro-batch actions (analyzers/rank/pipeline_times.py): per
step, the pipeline phase (`window`), the work on micro-batches (`busy`) and the rest (`wait`: recv
and send waits, gaps). Per pipeline position (the stage or stages one rank of each pipeline
runs), medians over steps, averaged over its ranks:

- the bubble: `wait / step`, the share of the step its ranks spend not working on micro-batches;
- the work per micro-batch: `t = busy / m` (forward and backward of one micro-batch);
- the stage that makes the others wait: the one with the largest `t`.

With `p` positions and `m` micro-batches a fill-and-drain schedule (GPipe, 1F1B) idles each
stage `(p - 1) / (m + p - 1)` of its phase even when balanced (`(p - 1) / (v m + p - 1)` with
`v` stages per rank: the interleaved and looped schedules). Two changes shrink the bubble;
each one's gain comes from the schedule replay (analyzers/whatif/pipeline_schedule.py), which
re-times every pipeline's recorded actions across its ranks, as measured and changed, and takes
the difference (the median over steps of the slowest pipeline's phase):

- more micro-batches (`m' = 2m`, the same batch cut finer: each action's work halves but for
  its FSDP all-gathers, which every micro-batch repeats, and its host cost per op), in the
  schedule's own order for `2m`;
- a rebalanced split, in the recorded order: the slow stage's blocks the recommendation names
  moved to its faster neighbour (each block an equal share of its stage's work), or, when the
  captured rank does not run the slow stage, every stage at the stages' mean work.

The replay of the unchanged step is reported beside the measured phase (`replay_error`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from statistics import median

from ..inputs.pipeline_facts import PipelineFacts
from ..rank.pipeline_times import PipelineAction, PipelineStepTimes
from ..report import Finding, Severity
from ..run.core_use import HostCores, busiest
from ..whatif.pipeline_replay import Move, Replayed, gather_time, replay_pipeline
from .context import DetectorContext
from .rule import Rule, Threshold

# (the reasoning behind each value: RULE's thresholds, at the end of the module)
BUBBLE_MIN_SHARE = 0.15
MIN_GAIN_SHARE = 0.03
IMBALANCE_RATIO = 1.25
WARNING_GAIN_SHARE = 0.10
SINGLE_STAGE_SCHEDULES = frozenset({"ScheduleGPipe", "Schedule1F1B"})


@dataclass(frozen=True)
class Position:
    """One pipeline position: the stages one rank of each pipeline runs, and their timings."""

    stages: tuple[int, ...]
    ranks: tuple[int, ...]
    step_ms: float
    window_ms: float
    busy_ms: float
    wait_ms: float

    @property
    def bubble_share(self) -> float:
        """The share of the step not spent on micro-batches."""
        return self.wait_ms / self.step_ms if self.step_ms > 0 else 0.0


def _rank_medians(steps: list[PipelineStepTimes]) -> tuple[float, float, float, float]:
    return (
        median(s.step_ms for s in steps),
        median(s.window_ms for s in steps),
        median(s.busy_ms for s in steps),
        median(s.wait_ms for s in steps),
    )


def positions(pf: PipelineFacts, timings: dict[int, list[PipelineStepTimes]]) -> list[Position]:
    """Per pipeline position with timed ranks: its stages, ranks and mean of the rank medians."""
    size = len(pf.groups[0]) if pf.groups else pf.num_stages
    out = []
    for pos in range(size):
        stages = tuple(s for s in range(pf.num_stages) if pf.stage_rank_position(s, size) == pos)
        if not stages:
            continue
        ranks = tuple(r for r in pf.ranks_of_stage(stages[0]) if timings.get(r))
        if not ranks:
            continue
        meds = [_rank_medians(timings[r]) for r in ranks]
        mean = [sum(m[i] for m in meds) / len(meds) for i in range(4)]
        out.append(Position(stages, ranks, *mean))
    return out


def ideal_bubble(p: int, m: int, v: int = 1) -> float:
    """The idle share of a balanced fill-and-drain phase: (p - 1) / (v m + p - 1), with `v`
    stages per rank (the interleaved and looped schedules run `v` chunks of each micro-batch
    on a rank, which fill the pipeline `v` times faster)."""
    return (p - 1) / (v * m + p - 1)


def _bubble_formula(v: int) -> str:
    return "(p-1)/(m+p-1)" if v == 1 else f"(p-1)/({v}m+p-1) with {v} stages per rank"


def _name(pos: Position) -> str:
    return ("stage " if len(pos.stages) == 1 else "stages ") + ", ".join(map(str, pos.stages))


def _verb(pos: Position, verb: str) -> str:
    """`verb` agreeing with `_name(pos)`: "makes" for one stage, "make" for a loop of them."""
    return verb + ("s" if len(pos.stages) == 1 else "")


def _code(pf: PipelineFacts, m: int, m_new: int, p: int) -> str:
    """The run's schedule rebuilt with `m_new` micro-batches: its class, and its loss function
    imported by the name the capture recorded (else the name `loss_fn`, the user's own)."""
    cls = pf.schedule.cls if pf.schedule is not None else "ScheduleGPipe"
    first = "stage" if cls in SINGLE_STAGE_SCHEDULES else "stages"
    loss = pf.schedule.loss_fn if pf.schedule is not None else ""
    module, _, name = loss.partition(":")
    imports = f"from torch.distributed.pipelining import {cls}\n"
    if module and name:
        imports += f"from {module} import {name} as loss_fn  # the run's loss function\n"
    return (
        imports
        + f"# the run's schedule: {cls}(..., n_microbatches={m}) over {p} pipeline ranks; the\n"
        f"# batch must split into {m_new} equal micro-batches. Keep your own `{first}` (and other\n"
        f"# arguments): only n_microbatches changes.\n"
        f"schedule = {cls}({first}, n_microbatches={m_new}, loss_fn=loss_fn)"
    )


@dataclass(frozen=True)
class Bubble:
    """The measured pipeline and what each change would gain (module docstring)."""

    pf: PipelineFacts
    pos: list[Position]
    m: int
    step: float  # median step (ms) over the positions
    per_mb: list[float]  # work per micro-batch per position
    slow: Position
    imbalanced: bool
    replayed: Replayed | str  # the schedule replay, or why it did not run
    slow_blocks: tuple[str, str, int] | None = None  # the slow stage's (class, container, count)

    @property
    def p(self) -> int:
        """Pipeline positions (ranks per pipeline)."""
        return len(self.pos)

    @property
    def v(self) -> int:
        """Stages per rank (1, or the interleaved and looped schedules' loop)."""
        return min(len(pos.stages) for pos in self.pos)

    @property
    def schedule(self) -> str:
        """The captured schedule's class ("?" when none was captured)."""
        return self.pf.schedule.cls if self.pf.schedule is not None else "?"

    @property
    def gain_mb(self) -> float | None:
        """Doubling the micro-batches, replayed (None: not replayed)."""
        return self.replayed.gain_mb if isinstance(self.replayed, Replayed) else None

    @property
    def gain_bal(self) -> float | None:
        """A balanced split, replayed (0 when the stages are balanced; None: not replayed)."""
        if not self.imbalanced:
            return 0.0
        return self.replayed.gain_bal if isinstance(self.replayed, Replayed) else None

    @property
    def gain(self) -> float | None:
        """The larger replayed gain (None: neither was replayed)."""
        gains = [g for g in (self.gain_mb, self.gain_bal) if g is not None]
        return max(gains) if gains else None

    @property
    def more_microbatches(self) -> bool:
        """Whether doubling the micro-batches is worth proposing."""
        return self.gain_mb is not None and self.gain_mb >= MIN_GAIN_SHARE * self.step

    def waits(self) -> str:
        """Each position's bubble share, in words."""
        return "; ".join(
            f"{_name(q)} (ranks {list(q.ranks)}) {q.bubble_share:.0%}" for q in self.pos
        )


def measure(
    pf: PipelineFacts,
    pos: list[Position],
    m: int,
    timings: dict[int, list[PipelineStepTimes]],
    blocks: tuple[str, str, int] | None = None,
    gathers: Callable[[int, PipelineAction], float] | None = None,
    hosts: dict[int, str | None] | None = None,
    factor: int = 2,
) -> Bubble:
    """The bubble of measured positions (at least one) and the run's schedule replay;
    `blocks` (class, container, count): the repeated blocks of the captured rank's stage, when
    it knows them; `gathers`, `hosts` and `factor` (the micro-batches' multiple replayed) as
    `replay_pipeline` takes them."""
    per_mb = [q.busy_ms / m for q in pos]
    mean_t = sum(per_mb) / len(per_mb)
    slow = pos[per_mb.index(max(per_mb))]
    captured = {s.stage_index for s in pf.stages}
    slow_blocks = blocks if captured & set(slow.stages) else None
    imbalanced = max(per_mb) >= IMBALANCE_RATIO * mean_t
    move = _move(pos, per_mb, slow, slow_blocks) if imbalanced else None
    return Bubble(
        pf=pf,
        pos=pos,
        m=m,
        step=median(q.step_ms for q in pos),
        per_mb=per_mb,
        slow=slow,
        imbalanced=imbalanced,
        replayed=replay_pipeline(pf, timings, gathers, hosts, move, factor),
        slow_blocks=slow_blocks,
    )


def _blocks_to_move(per_mb: list[float], count: int) -> int | None:
    """How many of the slow stage's `count` blocks to move so it works about the mean per
    micro-batch, each block taken as an equal share of its work."""
    if count < 2:
        return None
    t_slow = max(per_mb)
    k = round((t_slow - sum(per_mb) / len(per_mb)) / (t_slow / count))
    return min(max(k, 1), count - 1)


def _move(
    pos: list[Position], per_mb: list[float], slow: Position, blocks: tuple[str, str, int] | None
) -> Move | None:
    """The blocks to move from the slow stage to its faster neighbour across the split (None
    when its blocks are unknown or it runs more than one stage)."""
    k = _blocks_to_move(per_mb, blocks[2]) if blocks is not None else None
    if k is None or blocks is None or len(slow.stages) != 1:
        return None
    (source,) = slow.stages
    near = [
        (t, q.stages[0])
        for q, t in zip(pos, per_mb, strict=True)
        if len(q.stages) == 1 and abs(q.stages[0] - source) == 1
    ]
    return Move(source, min(near)[1], k, blocks[2]) if near else None


def blocks_to_move(b: Bubble) -> int | None:
    """How many of the slow stage's blocks to move so it works about the mean per micro-batch
    (None when its blocks are unknown)."""
    if b.slow_blocks is None:
        return None
    return _blocks_to_move(b.per_mb, b.slow_blocks[2])


def bubble_of(ctx: DetectorContext, factor: int = 2) -> Bubble | None:
    """The run's measured pipeline and its schedule replay, with `factor` times the
    micro-batches (None: no captured pipeline with a schedule, or fewer than two timed
    positions)."""
    pf = ctx.model.pipeline if ctx.model is not None else None
    m = pf.n_microbatches if pf is not None else None
    if pf is None or not m:
        return None
    timings = {r: f.pipeline for r, f in ctx.facts.items() if f.pipeline}
    pos = positions(pf, timings)
    if len(pos) < 2:
        return None
    best = ctx.model.best_block() if ctx.model is not None else None
    blocks = (
        (best.child_class, best.containers[0], best.count) if best and best.child_class else None
    )
    hosts = {r: f.host for r, f in ctx.facts.items()}
    return measure(pf, pos, m, timings, blocks, gather_time(ctx.ledgers), hosts, factor)


def detect(ctx: DetectorContext) -> list[Finding]:
    """The pipeline-bubble finding, or none."""
    b = bubble_of(ctx)
    if b is None:
        return []
    pf, pos, m = b.pf, b.pos, b.m
    gain = b.gain
    worst = max(q.bubble_share for q in pos)
    if worst < BUBBLE_MIN_SHARE or b.step <= 0:
        return []
    if gain is not None and gain < MIN_GAIN_SHARE * b.step:
        return []
    big = gain is not None and gain >= WARNING_GAIN_SHARE * b.step
    severity: Severity = "warning" if big else "info"
    if b.imbalanced:
        fast = [t for q, t in zip(pos, b.per_mb, strict=True) if q is not b.slow]
        title = (
            f"Pipeline bubble: {_name(b.slow)} {_verb(b.slow, 'make')} the others wait "
            f"({max(b.per_mb):.1f} ms "
            f"per micro-batch, the others {sum(fast) / len(fast):.1f} ms); waiting per stage: "
            f"{b.waits()}"
        )
    else:
        title = f"Pipeline bubble: the stages wait {worst:.0%} of the step ({b.waits()})"
    return [
        Finding(
            id="pipeline-bubble",
            severity=severity,
            title=title,
            ranks=sorted(b.slow.ranks if b.imbalanced else (r for q in pos for r in q.ranks)),
            evidence=_finding_evidence(b),
            recommendation=_recommendation(b),
            code=_code(pf, m, 2 * m, b.p) if b.more_microbatches else None,
            expected_gain_ms=round(gain, 3) if gain is not None else None,
            gain_method=gain_method(b, busiest(ctx.host_cores) if ctx.sheet.cpu_only else None),
        )
    ]


def rebalance_cores_text(cores: HostCores) -> str:
    """The measured cores, and what they mean for a rebalanced split (which keeps more ranks
    busy at once, and which no replay slows for lack of cores)."""
    return cores.sentence() + (
        ": the cores are full, and a balanced split keeps more ranks busy at once, so the "
        "rebalance's gain is an upper bound"
        if cores.full
        else ": not full, though a balanced split keeps more ranks busy at once, which the "
        "replay does not slow"
    )


def gain_method(b: Bubble, cores: HostCores | None = None) -> str:
    """How the gain was replayed, with the unchanged replay's error and each change's phase;
    `cores` (a CPU run's busiest host, measured) says whether a rebalanced split, which keeps
    more ranks busy at once, has cores to run on."""
    r = b.replayed
    if not isinstance(r, Replayed):
        return f"not estimated: the schedule replay did not run ({r})"
    parts = [
        f"replayed: every pipeline's recorded actions re-timed across its ranks, each wait for "
        f"a neighbour derived from the schedule's dependencies (over {r.steps} step(s), the "
        f"slowest pipeline's phase: {r.unchanged_ms:.1f} ms replayed unchanged against "
        f"{r.measured_ms:.1f} ms measured, {r.error:.1%} apart)"
    ]
    if r.more_mb_ms is not None:
        parts.append(
            f"{r.factor * b.m} micro-batches (each action's work cut by {r.factor} but for its "
            f"FSDP all-gathers and host cost per op, in {b.schedule}'s order): "
            f"{r.more_mb_ms:.1f} ms"
        )
    else:
        parts.append(f"{r.factor * b.m} micro-batches not replayed: {r.more_mb_why}")
    if b.imbalanced and r.balanced_ms is not None and r.move is not None:
        mv = r.move
        parts.append(
            f"{mv.count} of stage {mv.source}'s {mv.of} blocks moved to stage {mv.target} (each "
            f"block an equal share of its work): {r.balanced_ms:.1f} ms"
        )
    elif b.imbalanced and r.balanced_ms is not None:
        parts.append(f"the stages balanced (each at their mean work): {r.balanced_ms:.1f} ms")
    if b.imbalanced and r.balanced_ms is not None and cores is not None:
        parts.append("CPU cores are not modelled: " + rebalance_cores_text(cores))
    return (
        "; ".join(parts)
        + ". The larger saving is reported (`zdiag whatif RUN --pipeline-microbatches "
        f"{r.factor * b.m}` or `--pipeline-rebalance` prints each). The rest of a micro-batch's "
        "work is taken as linear in its size: smaller micro-batches run kernels less "
        "efficiently on GPUs, so there the micro-batch gain is an upper bound"
    )


def _recommendation(b: Bubble) -> str:
    p, m, cls, v = b.p, b.m, b.schedule, b.v
    text = [
        f"{cls} runs {m} micro-batches over {p} pipeline ranks: a fill-and-drain schedule leaves "
        f"each stage idle {_bubble_formula(v)} = {ideal_bubble(p, m, v):.0%} of the pipeline phase "
        f"even when balanced. Measured per stage (share of the step not spent on micro-batches): "
        f"{b.waits()}."
    ]
    if b.imbalanced:
        text.append(
            f"{_name(b.slow).capitalize()} (ranks {list(b.slow.ranks)}) {_verb(b.slow, 'work')} "
            f"{max(b.per_mb):.1f} ms per micro-batch against a mean of "
            f"{sum(b.per_mb) / p:.1f} ms: every other stage waits for it. Move layers out of it "
            f"to the faster stages (split the model where the work per micro-batch is equal"
            + _move_text(b)
            + ")"
            + _move_gain(b.gain_bal)
        )
    if b.more_microbatches:
        text.append(
            f"Cut the batch into {2 * m} micro-batches instead of {m} (code): the idle share "
            f"drops to {ideal_bubble(p, 2 * m, v):.0%} when balanced; about {b.gain_mb:.1f} ms per "
            "step."
        )
    if cls == "ScheduleGPipe":
        text.append(
            "ScheduleGPipe keeps the activations of all micro-batches until the backward: "
            "Schedule1F1B (same arguments) keeps at most as many in flight as there are "
            "stages, so more micro-batches then cost no extra activation memory."
        )
    if cls in SINGLE_STAGE_SCHEDULES:
        text.append(
            "Splitting the model into 2 stages per rank and running ScheduleInterleaved1F1B "
            f"shrinks the balanced bubble to (p-1)/(2m+p-1) = {(p - 1) / (2 * m + p - 1):.0%}."
        )
    return " ".join(text)


def _move_gain(gain: float | None) -> str:
    """The replayed gain of the move, in words (none predicted when the replay says slower)."""
    if gain is None:
        return "."
    if gain <= 0:
        return f"; the replay predicts no gain from that move ({-gain:.1f} ms per step slower)."
    return f": about {gain:.1f} ms per step."


def _move_text(b: Bubble) -> str:
    k = blocks_to_move(b)
    if k is None or b.slow_blocks is None:
        return ""
    cls, container, count = b.slow_blocks
    where = f" (`{container}`)" if container else ""
    move = b.replayed.move if isinstance(b.replayed, Replayed) else None
    to = f", to stage {move.target}" if move is not None else ""
    return f"; about {k} of its {count} `{cls}` blocks{where}{to}"


def _finding_evidence(b: Bubble) -> dict[str, object]:
    return {
        "schedule": b.schedule,
        "n_microbatches": b.m,
        "num_stages": b.pf.num_stages,
        "pipelines": [list(g) for g in b.pf.groups],
        "stages": [_evidence(q, b.m, b.pf) for q in b.pos],
        "slow_stage": list(b.slow.stages) if b.imbalanced else None,
        "blocks_to_move": blocks_to_move(b) if b.imbalanced else None,
        "median_step_ms": round(b.step, 3),
        "ideal_bubble_share_of_phase": round(ideal_bubble(b.p, b.m, b.v), 4),
        **_replay_evidence(b.replayed),
        "gain_more_microbatches_ms": _ms(b.gain_mb),
        "gain_rebalance_ms": _ms(b.gain_bal),
        "threshold_bubble_share": BUBBLE_MIN_SHARE,
        "threshold_min_gain_share": MIN_GAIN_SHARE,
        "threshold_imbalance_ratio": IMBALANCE_RATIO,
        "threshold_warning_gain_share": WARNING_GAIN_SHARE,
    }


def _ms(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


def _replay_evidence(r: Replayed | str) -> dict[str, object]:
    if not isinstance(r, Replayed):
        return {"replay_not_run": r}
    return {
        "replay_steps": r.steps,
        "measured_phase_ms": round(r.measured_ms, 3),
        "replayed_phase_ms": round(r.unchanged_ms, 3),
        "replay_error": round(r.error, 4),
        "replayed_more_microbatches_phase_ms": _ms(r.more_mb_ms),
        "more_microbatches_not_replayed": r.more_mb_why or None,
        "replayed_balanced_phase_ms": _ms(r.balanced_ms),
        "rebalanced_by": (
            {"source": r.move.source, "target": r.move.target, "blocks": r.move.count}
            if r.move is not None
            else "every stage at the mean work"
        ),
    }


def _evidence(q: Position, m: int, pf: PipelineFacts) -> dict[str, object]:
    own = next((s for s in pf.stages if s.stage_index in q.stages), None)
    return {
        "stages": list(q.stages),
        "ranks": list(q.ranks),
        "bubble_share": round(q.bubble_share, 4),
        "wait_ms": round(q.wait_ms, 3),
        "busy_ms": round(q.busy_ms, 3),
        "busy_per_microbatch_ms": round(q.busy_ms / m, 3),
        "pipeline_phase_ms": round(q.window_ms, 3),
        "step_ms": round(q.step_ms, 3),
        "submodule_class": own.submodule_class if own is not None else None,
        "param_bytes": own.param_bytes if own is not None else None,
    }


RULE = Rule(
    id="pipeline-bubble",
    summary="pipeline stages wait for each other a large share of the step",
    detect=detect,
    what=(
        "A run that built `torch.distributed.pipelining` stages (captured by `zdiag run`) whose "
        "stages spend a large share of the step outside their micro-batch work: per stage, the "
        "pipeline phase (first to last `Forward <i>` / `Backward <i>` / `PP:<action>` range) "
        "minus the work inside the actions (their pipeline recv waits left out), over the step. "
        "The stage with the most work per micro-batch is the one the others wait for; it is "
        "named when it works at least IMBALANCE_RATIO times the mean."
    ),
    why=(
        "A fill-and-drain schedule idles every stage (p-1)/(m+p-1) of its phase even when "
        "balanced ((p-1)/(vm+p-1) with v stages per rank, interleaved or looped), and an "
        "unbalanced split makes every stage run at the slowest stage's pace."
    ),
    example=(
        "Pipeline bubble: stage 0 makes the others wait (31.2 ms per micro-batch, the others "
        "14.8 ms); waiting per stage: stage 0 (ranks [0, 2]) 15%; stage 1 (ranks [1, 3]) 40%."
    ),
    fix=(
        "Move layers from the slow stage to its faster neighbour (how many of its blocks, when "
        "the captured rank runs it); double `n_microbatches` (code, when the replay says it "
        "pays); on "
        "ScheduleGPipe, Schedule1F1B keeps activation memory flat as micro-batches grow; "
        "ScheduleInterleaved1F1B with 2 stages per rank halves the balanced bubble."
    ),
    gain=(
        "Replayed (analyzers/whatif/pipeline_schedule.py): every pipeline's recorded actions "
        "re-timed across its ranks, each wait for a neighbour derived from the schedule, as "
        "measured (reported beside the measured phase) and changed: twice the micro-batches "
        "(each action's work halved but for its FSDP all-gathers and host cost per op, in the "
        "schedule's own order; ScheduleGPipe and Schedule1F1B) and the split rebalanced (the "
        "blocks it names moved, else every stage at the mean). The larger saving is reported; "
        "without a replay, none."
    ),
    scope=(
        "runs recorded with `zdiag run` whose script builds pipeline stages (the model "
        "description's `pipeline`), with schedules whose actions are labelled (ScheduleGPipe, "
        "the multi-stage runtime schedules, and Schedule1F1B, whose chunks `zdiag run` labels); "
        "the waits are host ranges (CPU/gloo runs; on GPUs the host view of the recv)"
    ),
    thresholds=(
        Threshold(
            "BUBBLE_MIN_SHARE",
            BUBBLE_MIN_SHARE,
            "A stage waits at least this share of the step: below, the pipeline costs less "
            "than ordinary step-to-step noise on a shared host.",
            evidence="threshold_bubble_share",
        ),
        Threshold(
            "MIN_GAIN_SHARE",
            MIN_GAIN_SHARE,
            "The best change gains at least this share of the median step (a bubble the "
            "replay cannot time is reported as info, without a gain).",
            evidence="threshold_min_gain_share",
        ),
        Threshold(
            "IMBALANCE_RATIO",
            IMBALANCE_RATIO,
            "The slow stage is named (and rebalancing proposed) when its work per micro-batch "
            "is at least this many times the mean: below, timing noise between equal stages.",
            evidence="threshold_imbalance_ratio",
        ),
        Threshold(
            "WARNING_GAIN_SHARE",
            WARNING_GAIN_SHARE,
            "From this share of the median step the finding is a warning, else info.",
            evidence="threshold_warning_gain_share",
        ),
    ),
)
