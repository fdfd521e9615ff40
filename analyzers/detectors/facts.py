"""The facts about a user's run that the detectors hand to the framework remedies.

Pure functions of a model description or of module names; the run's own facts, derived once
from them, are the detectors' fact sheet (detectors/fact_sheet.py). First from the model
description captured from the live model (analyzers/inputs/model_facts.py): the repeated blocks
to wrap, chosen by model_facts' granularity rule and named by the user's own container paths
and classes, whether they already are FSDP units, and the settings the run has (so no remedy
proposes one of them). Without a description (traces recorded elsewhere) the same `BlockSet`
values are inferred from trace labels (FSDP unit names, `with_stack` module events), the
manifest's units and the harness's recorded options.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..frameworks import BlockSet, FsdpMesh
from ..inputs.model_facts import BlockCandidate, ModelFacts
from .blocks import BlockPattern

MODEL_SOURCE = "model description"


def block_set(
    pattern: BlockPattern | None,
    module_class: tuple[str, int] | None = None,
    source: str = "trace labels",
) -> BlockSet | None:
    """The repeated blocks as remedies take them, inferred: the `<list>.<N>` pattern found in
    module names (container path and count), else a class repeated in `with_stack` module
    events."""
    if pattern is not None:
        return BlockSet(container=pattern.list_path, count=pattern.count, source=source)
    if module_class is not None:
        return BlockSet(block_class=module_class[0], count=module_class[1], source=source)
    return None


def _inside_blocks(path: str, container: str) -> bool:
    """Whether module `path` lies inside one of the blocks held by `container`."""
    return path.startswith(container + ".") if container else path != ""


def wrap_candidates(model: ModelFacts) -> list[BlockCandidate]:
    """The block classes a wrap should name: the best candidate by model_facts' granularity rule,
    plus every other candidate that is not too fine and whose blocks neither contain nor lie in
    the chosen ones (an encoder's towers and a decoder's towers of another class: both are
    blocks at the same granularity; experts inside a chosen mixer are not)."""
    ranked = model.block_candidates()
    if not ranked:
        return []
    chosen = [ranked[0]]
    for cand in ranked[1:]:
        if cand.too_fine:
            continue
        nested = any(
            _inside_blocks(a, b) or _inside_blocks(b, a)
            for c in chosen
            for a in cand.containers
            for b in c.containers
        )
        if not nested:
            chosen.append(cand)
    return chosen


def wrap_levels(model: ModelFacts) -> list[list[BlockCandidate]]:
    """The module-tree levels a block wrap could take, the detectors' choice first
    (`wrap_candidates`), then each other repeated class that is not too fine and whose blocks
    contain or lie in the chosen ones (the mixers around chosen experts, say): what `zdiag plan`
    replays against each other."""
    chosen = wrap_candidates(model)
    if not chosen:
        return []
    levels = [chosen]
    for cand in model.block_candidates():
        if cand.too_fine or cand in chosen:
            continue
        if any(
            _inside_blocks(a, b) or _inside_blocks(b, a)
            for c in chosen
            for a in cand.containers
            for b in c.containers
        ):
            levels.append([cand])
    return levels


def model_block_set(
    model: ModelFacts, cands: Sequence[BlockCandidate] | None = None
) -> BlockSet | None:
    """The blocks to wrap, from a captured description (`cands`, default `wrap_candidates`),
    with the user's container paths and classes and the import of each class where it is
    defined; several containers in the order the model defines them (where the description
    places them all)."""
    cands = wrap_candidates(model) if cands is None else cands
    if not cands:
        return None
    containers = [p for c in cands for p in c.containers]
    keys = {p: model.definition_key(p) for p in containers}
    if all(k is not None for k in keys.values()):  # in definition order, as a forward runs them
        containers.sort(key=lambda p: keys[p] or ())
        cands = sorted(cands, key=lambda c: min(keys[p] or () for p in c.containers))
    classes = list(dict.fromkeys(c.child_class for c in cands if c.child_class))
    imports = tuple(
        dict.fromkeys(
            f"from {c.child_module} import {c.child_class}"
            for c in cands
            if c.child_class and c.child_module and c.child_module != "__main__"
        )
    )
    sizes = [c.bytes_per_block_max for c in cands if c.bytes_per_block_max is not None]
    return BlockSet(
        container=containers[0],
        block_class=classes[0] if classes else None,
        count=sum(c.count for c in cands),
        param_bytes=max(sizes) if sizes else None,
        source=MODEL_SOURCE,
        more_containers=tuple(containers[1:]),
        more_classes=tuple(classes[1:]),
        imports=imports,
    )


def block_paths(model: ModelFacts, blocks: BlockSet) -> set[str] | None:
    """The module paths of every block of `blocks` (None when the description does not name
    them all). The description names a container's first few children only; where those are
    0, 1, 2, ... (a ModuleList or Sequential), the rest are the indices up to its count."""
    out: set[str] = set()
    for rep in model.description.repeated:
        if rep.path in blocks.containers and (
            not blocks.classes or rep.child_class in blocks.classes
        ):
            names = list(rep.child_names)
            if len(names) < rep.count:
                if names != [str(k) for k in range(len(names))]:
                    return None
                names = [str(k) for k in range(rep.count)]
            out |= {f"{rep.path}.{n}" if rep.path else n for n in names}
    return out or None


def model_unit_paths(model: ModelFacts) -> list[str]:
    """The paths of the run's FSDP units (FSDP2 units, else FSDP1 instances) in the description."""
    if model.fsdp2_units:
        return [u.path for u in model.fsdp2_units]
    return [i.path for i in model.fsdp1_instances]


def model_blocks_are_units(model: ModelFacts, blocks: BlockSet) -> bool | None:
    """Whether each block of `blocks` is already an FSDP unit (None when the blocks' paths are
    not all known)."""
    paths = block_paths(model, blocks)
    if paths is None:
        return None
    return paths <= set(model_unit_paths(model))


def model_fsdp_mesh(model: ModelFacts) -> FsdpMesh | None:
    """The mesh the run's FSDP2 units shard over when it is not the flat world: a root mesh of
    two or more dimensions (HSDP, FSDP2 over "dp" beside "tp"); None for a 1-D mesh, a run with no
    FSDP2 units, or no captured mesh. FSDP's dimensions are those whose role is "shard" or
    "replicate" (an unnamed root: the whole of it)."""
    mesh, captured = model.mesh, model.description.mesh
    if mesh is None or captured is None or mesh.ndim < 2 or not model.fsdp2_units:
        return None
    dim_names = mesh.dim_names
    names = tuple(d.name for d in mesh.dims if d.role in ("shard", "replicate"))
    if not all(dim_names) or len(dim_names) != mesh.ndim:
        dim_names = names = ()  # unnamed: the units can only use the whole root
    elif not names:
        return None
    return FsdpMesh(
        shape=mesh.shape,
        dim_names=dim_names,
        device_type=captured.device_type or "cuda",
        ranks=mesh.ranks,
        fsdp_dims=names,
    )


def model_settings(model: ModelFacts) -> dict[str, Any]:
    """The settings the run has, under the framework's own option names (frameworks/base.py):
    FSDP2 from its block units (all agreeing, else left unknown), FSDP1 from its instances,
    DeepSpeed's ZeRO config, DDP's constructor arguments and comm hook."""
    out: dict[str, Any] = {}
    units = [u for u in model.fsdp2_units if u.path]  # the root's own settings differ by design
    if units:
        _agree(out, "reshard_after_forward", [u.reshard_after_forward for u in units])
        # the last unit in forward order has nothing to prefetch forward, the first nothing
        # backward: a run that chains every other unit has the setting
        fwd, bwd = (units[:-1], units[1:]) if len(units) > 1 else (units, units)
        _agree(out, "forward_prefetch", [_set(u.forward_prefetch, u.path) for u in fwd])
        _agree(out, "backward_prefetch", [_set(u.backward_prefetch, u.path) for u in bwd])
        _agree(
            out,
            "param_dtype",
            [u.mixed_precision.param_dtype if u.mixed_precision else None for u in units],
        )
        _agree(
            out,
            "reduce_dtype",
            [u.mixed_precision.reduce_dtype if u.mixed_precision else None for u in units],
        )
        if all(u.hsdp for u in units):
            out["hsdp"] = True
    root = next((u for u in model.fsdp2_units if not u.path), None)
    if units and root is not None and root.forward_prefetch is not None:
        # the root's forward prefetch of the first unit: without it that unit's gather is
        # issued when needed, whatever the chain between the other units
        out["root_forward_prefetch"] = _set(root.forward_prefetch, root.path)
    if any(u.unshard_async_op for u in model.fsdp2_units):
        out["unshard_async_op"] = True  # set on the root
    fsdp1 = model.fsdp1_instances
    if fsdp1:
        _agree(out, "forward_prefetch", [i.forward_prefetch for i in fsdp1])
        _agree(out, "backward_prefetch", [i.backward_prefetch or "NONE" for i in fsdp1])
        _agree(out, "limit_all_gathers", [i.limit_all_gathers for i in fsdp1])
        _agree(out, "sharding_strategy", [i.sharding_strategy for i in fsdp1])
        _agree(out, "use_orig_params", [i.use_orig_params for i in fsdp1])
        _agree(
            out,
            "param_dtype",
            [i.mixed_precision.param_dtype if i.mixed_precision else None for i in fsdp1],
        )
    ds = model.deepspeed
    if ds is not None:
        for key, value in (
            ("overlap_comm", ds.overlap_comm),
            ("stage3_prefetch_bucket_size", ds.prefetch_bucket_size),
            ("stage3_max_live_parameters", ds.max_live_parameters),
            ("bf16", ds.bf16),
        ):
            if value is not None:
                out[key] = value
    ddp = model.ddp
    if ddp is not None:
        if ddp.bucket_cap_bytes is not None:
            out["bucket_cap_mb"] = ddp.bucket_cap_bytes / 1024**2
        for key, flag in (
            ("gradient_as_bucket_view", ddp.gradient_as_bucket_view),
            ("static_graph", ddp.static_graph),
        ):
            if flag is not None:
                out[key] = flag
        if ddp.comm_hook:
            out["comm_hook"] = ddp.comm_hook
    return out


def _set(prefetch: tuple[str, ...] | None, own: str) -> bool | None:
    """A unit's explicit prefetch list as a setting: True when it names another unit (a list
    naming only the unit itself prefetches nothing), None when unknown."""
    if prefetch is None:
        return None
    return any(p != own for p in prefetch)


def _agree(out: dict[str, Any], key: str, values: Iterable[Any]) -> None:
    """Set `out[key]` when every value is known and equal (mixed or unknown: left unknown)."""
    vals = list(values)
    if vals and None not in vals and all(v == vals[0] for v in vals):
        out[key] = vals[0]


def blocks_are_units(pattern: BlockPattern | None, units: Iterable[str]) -> bool | None:
    """Whether each repeated block is itself an FSDP unit (a unit named `<list>.<N>`), None when
    no pattern is known."""
    if pattern is None:
        return None
    return any(pattern.block_of(u) == u for u in units)
