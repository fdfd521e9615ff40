"""A change's estimated peak-memory delta, and how it was estimated.

The schedule's changes count the FSDP units' gathered bytes held at once (a wrap, a prefetch
depth, units kept from forward to backward, a split unit's blocks); a mesh shape counts the
sharded parameters, gradients and optimizer states (`mesh_shape.mesh_memory_delta`);
checkpointing and micro-batches count what the model's forward saved for backward, by block, as
the run measured it (`zdiag run --profile-memory`: the model description's `activations`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ..inputs.model_facts import ModelFacts
from ..rank.step_model import StepModel
from . import counterfactuals as cf
from .change import Change
from .finer_wrap import WrapSplit, split_memory_delta
from .mesh_shape import DpGroups, mesh_memory_delta

MIB = 2**20
NO_CHANGE = "no change in what is held"
"""The memory basis of a change that holds nothing more or less."""


def memory_delta(
    models: Sequence[StepModel],
    change: Change,
    split: WrapSplit | None = None,
    groups: Mapping[int, DpGroups] | None = None,
    model: ModelFacts | None = None,
) -> tuple[int | None, str]:
    """The change's estimated peak-memory delta, and how it was estimated: the schedule's
    (`schedule_memory_delta`), plus a mesh shape's on the ranks' data-parallel `groups`, less
    what checkpointing frees (`checkpoint_saving`, from the captured `model`'s activations)."""
    if change.checkpoint is not None and change.micro_batches is not None:
        return None, (
            "unknown: checkpointing and micro-batches together (each one's saving is estimated "
            "alone; what checkpointing frees shrinks with the micro-batch)"
        )
    if change.micro_batches is not None:
        rest, basis = memory_delta(
            models, dataclasses.replace(change, micro_batches=None), split, groups, model
        )
        shift = micro_batch_delta(model, models, change.micro_batches)
        if shift is None:
            return None, (
                f"unknown: activations shrink about {change.micro_batches}-fold and the "
                "gradients are held unsharded between micro-batches, and the run did not "
                "measure its activations (record it with `zdiag run --profile-memory`)"
            )
        if rest is None:
            return None, f"{basis}; {shift[1]}"
        return rest + shift[0], shift[1] if basis == NO_CHANGE else f"{shift[1]}; {basis}"
    if change.checkpoint is not None:
        rest, basis = memory_delta(
            models, dataclasses.replace(change, checkpoint=None), split, groups, model
        )
        saving = checkpoint_saving(model, change.checkpoint)
        if saving is None:
            return None, (
                "unknown: checkpointing frees the blocks' saved activations less their inputs, "
                "and the run did not measure them (record it with `zdiag run --profile-memory`, "
                "which measures what each block's forward saves for backward)"
            )
        freed, how = saving
        if rest is None:
            return None, f"{basis}; {how}"
        return rest - freed, how if basis == NO_CHANGE else f"{how}; {basis}"
    delta, basis = schedule_memory_delta(models, change, split)
    if not groups or change.mesh_shape is None:
        return delta, basis
    captured = model.description.param_bytes if model is not None else None
    d, b = mesh_memory_delta(
        captured or sum(cf.unit_gather_bytes(models).values()),
        next(iter(groups.values())),
        change.mesh_shape,
        model.optimizer_classes if model is not None else (),
        gathered=not captured,
    )
    total = None if delta is None or d is None else delta + d
    return total, b if basis == NO_CHANGE else f"{basis}; {b}"


def checkpoint_saving(model: ModelFacts | None, prefix: str) -> tuple[int, str] | None:
    """(bytes, how) checkpointing each child of `prefix` (comma-separated containers) frees at
    the end of forward, from what the run measured each block's forward save for backward:
    everything they saved, less their inputs (checkpointing keeps them) and the largest
    block's saved tensors (its recompute holds them again in backward). None without the
    measurement, or with fewer than two blocks under `prefix`."""
    act = model.description.activations if model is not None else None
    if act is None:
        return None
    containers = {c.strip(".") for c in prefix.split(",")}
    blocks = [b for b in act.blocks if b.path.rpartition(".")[0] in containers]
    if len(blocks) < 2:
        return None
    saved = sum(b.saved_bytes for b in blocks)
    kept = sum(b.input_bytes for b in blocks)
    again = max(b.saved_bytes for b in blocks)
    return max(0, saved - kept - again), (
        f"checkpointing frees what the {len(blocks)} blocks' forward saved for backward "
        f"({saved / MIB:.1f} MiB, measured in the run's first forward) less their inputs, which "
        f"it keeps ({kept / MIB:.1f} MiB), and one block's saved tensors, held again by its "
        f"recompute in backward ({again / MIB:.1f} MiB): at a peak at the end of forward"
    )


def micro_batch_delta(
    model: ModelFacts | None, models: Sequence[StepModel], k: int
) -> tuple[int, str] | None:
    """(bytes, how) of K micro-batches with gradient accumulation at a peak at the end of a
    later micro-batch's forward: the activations the run measured shrink K-fold, and the
    gradients of the earlier micro-batches are held unsharded (FSDP's units: their gathered
    bytes; without FSDP units, the model's parameter bytes), where the measured step's forward
    held none (`zero_grad` sets them to None). None without the measurement."""
    act = model.description.activations if model is not None else None
    if act is None or model is None:
        return None
    freed = act.saved_bytes - act.saved_bytes // k
    units = cf.unit_gather_bytes(models)
    grads = sum(units.values()) if units else model.description.param_bytes
    held = "its FSDP units' unsharded gradients" if units else "the model's gradients"
    return grads - freed, (
        f"{k} micro-batches: the forward's saved tensors ({act.saved_bytes / MIB:.1f} MiB, "
        f"measured in the run's first forward) shrink to 1/{k}, and {held} "
        f"({grads / MIB:.1f} MiB) are held from one micro-batch to the next: at a peak at "
        "the end of a later micro-batch's forward"
    )


def schedule_memory_delta(
    models: Sequence[StepModel], change: Change, split: WrapSplit | None = None
) -> tuple[int | None, str]:
    """The peak-memory delta of the schedule changes (wrap, prefetch, reshard, ...)."""
    sizes = cf.unit_gather_bytes(models)
    if split is not None:  # blocks held at once: all when kept from forward to backward
        held = len(split.blocks) if change.reshard_after_forward is False else None
        return split_memory_delta(split, sizes, held or 1 + max(1, change.prefetch or 1))
    needs_sizes = (
        change.wrap
        or change.prefetch
        or change.reshard_after_forward is False
        or change.bf16_params
    )
    if not needs_sizes:
        return 0, NO_CHANGE
    if not sizes:
        return None, "unknown: the traces record no FSDP message sizes (record_shapes)"
    largest = max(sizes.values())
    delta, how = 0, []
    if change.bf16_params:
        depth = max((cf.measured_depth(m) for m in models), default=0)
        delta -= (1 + depth) * largest // 2
        how.append(f"half of the {1 + depth} largest gathered unit(s) held at once, in bf16")
    if change.wrap is not None:
        merged: dict[str, int] = {}
        for unit, b in sizes.items():
            key = cf.wrap_key(unit, change.wrap) or unit
            merged[key] = merged.get(key, 0) + b
        delta += max(merged.values()) - largest
        how.append("the largest unit after the wrap, gathered, against the largest now")
    if change.reshard_after_forward is False:
        kept = {u for m in models for u in cf.resharded_units(m)}
        held = sum(sizes.get(u, 0) for u in kept)
        delta += max(0, held - max((sizes.get(u, 0) for u in kept), default=0))
        how.append("units kept gathered from forward to backward")
    if change.prefetch is not None:
        depth = max((cf.measured_depth(m) for m in models), default=0)
        extra = max(0, change.prefetch - depth)
        delta += extra * largest
        how.append(f"{extra} more unit(s) gathered ahead (measured depth {depth})")
    return delta, "; ".join(how)
