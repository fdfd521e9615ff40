"""What each what-if change assumes on a run, or why it cannot apply there: the notes
`run_whatif.replay_change` prints with a result, and the WhatIfError it raises instead."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..inputs.model_facts import ModelFacts
from ..rank.step_model import StepModel
from . import counterfactuals as cf
from .mesh_shape import (
    DpGroups,
    Fabric,
    MeshShapeError,
    all_reduced_once,
    check_shape,
    dp_groups,
)
from .micro_batch import passes_span


class WhatIfError(ValueError):
    """A change that cannot be applied to this run (the message says why and what to do)."""


def checkpoint_notes(models: Sequence[StepModel], prefix: str) -> list[str]:
    """What the checkpointing replay could not place (or WhatIfError when nothing)."""
    spans = [cf.block_forwards(m, prefix) for m in models]
    if not any(spans):
        blocks = sorted({cf.wrap_key(op.unit, prefix) or "" for m in models for op in m.ops})
        blocks = [b for b in blocks if b]
        raise WhatIfError(
            f"checkpointing the children of '{prefix}' needs at least two of them gathered as "
            f"FSDP units in forward (found: {', '.join(blocks) or 'none'}); give the module "
            "whose children are the repeated blocks"
        )
    missing = max(cf.checkpointed(m, prefix)[1] for m in models)
    notes = [
        "checkpointing: each block's forward (the progress from its forward gather to the "
        "next block's; the last block as the median of the others) runs again where its "
        "backward gather is consumed"
    ]
    if missing:
        notes.append(
            f"{missing} block(s) have no backward gather (kept unsharded after forward), so "
            "their recompute has no position and is left out: the prediction is low by it"
        )
    return notes


def mesh_groups(
    by_rank: Mapping[int, list[StepModel]],
    shape: tuple[int, int] | None,
    sizes: Mapping[int, Mapping[str, int]],
    world: int | None,
    model: ModelFacts | None,
) -> dict[int, DpGroups]:
    """Each rank's data-parallel groups, checked against `shape` when given (or WhatIfError)."""
    mesh = model.mesh if model is not None else None
    try:
        groups = {
            r: dp_groups(ms, sizes.get(r, {}), world=world, mesh=mesh) for r, ms in by_rank.items()
        }
        shapes = {g.shape for g in groups.values()}
        if len(shapes) > 1:
            raise MeshShapeError(
                "the ranks' FSDP groups differ in size ("
                + ", ".join("{} x {}".format(*s) for s in sorted(shapes))
                + "): no one mesh shape to change"
            )
        if shape is not None:
            check_shape(next(iter(groups.values())), shape)
    except MeshShapeError as exc:
        raise WhatIfError(str(exc)) from exc
    return groups


def all_reduce_notes(
    by_rank: Mapping[int, list[StepModel]], groups: Mapping[int, DpGroups]
) -> list[str]:
    """What the all-reduce-once replay drops (or WhatIfError when it drops nothing)."""
    if any(g.replicate_group is None for g in groups.values()):
        raise WhatIfError(
            "--all-reduce-once drops HSDP's replicate all-reduces, and this run has none (its "
            "FSDP reduces all run in the shard group)"
        )
    dropped = max(all_reduced_once(m, groups[r])[1] for r, ms in by_rank.items() for m in ms)
    if not dropped:
        raise WhatIfError(
            "each unit's gradients are all-reduced across the replicas once per step already "
            "(one micro-batch, or set_requires_all_reduce(False) before the last)"
        )
    return [
        f"all-reduce once: each unit's replicate all-reduces kept in its last micro-batch only "
        f"(up to {dropped} per step dropped; set_requires_all_reduce(False) before the last)"
    ]


def _unit_dtypes(model: ModelFacts | None, *, reduce: bool) -> set[str]:
    """The captured FSDP2 units' gradient-reduce (`reduce`) or parameter-gather dtypes: their
    mixed-precision policy's, else their parameters'; empty without a captured model."""
    units = model.description.fsdp2_units if model is not None else ()
    out = set()
    for u in units:
        mp = u.mixed_precision
        if mp is None:
            out.add(str(u.dtype or ""))
        else:
            policy = (mp.reduce_dtype or mp.param_dtype) if reduce else mp.param_dtype
            out.add(str(policy or u.dtype or ""))
    return out


def _all_16_bits(dtypes: set[str]) -> bool:
    """Whether every dtype of a non-empty set is bf16 or fp16."""
    return bool(dtypes) and all(d.removeprefix("torch.") in ("bfloat16", "float16") for d in dtypes)


CPU_BF16_REDUCE = (
    "on CPU/gloo a bf16 reduce is not cheaper: gloo sums bf16 on the host and the casts cost "
    "more than the halved bytes save (a GPT-2 on a (2, 2) mesh ran about 95 ms per step slower "
    "with it); the replay's halved bytes hold on NCCL"
)


def bf16_reduce_notes(
    models: Sequence[StepModel], model: ModelFacts | None, device: str
) -> list[str]:
    """What the bf16-reduce replay assumes (or WhatIfError where it cannot apply)."""
    if device == "cpu":
        raise WhatIfError(CPU_BF16_REDUCE)
    if not any(op.family and op.family != cf.GATHER for m in models for op in m.ops):
        raise WhatIfError(
            "--reduce-dtype bf16 halves the FSDP gradient reduces, and the traces hold none "
            "(FSDP and ZeRO runs only)"
        )
    dtypes = _unit_dtypes(model, reduce=True)
    if _all_16_bits(dtypes):
        raise WhatIfError("the run reduces its gradients in 16 bits already")
    known = "" if dtypes else " (the captured model does not say: taken as fp32 now)"
    return [
        "bf16 reduce: each FSDP reduce keeps its lane's fitted latency and moves half its bytes"
        f"{known}; the casts to bf16 and back are left out"
    ]


CPU_BF16_PARAMS = (
    "on CPU a bf16 parameter gather also moves the model's math to bf16, which CPUs run at "
    "another speed than fp32 (often slower), so the measured compute says nothing of it; the "
    "replay's halved gathers, with compute kept as measured, hold on GPUs"
)


def bf16_params_notes(
    models: Sequence[StepModel], model: ModelFacts | None, device: str
) -> list[str]:
    """What the bf16-gather replay assumes (or WhatIfError where it cannot apply)."""
    if device == "cpu":
        raise WhatIfError(CPU_BF16_PARAMS)
    if not any(op.family == cf.GATHER for m in models for op in m.ops):
        raise WhatIfError(
            "--param-dtype bf16 halves the FSDP parameter all-gathers, and the traces hold none "
            "(FSDP and ZeRO runs only)"
        )
    dtypes = _unit_dtypes(model, reduce=False)
    if _all_16_bits(dtypes):
        raise WhatIfError("the run gathers its parameters in 16 bits already")
    known = "" if dtypes else " (the captured model does not say: taken as fp32 now)"
    return [
        "bf16 parameters: each FSDP all-gather keeps its lane's fitted latency and moves half "
        f"its bytes{known}; compute is kept as measured, though bf16 math runs faster on GPUs: "
        "the gain is a lower bound"
    ]


def mesh_notes(
    by_rank: Mapping[int, list[StepModel]],
    groups: Mapping[int, DpGroups],
    shape: tuple[int, int],
    fabric: Fabric | None = None,
) -> list[str]:
    """What the mesh-shape replay assumed (`fabric`: the run's nodes, when it has several)."""
    g = next(iter(groups.values()))
    r, s = shape
    replicas = f"an all-reduce of each gradient shard over {r}" if r > 1 else "no all-reduce"
    notes = [
        f"mesh shape: the run's FSDP ranks are {g.replicate} x {g.shard} (replicate x shard), "
        f"replayed as {r} x {s}: gathers and reduce-scatters as ring collectives over {s} "
        f"rank(s), {replicas} across replicas (docs/whatif.md)"
    ]
    if fabric is not None:
        notes.append(_fabric_note(fabric, g.shape, shape))
    if g.replicate == 1 and r > 1:
        notes.append(
            "the run has no replicate group to fit: its new all-reduces are costed from the "
            "shard group's links"
            + (" (a single-node run: across nodes they would be slower)" if fabric is None else "")
        )
    if g.shard != s:
        if any(m.optimizer for ms in by_rank.values() for m in ms):
            notes.append(f"the optimizer steps scaled by {g.shard}/{s} (the shard each rank holds)")
        else:
            notes.append(
                "the traces hold no optimizer-step range: its change with the shard "
                f"({g.shard}/{s}) is left out"
            )
    return notes


def _fabric_note(fabric: Fabric, before: tuple[int, int], after: tuple[int, int]) -> str:
    """Which groups cross nodes before and after, and the link speeds assumed."""

    def where(shape: tuple[int, int], group: str) -> str:
        if group == "replicate" and shape[0] == 1:
            return "none"
        return "across nodes" if fabric.crosses(shape, group) else "inside a node"

    moved = [
        f"{group} groups {where(before, group)} -> {where(after, group)}"
        for group in ("shard", "replicate")
        if (group == "shard" or after[0] > 1)
    ]
    return (
        f"nodes of {fabric.ranks_per_node} ranks, the mesh laid out row-major: "
        + ", ".join(moved)
        + f"; a group inside one node moves bytes {fabric.intra_node_speedup:g}x as fast as one "
        "across nodes (assumed, not measured: --intra-node-speedup), latencies as measured"
    )


def micro_batch_notes(models: Sequence[StepModel], k: int) -> list[str]:
    """What the micro-batch replay assumes (or WhatIfError when it cannot place them)."""
    if k < 2:
        raise WhatIfError(f"--micro-batches takes 2 or more (got {k})")
    if any(passes_span(m) is None for m in models):
        raise WhatIfError(
            "micro-batches are placed between the first FSDP gather and the last reduce of each "
            "step, and some modelled steps have no FSDP gather or reduce (FSDP and ZeRO runs "
            "only)"
        )
    return [
        f"micro-batches: the passes run {k} times, their compute at 1/{k} (taken as linear in "
        "the batch: low where a micro-batch gets small), FSDP's hooks, host syncs and gathers "
        "at full length each time, gradients reduced in the last one only (docs/whatif.md)"
    ]
