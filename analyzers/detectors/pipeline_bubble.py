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

With `p` positions and `m` micro-batches, a fill-and-drain schedule (GPipe, 1F1B) runs its phase
in about `T(m) = sum(t) + (m - 1) * max(t)`: the first micro-batch crosses every stage, the rest
follow at the slowest stage's pace. Balanced (`t` equal), the idle share of the phase is the
well-known `(p - 1) / (m + p - 1)`. Two changes shrink it, each with its gain from `T`:

- more micro-batches (`m' = 2m`, the same batch cut finer, each `t` scaled by `m / m'`):
  `T(m) - T(m') = (sum(t) - max(t)) * (1 - m / m')`;
- a balanced split (every `t` at their mean): `T(m) - T_balanced = (m - 1) * (max(t) - mean(t))`.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from ..inputs.pipeline_facts import PipelineFacts
from ..rank.pipeline_times import PipelineStepTimes
from ..report import Finding, Severity
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


def phase_ms(per_mb: list[float], m: int) -> float:
    """T(m) = sum(t) + (m - 1) * max(t): a fill-and-drain phase of m micro-batches."""
    return sum(per_mb) + (m - 1) * max(per_mb)


def more_microbatches_gain(
    per_mb: list[float], m: int, m_new: int, fixed: list[float] | None = None
) -> float:
    """T(m) - T(m_new): each stage's time per micro-batch t = a + f, where the work a scales by
    m / m_new and `fixed` f (the FSDP all-gathers each micro-batch repeats, whose size does not
    depend on the batch) stays; can be negative (more micro-batches cost more)."""
    f = fixed or [0.0] * len(per_mb)
    new = [(t - min(x, t)) * m / m_new + min(x, t) for t, x in zip(per_mb, f, strict=True)]
    return phase_ms(per_mb, m) - phase_ms(new, m_new)


def rebalance_gain(per_mb: list[float], m: int) -> float:
    """T(m) - T with every stage at the mean time per micro-batch."""
    return (m - 1) * (max(per_mb) - sum(per_mb) / len(per_mb))


def ideal_bubble(p: int, m: int) -> float:
    """The idle share of a balanced fill-and-drain phase: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


def _name(pos: Position) -> str:
    return ("stage " if len(pos.stages) == 1 else "stages ") + ", ".join(map(str, pos.stages))


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
    gain_mb: float  # doubling the micro-batches
    gain_bal: float  # a balanced split (0 when balanced)
    slow_blocks: tuple[str, str, int] | None = None  # the slow stage's (class, container, count)

    @property
    def p(self) -> int:
        """Pipeline positions (ranks per pipeline)."""
        return len(self.pos)

    @property
    def schedule(self) -> str:
        """The captured schedule's class ("?" when none was captured)."""
        return self.pf.schedule.cls if self.pf.schedule is not None else "?"

    @property
    def more_microbatches(self) -> bool:
        """Whether doubling the micro-batches is worth proposing."""
        return self.gain_mb >= MIN_GAIN_SHARE * self.step

    def waits(self) -> str:
        """Each position's bubble share, in words."""
        return "; ".join(
            f"{_name(q)} (ranks {list(q.ranks)}) {q.bubble_share:.0%}" for q in self.pos
        )


def measure(
    pf: PipelineFacts,
    pos: list[Position],
    m: int,
    blocks: tuple[str, str, int] | None = None,
    gathers: list[float] | None = None,
) -> Bubble:
    """The bubble arithmetic of measured positions (at least one); `blocks` (class, container,
    count): the repeated blocks of the captured rank's stage, when it knows them; `gathers`:
    per position, its FSDP all-gather time per step (repeated in every micro-batch)."""
    per_mb = [q.busy_ms / m for q in pos]
    fixed = [g / m for g in gathers] if gathers else None
    mean_t = sum(per_mb) / len(per_mb)
    imbalanced = max(per_mb) >= IMBALANCE_RATIO * mean_t
    slow = pos[per_mb.index(max(per_mb))]
    captured = {s.stage_index for s in pf.stages}
    return Bubble(
        pf=pf,
        pos=pos,
        m=m,
        step=median(q.step_ms for q in pos),
        per_mb=per_mb,
        slow=slow,
        imbalanced=imbalanced,
        gain_mb=more_microbatches_gain(per_mb, m, 2 * m, fixed),
        gain_bal=rebalance_gain(per_mb, m) if imbalanced else 0.0,
        slow_blocks=blocks if captured & set(slow.stages) else None,
    )


def _gathers_per_step(ctx: DetectorContext, ranks: tuple[int, ...]) -> float:
    """The ranks' mean FSDP all-gather time per step (ms): each micro-batch gathers again."""
    per_rank = []
    for rank in ranks:
        lg = ctx.ledgers.get(rank)
        if lg is None or not lg.steps:
            continue
        total_us = sum(r.end_us - r.start_us for r in lg.gathers)
        per_rank.append(total_us / 1e3 / len(lg.steps))
    return sum(per_rank) / len(per_rank) if per_rank else 0.0


def blocks_to_move(b: Bubble) -> int | None:
    """How many of the slow stage's blocks to move so it works about the mean per micro-batch,
    each block taken as an equal share of its work (None when its blocks are unknown)."""
    if b.slow_blocks is None or b.slow_blocks[2] < 2:
        return None
    t_slow, count = max(b.per_mb), b.slow_blocks[2]
    k = round((t_slow - sum(b.per_mb) / b.p) / (t_slow / count))
    return min(max(k, 1), count - 1)


def detect(ctx: DetectorContext) -> list[Finding]:
    """The pipeline-bubble finding, or none."""
    pf = ctx.model.pipeline if ctx.model is not None else None
    m = pf.n_microbatches if pf is not None else None
    if pf is None or not m:
        return []
    pos = positions(pf, {r: f.pipeline for r, f in ctx.facts.items() if f.pipeline})
    if len(pos) < 2:
        return []
    best = ctx.model.best_block() if ctx.model is not None else None
    blocks = (
        (best.child_class, best.containers[0], best.count) if best and best.child_class else None
    )
    b = measure(pf, pos, m, blocks, [_gathers_per_step(ctx, q.ranks) for q in pos])
    gain = max(b.gain_mb, b.gain_bal)
    worst = max(q.bubble_share for q in pos)
    if worst < BUBBLE_MIN_SHARE or b.step <= 0 or gain < MIN_GAIN_SHARE * b.step:
        return []
    severity: Severity = "warning" if gain >= WARNING_GAIN_SHARE * b.step else "info"
    if b.imbalanced:
        fast = [t for q, t in zip(pos, b.per_mb, strict=True) if q is not b.slow]
        title = (
            f"Pipeline bubble: {_name(b.slow)} makes the others wait ({max(b.per_mb):.1f} ms "
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
            expected_gain_ms=round(gain, 3),
            gain_method=(
                "from the measured work per micro-batch t of each stage (median over steps): "
                "the phase takes T(m) = sum(t) + (m-1)*max(t); doubling m halves each t's work "
                "but not its FSDP all-gathers, which every micro-batch repeats (t = a + f, "
                "t' = a/2 + f, gain T(m) - T'(2m)), a balanced split sets every t to their mean "
                "(gain (m-1)*(max(t)-mean(t))); the larger is reported. Smaller micro-batches "
                "run less efficiently on GPUs: an upper bound there"
            ),
        )
    ]


def _recommendation(b: Bubble) -> str:
    p, m, cls = b.p, b.m, b.schedule
    text = [
        f"{cls} runs {m} micro-batches over {p} pipeline stages: a fill-and-drain schedule "
        f"leaves each stage idle (p-1)/(m+p-1) = {ideal_bubble(p, m):.0%} of the pipeline phase "
        f"even when balanced. Measured per stage (share of the step not spent on micro-batches): "
        f"{b.waits()}."
    ]
    if b.imbalanced:
        text.append(
            f"{_name(b.slow).capitalize()} (ranks {list(b.slow.ranks)}) works "
            f"{max(b.per_mb):.1f} ms per micro-batch against a mean of "
            f"{sum(b.per_mb) / p:.1f} ms: every other stage waits for it. Move layers out of it "
            f"to the faster stages (split the model where the work per micro-batch is equal"
            + _move_text(b)
            + f"): about {b.gain_bal:.1f} ms per step."
        )
    if b.more_microbatches:
        text.append(
            f"Cut the batch into {2 * m} micro-batches instead of {m} (code): the idle share "
            f"drops to {ideal_bubble(p, 2 * m):.0%} when balanced; about {b.gain_mb:.1f} ms per "
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


def _move_text(b: Bubble) -> str:
    k = blocks_to_move(b)
    if k is None or b.slow_blocks is None:
        return ""
    cls, container, count = b.slow_blocks
    where = f" (`{container}`)" if container else ""
    return f"; about {k} of its {count} `{cls}` blocks{where}"


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
        "ideal_bubble_share_of_phase": round(ideal_bubble(b.p, b.m), 4),
        "model_phase_ms": round(phase_ms(b.per_mb, b.m), 3),
        "gain_more_microbatches_ms": round(b.gain_mb, 3),
        "gain_rebalance_ms": round(b.gain_bal, 3),
        "threshold_bubble_share": BUBBLE_MIN_SHARE,
        "threshold_min_gain_share": MIN_GAIN_SHARE,
        "threshold_imbalance_ratio": IMBALANCE_RATIO,
        "threshold_warning_gain_share": WARNING_GAIN_SHARE,
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
        "balanced, and an unbalanced split makes every stage run at the slowest stage's pace."
    ),
    example=(
        "Pipeline bubble: stage 0 makes the others wait (31.2 ms per micro-batch, the others "
        "14.8 ms); waiting per stage: stage 0 (ranks [0, 2]) 15%; stage 1 (ranks [1, 3]) 40%."
    ),
    fix=(
        "Move layers from the slow stage to the others; double `n_microbatches` (code); on "
        "ScheduleGPipe, Schedule1F1B keeps activation memory flat as micro-batches grow; "
        "ScheduleInterleaved1F1B with 2 stages per rank halves the balanced bubble."
    ),
    gain=(
        "From the measured work per micro-batch t per stage: T(m) = sum(t) + (m-1)*max(t); "
        "doubling m halves each t's work but not its FSDP all-gathers (t' = a/2 + f: gain "
        "T(m) - T'(2m), negative when the gathers dominate), balancing gains "
        "(m-1)*(max(t)-mean(t)); the larger is reported."
    ),
    scope=(
        "runs recorded with `zdiag run` whose script builds pipeline stages (the model "
        "description's `pipeline`), with schedules that label their actions (ScheduleGPipe, "
        "the multi-stage runtime schedules; Schedule1F1B in torch 2.13 does not); the waits "
        "are host ranges (CPU/gloo runs; on GPUs the host view of the recv)"
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
            "The best change gains at least this share of the median step.",
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
