"""The planner: every combination of the changes the replay models and the run can take,
replayed, ranked by predicted step time under a memory budget.

The grid (exact: every combination is replayed on every modelled step of every rank):

- wrap: as measured, or, where today's FSDP2 or FSDP1 units are not the repeated blocks (finer,
  merged; or coarser, a whole-model unit split), each block one unit, at each level of the
  captured module tree that holds repeated blocks (experts, and the mixers around them) (the
  containers the detectors find; `zdiag whatif --wrap`);
- prefetch: as measured, or depth 1 on every unit (with FSDP2's async unshard on a CPU run that
  lacks it, without which nothing overlaps there);
- FSDP2 `reshard_after_forward`: as measured, or off (when the run reshards);
- activation checkpointing: none, or each block (the captured model's blocks), where the run
  measured what each block's forward saves for backward (`zdiag run --profile-memory`: the
  model description's `activations`), so that its memory saving is known
  (`memory_delta.checkpoint_saving`); its time is the replay's recompute, which needs the blocks
  to be FSDP units as measured.

Mesh shapes are replayed (`zdiag whatif --mesh-shape`) but not searched: across nodes their
links are a stated assumption (`--intra-node-speedup`), not a measurement; micro-batches change
the batch each pass computes on, not the schedule, so they are not searched either
(docs/whatif.md).

Ranking: by predicted step time. On a CPU run, plans that split a unit the run shows alone rank
after the plans predicted exactly (within the budget): their predicted step leaves out the new
units' hooks, which every blocking call pays there, so it is a lower bound (`Plan.at_least`).
The predicted peak is the run's measured peak (the largest over ranks) plus the change's
estimated delta; without a measured peak the budget cannot be judged and plans are ranked by
step time alone (a note says so); when no plan fits, by predicted peak, the lowest first. The
best plan's code comes from the framework's own remedies, so it names the run's modules and
mesh as the findings' code does.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ..detectors.blocks import find_block_pattern
from ..detectors.context import DetectorContext
from ..detectors.facts import (
    block_set,
    blocks_are_units,
    model_block_set,
    model_blocks_are_units,
    wrap_levels,
)
from ..detectors.missing_overlap import overlap_facts
from ..detectors.replayed_gain import replayed
from ..detectors.unshard_async_op import lacks_unshard_async_op, with_unshard_async_op
from ..frameworks import BlockSet, Remedy, RunFacts, checkpoint_blocks
from ..whatif.counterfactuals import resharded_units
from ..whatif.memory_delta import checkpoint_saving
from ..whatif.run_whatif import Change, WhatIfResult

RESHARD_OFF_LINE = "model.set_reshard_after_forward(False)  # no re-gather in backward"


class PlanError(ValueError):
    """A run the planner cannot plan for (the message says why and what to do)."""


@dataclass(frozen=True)
class Plan:
    """One candidate: the change, its replay, its predicted peak and whether it fits."""

    change: Change
    result: WhatIfResult
    predicted_peak_bytes: int | None
    fits_budget: bool | None  # None: no budget, or no measured peak to judge it
    # the predicted step is a lower bound (a CPU run's split: its new units' hooks not counted)
    at_least: bool = False

    @property
    def predicted_ms(self) -> float:
        """The job's predicted median step."""
        return self.result.predicted_ms


@dataclass(frozen=True)
class PlanSearch:
    """The ranked plans (best first) and how the search was made."""

    plans: list[Plan]
    measured_ms: float
    measured_peak_bytes: int | None
    budget_bytes: int | None
    framework: str
    grid: list[str]  # the choices searched, in words
    code: str | None  # the best plan as code (None: the best is the run as it is)
    text: str  # what the best plan changes, in words
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Plan:
        """The first plan: the fastest within the budget."""
        return self.plans[0]


def _wrap_choices(ctx: DetectorContext) -> dict[str, RunFacts]:
    """{the containers of a block wrap (`zdiag whatif --wrap`): the RunFacts of its remedy},
    one per module-tree level whose blocks are not units yet (the captured model's levels,
    `wrap_levels`: experts and the mixers around them, say), else the level the first FSDP
    rank's unit names show; empty outside FSDP2 and FSDP1."""
    fw = ctx.sheet.framework
    if fw.name not in ("fsdp2", "fsdp1"):
        return {}
    model = ctx.sheet.model
    out: dict[str, RunFacts] = {}
    if model is not None and not model.inferred:
        for level in wrap_levels(model):
            blocks = model_block_set(model, level)
            if blocks is None or not blocks.containers or not all(blocks.containers):
                continue
            if model_blocks_are_units(model, blocks) is False:
                facts = replace(ctx.sheet.run_facts(fw), blocks=blocks, blocks_are_units=False)
                out.setdefault(",".join(blocks.containers), facts)
        return out
    ledgers = ctx.fsdp_ledgers()
    units = ledgers[0].unit_order if ledgers else []
    pattern = find_block_pattern(units)
    facts = ctx.sheet.run_facts(fw, block_set(pattern), blocks_are_units(pattern, units))
    if facts.blocks_are_units is False and facts.blocks is not None and facts.blocks.containers:
        out[",".join(facts.blocks.containers)] = facts
    return out


def _reshards(ctx: DetectorContext) -> bool:
    """Whether the run's FSDP2 units re-gather in backward (the step models show it)."""
    return any(resharded_units(m) for models in ctx.step_models.values() for m in models)


def _checkpointable(ctx: DetectorContext) -> BlockSet | None:
    """The captured model's blocks, when the run measured what their forward saves (so that
    checkpointing them has a memory figure); None otherwise."""
    blocks = ctx.sheet.model_blocks
    if blocks is None or not blocks.containers:
        return None
    if checkpoint_saving(ctx.sheet.model, ",".join(blocks.containers)) is None:
        return None
    return blocks


def _code(
    ctx: DetectorContext, change: Change, wraps: Mapping[str, RunFacts]
) -> tuple[str | None, str]:
    """The change as code and words, from the framework's remedies: with a wrap, over the
    wrapped level's blocks; without, over the run's own units (`overlap_facts`)."""
    fw = ctx.sheet.framework
    if change.wrap is not None:
        facts = wraps[change.wrap]
    else:
        ledgers = ctx.fsdp_ledgers()
        facts = overlap_facts(ctx, ledgers[0].unit_order if ledgers else [], fw)
    parts: list[Remedy] = []
    if change.checkpoint is not None:  # applied first: before the wrap, as its note says
        remedy = checkpoint_blocks(ctx.sheet.model_blocks, fw.checkpoint_note)
        if remedy is not None:
            parts.append(remedy)
    if change.prefetch:
        remedy = with_unshard_async_op(ctx.sheet, fw, fw.overlap(facts))  # wraps first if finer
        if remedy is not None:
            parts.append(remedy)
    elif change.wrap:
        remedy = fw.wrap_blocks(facts)
        if remedy is not None:
            parts.append(remedy)
    if change.reshard_after_forward is False:
        parts.append(
            Remedy(
                "Keep each unit's gathered parameters from forward to backward "
                "(no re-gather in backward, more memory held).",
                RESHARD_OFF_LINE,
            )
        )
    code = "\n".join(p.code for p in parts if p.code) or None
    return code, " ".join(
        t if t.endswith(".") else t + "." for t in (p.text.strip() for p in parts) if t
    )


def search(
    ctx: DetectorContext,
    *,
    budget_bytes: int | None = None,
    peaks: Mapping[int, int] | None = None,
) -> PlanSearch:
    """Replay every combination of the grid and rank the plans (see the module docstring)."""
    if not ctx.step_models:
        raise PlanError("no rank has a modelled step: the traces hold no step to replay")
    if not ctx.fsdp_ledgers():
        raise PlanError(
            "the traces hold no FSDP or ZeRO collective: there is no wrap or prefetch to plan"
        )
    fw = ctx.sheet.framework
    choices = _wrap_choices(ctx)
    async_op = lacks_unshard_async_op(ctx.sheet, fw)
    wraps: list[str | None] = [None, *choices]
    prefetches: list[int | None] = [None, 1]
    reshards: list[bool | None] = [None] + (
        [False] if fw.name == "fsdp2" and _reshards(ctx) else []
    )
    blocks = _checkpointable(ctx)
    checkpoints: list[str | None] = [None] + ([",".join(blocks.containers)] if blocks else [])
    grid = [
        "wrap: as measured" + "".join(f", each block one unit ({w})" for w in choices),
        "prefetch: as measured, depth 1" + (" with the async unshard" if async_op else ""),
        "reshard_after_forward: as measured" + (", off" if len(reshards) > 1 else ""),
        f"activation checkpointing: none, each block ({checkpoints[1]})"
        if blocks
        else "activation checkpointing: not searched (the run did not measure what its blocks "
        "save for backward: record it with `zdiag run --profile-memory`)",
    ]
    peak = max(peaks.values()) if peaks else None
    plans: list[Plan] = []
    for w, p, r, c in itertools.product(wraps, prefetches, reshards, checkpoints):
        change = Change(prefetch=p, reshard_after_forward=r, wrap=w, checkpoint=c,
                        unshard_async_op=bool(p) and async_op)  # fmt: skip
        result = replayed(ctx, change)
        if result is None:
            continue
        delta = result.memory_delta_bytes
        predicted_peak = None if peak is None or delta is None else peak + delta
        fits = (
            None
            if budget_bytes is None or predicted_peak is None
            else predicted_peak <= budget_bytes
        )
        at_least = ctx.sheet.cpu_only and result.lower_bound
        plans.append(Plan(change, result, predicted_peak, fits, at_least))
    if not plans:
        raise PlanError("the replay could not run on this run's step models")
    baseline = next(pl for pl in plans if pl.change == Change())
    none_fit = budget_bytes is not None and all(pl.fits_budget is False for pl in plans)
    # on CPU every call blocks, so a split's new units cost their hooks, which a one-unit run
    # does not show: its predicted step is a lower bound and cannot beat an exact prediction
    plans.sort(
        key=lambda pl: (
            pl.fits_budget is False,
            (pl.predicted_peak_bytes or 0) if none_fit else 0,  # then the nearest the budget
            pl.at_least,
            round(pl.predicted_ms, 3),
            _size(pl.change),
        )
    )
    notes: list[str] = []
    if any(pl.at_least for pl in plans):
        notes.append(
            "on this CPU run a plan that splits a unit the run shows alone predicts only a lower "
            "bound of its step (the new units' hooks are not counted): such plans rank after "
            "the plans predicted exactly, within the budget"
        )
    if budget_bytes is not None and peak is None:
        notes.append(
            "the run recorded no peak memory (zdiag run --profile-memory, or CUDA snapshots): the "
            "budget cannot be judged, plans are ranked by step time and their memory deltas shown"
        )
    if none_fit:
        notes.append(
            "no plan fits the budget: the plans are ranked by predicted peak, the lowest first"
        )
    best = plans[0]
    if best.result.lower_bound and not best.at_least:
        notes.append(
            "the best plan splits a unit the run shows alone: its predicted step leaves out the "
            "new units' hooks (a one-unit run does not show them), so the step will be longer"
        )
    code, text = (None, "") if best.change == Change() else _code(ctx, best.change, choices)
    return PlanSearch(
        plans=plans,
        measured_ms=baseline.result.measured_ms,
        measured_peak_bytes=peak,
        budget_bytes=budget_bytes,
        framework=fw.title,
        grid=grid,
        code=code,
        text=text,
        notes=notes,
    )


def _size(change: Change) -> int:
    """How many things a change changes (fewer first among equally fast plans)."""
    return sum(
        x not in (None, False)
        for x in (change.prefetch, change.reshard_after_forward, change.wrap, change.checkpoint)
    )
