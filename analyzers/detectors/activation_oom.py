"""`activation-oom`: out of memory (or over budget) with the peak dominated by activations, or
with activations a quarter or more of it when checkpointing them alone would have made the
failing allocation fit.

Evidence comes from the memory timeline's categories at the peak, a CUDA snapshot's breakdown
(whose checkpointing what-if gives the gain when the harness shape is unknown), or from the
out-of-memory record (zdiag's harness names activations, unsharded parameters and model state
in it). The fix for activation memory is activation checkpointing of the repeated block (only
each block's input is kept) or a smaller micro-batch with gradient accumulation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..frameworks import BlockSet, checkpoint_blocks
from ..inputs.model_facts import ModelFacts
from ..report import Finding, WhatIf
from .blocks import BlockPattern, find_block_pattern, harness_block_pattern
from .context import MIB, DetectorContext, MemoryEvidence
from .facts import block_set
from .rule import Rule, Threshold

# (the reasoning behind each value: RULE's thresholds, at the end of the module)
ACTIVATION_SHARE = 0.5
ACTIVATION_MIN_SHARE = 0.25
ACTIVATION_CATEGORIES = ("ACTIVATION", "AUTOGRAD_DETAIL")
MIN_SAVED_TENSORS_PER_BLOCK = 8


def _activation_bytes(ev: MemoryEvidence) -> int:
    return sum(ev.category_bytes.get(c, 0) for c in ACTIVATION_CATEGORIES)


def _checkpointing_fits(ev: MemoryEvidence, act: int, in_use: int) -> bool:
    """Whether freeing the activations checkpointing frees (all but 1/MIN_SAVED_TENSORS_PER_BLOCK)
    covers the overflow: the failing request (peak minus what was in use) or the peak's excess
    over the capacity, whichever is larger. False when the peak is unknown."""
    if ev.peak_bytes is None:
        return False
    overflow = max(ev.peak_bytes - in_use, ev.peak_bytes - (ev.capacity_bytes or ev.peak_bytes))
    freed = act - act // MIN_SAVED_TENSORS_PER_BLOCK
    return overflow > 0 and freed >= overflow


def _dominated(ev: MemoryEvidence) -> bool:
    """Gating: out of memory (or over capacity) with activations >= ACTIVATION_SHARE of the
    memory in use, or >= ACTIVATION_MIN_SHARE when checkpointing them covers the overflow."""
    in_use = sum(ev.category_bytes.values())
    act = _activation_bytes(ev)
    over = ev.oom or (
        ev.capacity_bytes is not None
        and ev.peak_bytes is not None
        and ev.peak_bytes > ev.capacity_bytes
    )
    return (
        over
        and in_use > 0
        and (
            act >= ACTIVATION_SHARE * in_use
            or (act >= ACTIVATION_MIN_SHARE * in_use and _checkpointing_fits(ev, act, in_use))
        )
    )


@dataclass(frozen=True)
class _ForwardShare:
    """How far the forward had gone at a failure inside it: in block `block`, so `done` of
    `total` blocks (`_forward_share` says how much of the failing block counts)."""

    block: str
    done: float
    total: int

    @property
    def factor(self) -> float:
        """A whole forward's activations over those held at the failure (blocks save alike)."""
        return self.total / self.done

    def describe(self, act: int) -> str:
        """The extrapolation in words, for the gain's method."""
        return (
            f"the forward failed in {self.block}, {self.done:.2f} of {self.total} blocks done "
            "(of the failing block: its children before the one it failed in and half of that "
            f"one, else half the block): a whole forward holds about {self.factor:.2f}x the "
            f"{act / MIB:.2f} MiB of activations held at the failure, "
            f"{act * self.factor / MIB:.2f} MiB (repeated blocks save alike); "
        )


def _children(model: ModelFacts | None, block: str, template: str) -> list[str]:
    """The names of a block's direct children in the description's (definition) order; the
    `template` block's where the description collapsed this one's subtree."""
    if model is None:
        return []
    for path in (block, template):
        depth = path.count(".") + 1 if path else 0
        prefix = f"{path}." if path else ""
        names = [
            m.path[len(prefix) :]
            for m in model.description.modules
            if m.path.startswith(prefix) and m.path.count(".") == depth and m.path
        ]
        if names:
            return names
    return []


def _containers_in_order(
    blocks: BlockSet, model: ModelFacts | None
) -> list[tuple[str, int]] | None:
    """The block containers with their block counts, in the order the forward is taken to run
    them: one container with the set's count, or several in the description's (definition)
    order with each one's own count (an encoder's blocks, then a decoder's); None when a
    count is not known."""
    if len(blocks.containers) == 1:
        return [(blocks.containers[0], blocks.count)] if blocks.count else None
    if model is None:
        return None
    counts = {rs.path: rs.count for rs in model.description.repeated}
    keys = {c: model.definition_key(c) for c in blocks.containers}
    if any(not counts.get(c) or keys[c] is None for c in blocks.containers):
        return None
    return [(c, counts[c]) for c in sorted(blocks.containers, key=lambda c: keys[c] or ())]


def _forward_share(
    ev: MemoryEvidence, blocks: BlockSet | None, model: ModelFacts | None
) -> _ForwardShare | None:
    """Where in the blocks the forward failed (the OOM record's innermost module inside one),
    None for a failure in backward or outside the blocks, or when the blocks' counts are not
    known. Blocks in several containers run container after container, in definition order.
    Within the failing block, the child it failed in counts, its children taken to run in the
    order they are defined (half of that child done), else half the block."""
    if ev.in_backward or not ev.modules or blocks is None:
        return None
    containers = _containers_in_order(blocks, model)
    if not containers:
        return None
    total = sum(n for _, n in containers)
    for path in reversed(ev.modules):
        before = 0
        for container, count in containers:
            prefix = f"{container}." if container else ""
            head, _, rest = (
                path[len(prefix) :].partition(".") if path.startswith(prefix) else ("", "", "")
            )
            if head.isdigit() and int(head) < count:
                within = 0.5
                children = _children(model, prefix + head, f"{prefix}0")
                child = rest.split(".", 1)[0]
                if child in children:
                    within = (children.index(child) + 0.5) / len(children)
                return _ForwardShare(prefix + head, before + int(head) + within, total)
            before += count
    return None


def _saved(
    ctx: DetectorContext,
    h: Mapping[str, Any],
    act: int,
    rank: int,
    share: _ForwardShare | None = None,
) -> tuple[int, str]:
    """(bytes checkpointing frees at the whole forward's peak, how): the harness's shape (every
    block keeps its input), else the snapshot's checkpointing what-if, else at least 7/8 of the
    activations. A failure partway through the forward (`share`) scales what was held at the
    failure to a whole forward's."""
    scale = share.factor if share is not None else 1.0
    whole = int(act * scale)
    lead = share.describe(act) if share is not None else ""
    at = "a whole forward" if share is not None else "the failure"
    try:
        width = 2 if h.get("precision") == "bf16" else 4
        kept = int(h["batch"]) * int(h["seq"]) * int(h["dim"]) * width * int(h["layers"])
        return max(0, whole - kept), lead + (
            "activation checkpointing of every block keeps only each block's input "
            f"(batch x seq x dim x {width} bytes x {h['layers']} blocks = {kept / MIB:.2f} MiB) "
            f"of the {whole / MIB:.2f} MiB activations at {at}"
        )
    except (KeyError, TypeError, ValueError):
        pass
    predicted = _checkpointing_what_if(ctx, rank)
    if predicted is not None and predicted.saved_bytes is not None:
        scaled = f", x {scale:.2f}" if share is not None else ""
        return int(predicted.saved_bytes * scale), (
            f"{lead}from the snapshot at the {'failure' if share else 'peak'}: "
            f"{predicted.arithmetic}{scaled}"
        )
    kept = whole // MIN_SAVED_TENSORS_PER_BLOCK
    return max(0, whole - kept), lead + (
        f"activation checkpointing frees at least {MIN_SAVED_TENSORS_PER_BLOCK - 1}/"
        f"{MIN_SAVED_TENSORS_PER_BLOCK} of the {whole / MIB:.2f} MiB activations at {at} (a "
        f"block saves >= {MIN_SAVED_TENSORS_PER_BLOCK} input-sized tensors; checkpointing keeps "
        "one)"
    )


def _accumulation(worst: MemoryEvidence, act: int, h: Mapping[str, Any], whole: int) -> str:
    """The alternative: N micro-batches with gradient accumulation, N so that the activations
    of one (a whole forward's: `whole`) fit in what the `act` held at the failure left under
    the capacity, when the overflow is known."""
    over_by = None
    if worst.capacity_bytes is not None and worst.peak_bytes is not None:
        over_by = max(0, worst.peak_bytes - worst.capacity_bytes)
    accum = None
    if over_by is not None and act > over_by:
        accum = max(2, math.ceil(whole / (act - over_by)))
    if accum and isinstance(h.get("batch"), int):
        return (
            f" Or split each batch into {accum} micro-batches with gradient accumulation "
            f"(batch {h['batch']} -> {max(1, int(h['batch']) // accum)})."
        )
    if accum:
        return f" Or split each batch into {accum} micro-batches with gradient accumulation."
    return " Or use a smaller micro-batch with gradient accumulation."


def _block(ctx: DetectorContext) -> BlockPattern | None:
    """The repeated block to checkpoint: the harness's, else from the manifest's and the
    ledgers' unit names."""
    return harness_block_pattern(dict(ctx.sheet.harness)) or find_block_pattern(
        [u.name for u in ctx.manifest_units()]
        + [n for lg in ctx.fsdp_ledgers() for n in lg.unit_order]
    )


def detect(ctx: DetectorContext) -> list[Finding]:
    """The activation-oom finding, or none."""
    hits = [ev for ev in ctx.memory if _dominated(ev)]
    if not hits:
        return []
    worst = max(hits, key=_activation_bytes)
    act = _activation_bytes(worst)
    in_use = sum(worst.category_bytes.values())
    h = ctx.sheet.harness
    blocks = ctx.sheet.model_blocks or block_set(_block(ctx))
    share = _forward_share(worst, blocks, ctx.sheet.model)
    saved, method = _saved(ctx, h, act, worst.rank, share)
    remedy = checkpoint_blocks(blocks, ctx.sheet.framework.checkpoint_note)
    containers = (_containers_in_order(blocks, ctx.sheet.model) if blocks else None) or []
    units = [f"{c}.{i}" if c else str(i) for c, count in containers for i in range(count)]
    return [
        Finding(
            id="activation-oom",
            severity="critical",
            title=(
                f"{'Out of memory' if worst.oom else 'Over the memory budget'}: activations are "
                f"{act / MIB:.1f} MiB of {in_use / MIB:.1f} MiB in use ({act / in_use:.0%})"
            ),
            ranks=sorted({ev.rank for ev in hits}),
            units=units,
            evidence={
                "source": worst.source,
                "oom": worst.oom,
                "activation_bytes": act,
                "in_use_bytes": in_use,
                "activation_share": round(act / in_use, 3),
                "threshold_activation_share": ACTIVATION_SHARE,
                "threshold_min_activation_share_when_checkpointing_fits": ACTIVATION_MIN_SHARE,
                "capacity_bytes": worst.capacity_bytes,
                "peak_bytes": worst.peak_bytes,
                "category_bytes": dict(worst.category_bytes),
                "activation_checkpointing": h.get("ac"),
                **(
                    {
                        "failed_in_block": share.block,
                        "blocks_done_at_failure": f"{share.done:.2f} of {share.total}",
                        "whole_forward_activation_bytes": int(act * share.factor),
                    }
                    if share is not None
                    else {}
                ),
            },
            recommendation=(
                f"Checkpoint the activations of each "
                f"{blocks.describe() if blocks is not None else 'transformer block'}"
                f" (recompute in backward): frees about {saved / MIB:.1f} MiB"
                f"{' at the whole forward' if share is not None else ''}."
                + _accumulation(worst, act, h, int(act * share.factor) if share else act)
            ),
            code=remedy.code if remedy else None,
            expected_gain_bytes=saved,
            gain_method=method,
        )
    ]


def _checkpointing_what_if(ctx: DetectorContext, rank: int) -> WhatIf | None:
    """The snapshot breakdown's checkpointing prediction for `rank` (snapshot_whatif.py)."""
    for b in ctx.memory_breakdowns:
        if b.rank == rank:
            return next(
                (w for w in b.what_if if w.change.startswith("activation checkpointing")), None
            )
    return None


RULE = Rule(
    id="activation-oom",
    summary="out of memory with activations filling it",
    detect=detect,
    what=(
        "Out of memory (or the peak over capacity) with activations >= 50% of the memory in "
        "use, or >= 25% when freeing 7/8 of them covers the overflow (the failing request or "
        "the excess over capacity: large parameter state beside them). An OOM before the "
        "profiler window still has its `memory/rank-N.oom.json` record: torch's wording, "
        "zdiag's harness wording and a memory-budget hook's (`budget 48.0 MiB, 29.27 MiB held "
        "by saved activations`) are parsed, the rest of the budget counting as `OTHER`."
    ),
    why=(
        "When activations fill the memory, no parameter or optimizer change is the bigger "
        "lever: activation checkpointing of the repeated block keeps only each block's input, "
        "and a smaller micro-batch with gradient accumulation shrinks them all."
    ),
    example=(
        "Out of memory: activations are 27.1 MiB of 29.8 MiB in use (91%) (the harness's "
        "batch 8 x seq 1024 without checkpointing, under a 30 MiB budget)."
    ),
    fix=(
        "`apply_activation_checkpointing` on each block; or N micro-batches with gradient "
        "accumulation."
    ),
    gain=(
        "Activations minus the block inputs checkpointing keeps (batch x seq x dim x bytes x "
        "blocks); without the shape, the snapshot's checkpointing what-if, else at least 7/8. "
        "When the OOM record says the forward failed in block k of N (0-based; the module "
        "whose forward was running; several containers, an encoder's and a decoder's, run in "
        "definition order), what was held there is scaled to a whole forward's, x N / (k + f): "
        "repeated blocks save alike; f is (j + 1/2) / m when it failed in the block's j-th of m "
        "children (taken to run in the order they are defined), else 1/2."
    ),
    scope=(
        "runs with memory evidence: OOM records, CUDA snapshots with allocation stacks, "
        "memory timelines"
    ),
    thresholds=(
        Threshold(
            "ACTIVATION_SHARE",
            ACTIVATION_SHARE,
            "Dominated: activations are at least this share of the memory in use at the peak "
            "or the failure, so no other category (parameters, gradients, optimizer state) "
            "could be the bigger lever.",
            evidence="threshold_activation_share",
        ),
        Threshold(
            "ACTIVATION_MIN_SHARE",
            ACTIVATION_MIN_SHARE,
            "Or this smaller share, when checkpointing them alone would have made the failing "
            "allocation fit: a model with large parameter state (an embedding-heavy "
            "recommender: activations 36% of the budget) still fails because of them.",
            evidence="threshold_min_activation_share_when_checkpointing_fits",
        ),
        Threshold(
            "MIN_SAVED_TENSORS_PER_BLOCK",
            MIN_SAVED_TENSORS_PER_BLOCK,
            "Without the model shape: a transformer block saves at least this many tensors "
            "the size of its input for backward (norm outputs, q/k/v, attention output, the "
            "MLP's hidden states) and checkpointing keeps only the input, so at least 7/8 of "
            "the activations are freed.",
        ),
    ),
)
