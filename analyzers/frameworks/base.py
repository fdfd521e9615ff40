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

from zdiag.collectors.rundir import Manifest


@dataclass(frozen=True)
class BlockSet:
    """The repeated block set of a model: what one FSDP unit / checkpoint region should be.

    `container` is the attribute path from the model to the list of blocks ("encoder.stages": the
    blocks are `model.encoder.stages[i]`), `block_class` their class name ("ResidualMLP"), `count`
    how many there are and `param_bytes` one block's parameter bytes. Any field may be None
    (unknown); `source` says where the facts came from ("model", "trace labels", "harness", ...).
    """

    container: str | None = None
    block_class: str | None = None
    count: int | None = None
    param_bytes: int | None = None
    source: str = "inferred"

    @property
    def python(self) -> str | None:
        """The blocks as a Python expression on the model ("model.encoder.stages"), or None."""
        return f"model.{self.container}" if self.container else None

    @property
    def pattern(self) -> str | None:
        """Display form of the container: "encoder.stages.N", or None."""
        return f"{self.container}.N" if self.container else None

    def describe(self) -> str:
        """The block set in words, for titles and recommendations."""
        if self.container:
            return self.container + ".N"
        if self.block_class:
            return self.block_class + (f" x{self.count}" if self.count else "")
        return "each transformer block"


@dataclass(frozen=True)
class RunFacts:
    """What is known about the user's run, for remedies; None / absent means unknown.

    `settings` maps the framework's own option names to the values the run uses: FSDP2
    `reshard_after_forward`, `forward_prefetch` / `backward_prefetch` (explicit
    `set_modules_to_*_prefetch` lists set), `param_dtype`; FSDP1 `forward_prefetch`,
    `backward_prefetch` ("BACKWARD_PRE"), `limit_all_gathers`, `param_dtype`; DeepSpeed config keys
    (`overlap_comm`, `stage3_prefetch_bucket_size`, `bf16`, ...); DDP constructor arguments
    (`bucket_cap_mb`, `gradient_as_bucket_view`, `static_graph`). A key that is absent is unknown,
    so the remedy proposes it; a key present with the value the remedy would set is not proposed.
    """

    framework: str
    blocks: BlockSet | None = None
    blocks_are_units: bool | None = None  # each repeated block already its own FSDP unit
    settings: Mapping[str, Any] = field(default_factory=dict)
    nnodes: int | None = None
    world_size: int | None = None

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


def checkpoint_blocks(blocks: BlockSet | None, note: str = "") -> Remedy | None:
    """Activation checkpointing of each block (framework independent: torch's checkpoint
    wrapper), None when the block set names neither a container nor a class."""
    if blocks is None or not (blocks.container or blocks.block_class):
        return None
    head = (
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
        "    apply_activation_checkpointing, checkpoint_wrapper)\n"
    )
    if blocks.container:
        code = (
            head + f"blocks = set({blocks.python})\n"
            "apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,\n"
            f"                               check_fn=lambda m: m in blocks){note}"
        )
    else:
        code = (
            head
            + "apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,\n"
            f"                               check_fn=lambda m: isinstance(m, {blocks.block_class})){note}"
        )
    return Remedy(f"checkpoint the activations of each {blocks.describe()}", code)
