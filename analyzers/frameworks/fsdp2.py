"""FSDP2 (`torch.distributed.fsdp.fully_shard`): labels, units and remedies in its own API.

In a trace, FSDP2 writes record_function labels `FSDP::<phase> (<module fqn>)` on the training
thread: `FSDP::all_gather (layers.0)`, `FSDP::pre_forward (layers.0)` (the module that needs the
gather), `FSDP::post_backward_reduce (layers.3)`, `FSDP::root_pre_forward` (once per forward: a
step marker), `FSDP::forward_prefetch for layers.1`. A unit is named by its module fqn ("" is the
root). The collectives are issued on the thread that runs the label (the training thread).
zdiag's harness (`zdiag run --harness`) is an FSDP2 script: its recorded options are FSDP2
settings (`settings_from_harness`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from .base import (
    Framework,
    Remedy,
    RunFacts,
    attribute_path,
    class_tuple,
)
from .hsdp_layout import HsdpLayout, flat_hsdp, quoted, split_dp

NAME = "fsdp2"
ANNOTATION_RE = re.compile(r"^FSDP::")
LABEL_RE = re.compile(r"^FSDP::(?P<phase>[a-z_]+)(?: \((?P<fqn>[^)]*)\)| for (?P<target>.+))?$")
"""`FSDP::all_gather (layers.0)`, `FSDP::all_gather` (root), `FSDP::forward_prefetch for x`."""
NEED_PHASES = ("pre_forward", "pre_backward")
"""Label phases that name the module needing its parameters now (lead = needed - issued)."""
FORWARD_MARKER = r"^FSDP::root_pre_forward$"
BF16_NAMES = ("bfloat16", "torch.bfloat16", "bf16")


def settings_from_harness(harness: Mapping[str, Any]) -> dict[str, Any]:
    """The FSDP2 settings of a run of zdiag's harness, from its recorded options (`zero` 2 keeps
    blocks unsharded after forward; `prefetch explicit` sets both prefetch lists, the root's
    included)."""
    out: dict[str, Any] = {}
    if harness.get("zero") in (2, 3):
        out["reshard_after_forward"] = harness["zero"] == 3
    if harness.get("prefetch") in ("explicit", "implicit", "off"):
        explicit = harness["prefetch"] == "explicit"
        out["forward_prefetch"] = out["backward_prefetch"] = explicit
        out["root_forward_prefetch"] = explicit
    if harness.get("precision") in ("fp32", "bf16"):
        out["param_dtype"] = "bfloat16" if harness["precision"] == "bf16" else "float32"
    return out


def _class_imports(facts: RunFacts) -> list[str]:
    """The imports `_blocks_expr` needs: the block classes when it names them, not containers."""
    b = facts.blocks
    return list(b.imports) if b is not None and not b.containers and b.classes else []


def _blocks_expr(facts: RunFacts) -> str | None:
    b = facts.blocks
    if b is None:
        return None
    if b.containers:
        return b.python
    if b.classes:
        return f"[m for m in model.modules() if isinstance(m, {class_tuple(b)})]"
    return None


def _mesh_lines(facts: RunFacts) -> tuple[list[str], str]:
    """The lines that rebuild the run's FSDP mesh and `fully_shard`'s extra arguments for it
    (`, mesh=dp_mesh`); none for a run sharded over the flat world."""
    if facts.mesh is None:
        return [], ""
    return facts.mesh.preamble(), f", {facts.mesh.arg}"


def wrap_blocks(facts: RunFacts, replacing: Sequence[str] = ()) -> Remedy | None:
    """`fully_shard` on each repeated block, then the root, over the run's own mesh; None when
    each block already is a unit, no code when the block set is unknown. `replacing` names units
    wrapped today."""
    b = facts.blocks
    if facts.blocks_are_units:
        return None
    if b is None or not (b.containers or b.classes):
        return Remedy("fully_shard each repeated block, then the root", None)
    mesh_lines, mesh = _mesh_lines(facts)
    lines = ["from torch.distributed.fsdp import fully_shard"]
    if not b.containers:
        lines += b.imports
    lines += mesh_lines
    if replacing:
        lines.append(f"# instead of fully_shard() on each submodule ({', '.join(replacing)}, ...):")
    if b.containers:
        lines += [f"for block in {b.python}:", f"    fully_shard(block{mesh})"]
    else:
        lines += [
            "for module in list(model.modules()):",
            f"    if isinstance(module, {class_tuple(b)}):",
            f"        fully_shard(module{mesh})",
        ]
    lines.append(f"fully_shard(model{mesh})")
    return Remedy(f"fully_shard each {b.describe()}, then the root", "\n".join(lines))


def _finer_than_blocks(facts: RunFacts) -> bool:
    """Whether the blocks must become units before prefetch lists can name them: they are not
    units, and today's first unit does not hold them (a per-Linear wrap, a whole-model wrap; not
    a mixer unit holding the description's expert blocks, whose chain is the units')."""
    if facts.blocks_are_units is not False:
        return False
    first = facts.first_unit
    containers = facts.blocks.containers if facts.blocks is not None else ()
    return not (first and any(c.startswith(first + ".") for c in containers))


def overlap(facts: RunFacts) -> Remedy | None:
    """Explicit forward and backward prefetch of depth 1 over the blocks, and the root's forward
    prefetch of the first unit; only what the run does not set; None when it sets all of it.
    The prefetch lists name FSDP units only (`set_modules_to_*_prefetch` raises on any other
    module): when today's units are finer than the blocks (`_finer_than_blocks`), the code wraps
    the blocks first, and the root prefetches the first block, not today's first unit."""
    blocks = _blocks_expr(facts)
    rewrap = _finer_than_blocks(facts)
    fwd = rewrap or not facts.has("forward_prefetch", True)
    bwd = rewrap or not facts.has("backward_prefetch", True)
    root_fwd = fwd or not facts.has("root_forward_prefetch", True)
    if not (fwd or bwd or root_fwd):
        return None
    first = attribute_path(facts.first_unit) if facts.first_unit and not rewrap else None
    root_lines = [
        "# the root prefetches the first unit",
        f"model.set_modules_to_forward_prefetch([{first or 'blocks[0]'}])",
    ]
    if not (fwd or bwd):
        return Remedy(
            "Prefetch the first unit's all-gather from the root: the run chains the other units, "
            "but nothing issues the first one ahead of its use.",
            "\n".join(root_lines) if first else None,
        )
    wrap = wrap_blocks(facts) if rewrap else None
    lines = wrap.code.splitlines() if wrap is not None and wrap.code else []
    lines += [line for line in _class_imports(facts) if line not in lines]
    lines.append(f"blocks = {blocks}")
    if fwd:
        lines += [
            "for i in range(len(blocks) - 1):",
            "    blocks[i].set_modules_to_forward_prefetch([blocks[i + 1]])",
        ]
    if bwd:
        lines += [
            "for i in range(1, len(blocks)):",
            "    blocks[i].set_modules_to_backward_prefetch([blocks[i - 1]])",
        ]
    if root_fwd:
        lines += root_lines
    if bwd:
        lines.append("model.set_modules_to_backward_prefetch([blocks[-1]])")
    text = (
        "Prefetch each unit's all-gather during the previous unit's compute: explicit forward "
        "and backward prefetch of depth 1 on the exact blocks below; keep "
        "reshard_after_forward=True on the blocks (False on the last block, whose backward "
        "starts right after forward, saves one gather at the cost of keeping it unsharded)."
    )
    if rewrap:
        text = (
            "Make each block an FSDP unit first (prefetch lists can name FSDP units only, and "
            "the blocks are not units today). " + text
        )
    return Remedy(text, "\n".join(lines) if blocks else None)


def bf16_comm(facts: RunFacts) -> Remedy | None:
    """MixedPrecisionPolicy gathering bf16 parameters, over the blocks when they are known;
    None when the run already gathers bf16."""
    if str(facts.settings.get("param_dtype", "")).lower() in BF16_NAMES:
        return None
    blocks = _blocks_expr(facts)
    mesh_lines, mesh = _mesh_lines(facts)
    apply = (
        f"for block in {blocks}:\n    fully_shard(block{mesh}, mp_policy=mp)\n"
        f"fully_shard(model{mesh}, mp_policy=mp)"
        if blocks
        else f"fully_shard(block{mesh}, mp_policy=mp)  # for each block, then the root"
    )
    return Remedy(
        "gather parameters in bf16, keeping fp32 shards and fp32 gradient reduction "
        "(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))",
        "import torch\n"
        "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard\n"
        + "".join(f"{line}\n" for line in [*_class_imports(facts), *mesh_lines])
        + "mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)\n"
        + apply,
    )


def bf16_reduce(facts: RunFacts) -> Remedy | None:
    """MixedPrecisionPolicy reducing gradients in bf16 (the run's own param_dtype kept), over the
    blocks and the root on the run's mesh: half the bytes of every reduce-scatter and all-reduce;
    None when the run already reduces in bf16 (reduce_dtype, else param_dtype, is bf16)."""
    reduced = facts.settings.get("reduce_dtype") or facts.settings.get("param_dtype")
    if str(reduced or "").lower() in BF16_NAMES:
        return None
    blocks = _blocks_expr(facts)
    mesh_lines, mesh = _mesh_lines(facts)
    param = facts.settings.get("param_dtype")
    param_arg = f"param_dtype=torch.{str(param).removeprefix('torch.')}, " if param else ""
    apply = (
        f"for block in {blocks}:\n    fully_shard(block{mesh}, mp_policy=mp)\n"
        f"fully_shard(model{mesh}, mp_policy=mp)"
        if blocks
        else f"fully_shard(block{mesh}, mp_policy=mp)  # for each block, then the root"
    )
    return Remedy(
        "reduce gradients in bf16 (MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)): half the "
        "bytes of each reduce-scatter and cross-replica all-reduce, at bf16 precision for the "
        "summed gradients",
        "import torch\n"
        "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard\n"
        + "".join(f"{line}\n" for line in [*_class_imports(facts), *mesh_lines])
        + f"mp = MixedPrecisionPolicy({param_arg}reduce_dtype=torch.bfloat16)\n"
        + apply,
    )


def all_reduce_last_micro_batch(micro_batches: int) -> Remedy:
    """HSDP gradient accumulation that all-reduces across replicas once per optimizer step (on
    the last micro-batch; the others still reduce-scatter within the shard group)."""
    return Remedy(
        f"all-reduce across replicas only on the last of the {micro_batches} micro-batches of "
        "each optimizer step (model.set_requires_all_reduce; the earlier micro-batches still "
        "reduce-scatter within their shard group)",
        f"# in the training loop, before each of the {micro_batches} micro-batches' backward "
        "(i = 0, 1, ...):\n"
        f"model.set_requires_all_reduce(i == {micro_batches - 1})",
    )


def hsdp_layout(facts: RunFacts) -> HsdpLayout | None:
    """The HSDP mesh for the run's host layout: its own mesh with the FSDP dimension split when
    it has one (TP/PP beside FSDP), else (nodes, ranks per node) from the nodes, else from the
    node count (ranks numbered node by node); None when the run already replicates across a
    dimension or the layout cannot shard within a node."""
    if facts.has("hsdp", True):
        return None
    if facts.mesh is not None:
        return split_dp(facts.mesh, facts.nodes) if facts.nodes else None
    if facts.nodes:
        return flat_hsdp(facts.nodes, facts.device_type)
    nnodes, world = facts.nnodes, facts.world_size
    if not nnodes or nnodes < 2 or not world or world % nnodes:
        return None
    per_node = world // nnodes
    return flat_hsdp(
        tuple(tuple(range(k * per_node, (k + 1) * per_node)) for k in range(nnodes)),
        facts.device_type,
    )


def hybrid_shard(facts: RunFacts) -> Remedy | None:
    """HSDP over a mesh built from the run's host layout (`hsdp_layout`): shard within a node,
    replicate across nodes; None when the run already does or the layout does not allow it."""
    layout = hsdp_layout(facts)
    if layout is None:
        return None
    blocks = _blocks_expr(facts)
    lines = [layout.import_line(), "from torch.distributed.fsdp import fully_shard"]
    lines += _class_imports(facts)
    var = "mesh"
    if layout.replaces is not None:
        old = layout.replaces
        name = old.fsdp_dims[0]
        others = [f'mesh["{d}"]' for d in old.dim_names if d != name]
        lines += [
            f'# replaces the run\'s mesh, {old.shape} {quoted(old.dim_names)}: "{name}" split into '
            f'"{layout.fsdp_dims[0]}" across {layout.replicas} nodes and "{layout.fsdp_dims[1]}" '
            "within one;",
            f"# {', '.join(others)} as before (parallelize_module and the rest)",
            f"mesh = {layout.build()}",
            f'dp_mesh = mesh["{layout.fsdp_dims[0]}", "{layout.fsdp_dims[1]}"]',
            # the script's other uses of the old dimension (the data's rank) keep working:
            # the split is in place, so the flattened pair holds the same ranks in the same order
            f'dp_mesh._flatten("{name}")  # mesh["{name}"] as before: the same ranks, flattened',
        ]
        var = "dp_mesh"
    else:
        lines.append(f"mesh = {layout.build()}")
    lines += (
        [
            f"for block in {blocks}:",
            f"    fully_shard(block, mesh={var})",
            f"fully_shard(model, mesh={var})",
        ]
        if blocks
        else [f"fully_shard(block, mesh={var})  # for each block, then the root"]
    )
    return Remedy(
        f"shard over the {layout.shard_size} ranks of a node, replicate across the "
        f"{layout.replicas} nodes",
        "\n".join(lines),
    )


FRAMEWORK = Framework(
    name=NAME,
    title="FSDP2 (fully_shard)",
    annotation_re=ANNOTATION_RE,
    label_re=ANNOTATION_RE,
    forward_markers=(FORWARD_MARKER,),
    labels_name_consumer=True,
    checkpoint_note="  # before fully_shard",
    manifest_settings=lambda manifest: settings_from_harness(manifest.harness or {}),
    wrap_blocks=wrap_blocks,
    overlap=overlap,
    bf16_comm=bf16_comm,
    hybrid_shard=hybrid_shard,
)
