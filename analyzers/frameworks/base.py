"""The shared vocabulary of the framework modules: facts in, remedies out.

A framework module (fsdp2.py, fsdp1.py, deepspeed.py, ddp.py) describes one way of sharding or
replicating a model: how its work shows in a trace, and the code that fixes what the detectors
find, written in that framework's own API. The remedy functions read facts about the user's model
and run (`RunFacts`), never the harness: a model description captured from the live model fills
them, and so can inference from trace labels or the harness's recorded options. A remedy returns
None when the run already has every setting it would propose (never a setting the run has), and a
Remedy whose `code` is None when the facts are too thin to name the user's own modules (no code
is better than code naming a module the model lacks).

Filling the facts from a model description captured from the live model (issue 12): the
repeated-children container chosen as the unit gives `BlockSet(container=<path>,
block_class=<class>, count=<children>, param_bytes=<one child's bytes>, source="model")`;
`blocks_are_units` is whether FSDP2 units / FSDP1 instances sit at those paths; `settings` takes
the captured configuration under the framework's own option names (FSDP2 per-unit
`reshard_after_forward`, non-empty prefetch lists as `forward_prefetch` / `backward_prefetch`,
the MixedPrecisionPolicy's `param_dtype`, a 2-D mesh as `hsdp`; FSDP1 `forward_prefetch`,
`backward_prefetch` as the enum member's name, `limit_all_gathers`, `sharding_strategy`,
`param_dtype`; DeepSpeed's config keys as written, `bf16` as its `enabled` flag; DDP's
constructor arguments and `comm_hook` as the hook's function name).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...collectors.run_records import Manifest


@dataclass(frozen=True)
class BlockSet:
    """The repeated block set of a model: what one FSDP unit / checkpoint region should be.

    `container` is the attribute path from the model to the list of blocks ("encoder.stages": the
    blocks are `model.encoder.stages[i]`; "" when the model itself is the list), `block_class`
    their class name ("ResidualMLP"), `count` how many there are and `param_bytes` one block's
    parameter bytes. A model can hold blocks at the same granularity in several containers
    (`encoder.towers` of EncoderTower and `decoder.towers` of DecoderTower): `more_containers` and
    `more_classes` list the others. `imports` are the lines that import the classes where they
    are defined (`from tabular import ResidualMLP`; none for a class of the script itself). Any
    field may be None (unknown); `source` says where the facts came from ("model", "trace
    labels", "harness", ...).
    """

    container: str | None = None
    block_class: str | None = None
    count: int | None = None
    param_bytes: int | None = None
    source: str = "inferred"
    more_containers: tuple[str, ...] = ()
    more_classes: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()

    @property
    def containers(self) -> tuple[str, ...]:
        """Every container path (the first is `container`); () when unknown."""
        return (self.container, *self.more_containers) if self.container is not None else ()

    @property
    def classes(self) -> tuple[str, ...]:
        """Every block class name (the first is `block_class`); () when unknown."""
        return (self.block_class, *self.more_classes) if self.block_class else ()

    @property
    def python(self) -> str | None:
        """The blocks as a Python expression on the model ("model.encoder.stages", or
        "[*model.encoder.towers, *model.decoder.towers]"), or None."""
        paths = [attribute_path(c) for c in self.containers]
        if not paths:
            return None
        return paths[0] if len(paths) == 1 else "[" + ", ".join(f"*{p}" for p in paths) + "]"

    @property
    def pattern(self) -> str | None:
        """Display form of the container(s), spelled as the code reaches them from the user's
        `model` ("model.encoder.stages[N]": the words and the code name the blocks alike), or
        None."""
        return ", ".join(f"{attribute_path(c)}[N]" for c in self.containers) or None

    def describe(self) -> str:
        """The block set in words, for titles and recommendations."""
        classes = " / ".join(self.classes)
        count = f" x{self.count}" if self.count else ""
        if self.containers:
            return self.pattern + (f" ({classes}{count})" if classes else "")  # type: ignore[operator]
        if classes:
            return classes + count
        return "each transformer block"


@dataclass(frozen=True)
class FsdpMesh:
    """The mesh a run's FSDP2 units shard over when it is not the flat world (HSDP, or the
    data-parallel dimensions of a mesh that also holds tensor-parallel or pipeline dimensions).

    `shape`, `dim_names` and `device_type` are the root mesh's (as `init_device_mesh` took them),
    `ranks` its row-major layout, `fsdp_dims` the names of the dimensions FSDP uses, root order
    (all of them: the whole root mesh). A remedy cannot know the variable the user's script holds
    the mesh in: `preamble` rebuilds it under `variable` (same shape, names and device type: a
    mesh equal to the run's, so it composes with the run's DTensors), and `arg` passes it.
    """

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    device_type: str
    ranks: tuple[int, ...]
    fsdp_dims: tuple[str, ...]

    @property
    def whole(self) -> bool:
        """Whether FSDP uses every dimension of the root mesh."""
        return not self.dim_names or self.fsdp_dims == self.dim_names

    @property
    def variable(self) -> str:
        """The name the preamble binds: `mesh` for the whole root mesh, else `dp_mesh`."""
        return "mesh" if self.whole else "dp_mesh"

    @property
    def arg(self) -> str:
        """The keyword argument `fully_shard` takes: `mesh=dp_mesh`."""
        return f"mesh={self.variable}"

    def preamble(self) -> list[str]:
        """The lines that import, describe (a comment) and build the mesh."""
        names = ", ".join(f'"{n}"' for n in self.dim_names)
        named = f", mesh_dim_names=({names}{',' if len(self.dim_names) == 1 else ''})"
        shape = "(" + ", ".join(map(str, self.shape)) + ("," if len(self.shape) == 1 else "") + ")"
        if self.ranks == tuple(range(len(self.ranks))):
            imp, build = "init_device_mesh", f'init_device_mesh("{self.device_type}", {shape}'
        else:
            imp, build = "DeviceMesh", f'DeviceMesh("{self.device_type}", {_nested(self)}'
        build += named if self.dim_names else ""
        build += ")"
        what = f"{shape} ({names})" if names else shape
        if not self.whole:
            dims = ", ".join(f'"{d}"' for d in self.fsdp_dims)
            build += f"[{dims if len(self.fsdp_dims) == 1 else f'({dims})'}]"
            what = f"{dims} of {what}"
        return [
            f"from torch.distributed.device_mesh import {imp}",
            f"# the run's FSDP mesh, rebuilt: {what}",
            f"{self.variable} = {build}",
        ]


def _nested(mesh: FsdpMesh) -> str:
    """The root mesh's layout as a nested list literal of its shape."""
    rows: list[Any] = list(mesh.ranks)
    for size in reversed(mesh.shape[1:]):
        rows = [rows[i : i + size] for i in range(0, len(rows), size)]
    return repr(rows)


def attribute_path(module_path: str, root: str = "model") -> str:
    """`encoder.stages` -> `model.encoder.stages`; `layers.0.experts` ->
    `model.layers[0].experts`; "" -> `model`."""
    out = root
    for part in module_path.split(".") if module_path else ():
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out


@dataclass(frozen=True)
class RunFacts:
    """What is known about the user's run, for remedies; None / absent means unknown.

    `settings` maps the framework's own option names to the values the run uses: FSDP2
    `reshard_after_forward`, `forward_prefetch` / `backward_prefetch` (explicit
    `set_modules_to_*_prefetch` lists set between the units), `root_forward_prefetch` (the
    root's list names a unit), `param_dtype`; FSDP1 `forward_prefetch`,
    `backward_prefetch` ("BACKWARD_PRE"), `limit_all_gathers`, `param_dtype`; DeepSpeed config keys
    (`overlap_comm`, `stage3_prefetch_bucket_size`, `bf16`, ...); DDP constructor arguments
    (`bucket_cap_mb`, `gradient_as_bucket_view`, `static_graph`). A key that is absent is unknown,
    so the remedy proposes it; a key present with the value the remedy would set is not proposed.
    `mesh` is the mesh FSDP2's units shard over when it is not the flat world: the code that
    calls `fully_shard` rebuilds it and passes it (`fully_shard(block, mesh=dp_mesh)`). `nodes`
    are the ranks of each node, nodes in order (() when unknown): the host layout an HSDP mesh
    is built from.
    """

    framework: str
    blocks: BlockSet | None = None
    blocks_are_units: bool | None = None  # each repeated block already its own FSDP unit
    settings: Mapping[str, Any] = field(default_factory=dict)
    first_unit: str | None = None  # the first FSDP unit after the root in forward order
    nnodes: int | None = None
    world_size: int | None = None
    mesh: FsdpMesh | None = None  # None: FSDP shards over the flat world (no `mesh=` needed)
    nodes: tuple[tuple[int, ...], ...] = ()
    device_type: str = "cuda"  # the accelerator the code builds meshes on ("cpu" for CPU runs)

    def has(self, key: str, value: Any) -> bool:
        """Whether the run already sets `key` to `value` (False when unknown)."""
        return key in self.settings and self.settings[key] == value


@dataclass(frozen=True)
class Remedy:
    """One change to a user's run: `text` a clause or sentence in words, `code` to paste (None
    when the facts cannot name the user's modules)."""

    text: str
    code: str | None


RemedyFn = Callable[[RunFacts], Remedy | None]


def no_remedy(facts: RunFacts) -> Remedy | None:
    """The remedy of a framework that has no such setting."""
    return None


def no_settings(manifest: Manifest) -> dict[str, Any]:
    """The settings of a framework whose runs record none in the manifest."""
    return {}


@dataclass(frozen=True)
class Framework:
    """One framework's knowledge (see the package docstring); built once per framework module.

    Recognition: `annotation_re` matches (re.match) the framework's own record_function labels,
    classified as FSDP annotations in the event model; `label_re` matches (re.search) every
    name that identifies the framework in a trace (labels, autograd Functions, Python
    functions); `forward_markers` are regexes of one label per forward pass (step boundaries);
    `manifest_packages` are packages whose version in the run manifest identifies it.
    Behaviour: `shards_parameters` (gathers parameters before use), `wraps_units` (the user
    chooses the units: a wrap remedy exists), `labels_name_consumer` (a label names the module
    that needs each gather, so "issued only when needed" is measurable), `checkpoint_note` (a
    comment placing activation checkpointing relative to the framework's wrapping call).
    `manifest_settings` reads the settings a run manifest records (`RunFacts.settings`).
    """

    name: str
    title: str
    annotation_re: re.Pattern[str] | None
    label_re: re.Pattern[str]
    forward_markers: tuple[str, ...] = ()
    manifest_packages: tuple[str, ...] = ()
    shards_parameters: bool = True
    wraps_units: bool = True
    labels_name_consumer: bool = False
    checkpoint_note: str = ""
    manifest_settings: Callable[[Manifest], dict[str, Any]] = no_settings
    wrap_blocks: Callable[..., Remedy | None] = no_remedy
    overlap: RemedyFn = no_remedy
    bf16_comm: RemedyFn = no_remedy
    hybrid_shard: RemedyFn = no_remedy

    def recognises(self, names: Sequence[str]) -> bool:
        """Whether any of the event names is one of this framework's labels."""
        return any(self.label_re.search(n) for n in names)


def class_tuple(blocks: BlockSet) -> str:
    """The block classes as `isinstance`'s second argument: `A` or `(A, B)`."""
    names = blocks.classes
    return names[0] if len(names) == 1 else "(" + ", ".join(names) + ")"


def checkpoint_blocks(blocks: BlockSet | None, note: str = "") -> Remedy | None:
    """Activation checkpointing of each block (framework independent: torch's checkpoint
    wrapper), None when the block set names neither a container nor a class."""
    if blocks is None or not (blocks.containers or blocks.classes):
        return None
    head = (
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
        "    apply_activation_checkpointing, checkpoint_wrapper)\n"
    )
    if blocks.containers:
        code = (
            head + f"blocks = set({blocks.python})\n"
            "apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,\n"
            f"                               check_fn=lambda m: m in blocks){note}"
        )
    else:
        code = (
            head
            + "".join(f"{line}\n" for line in blocks.imports)
            + "apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,\n"
            f"                               check_fn=lambda m: isinstance(m, {class_tuple(blocks)})){note}"
        )
    return Remedy(f"checkpoint the activations of each {blocks.describe()}", code)
