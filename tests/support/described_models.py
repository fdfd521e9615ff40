"""Captured model descriptions built by hand, for the what-if and planner tests."""

from __future__ import annotations

import dataclasses

from zdiag.analyzers.inputs.model_facts import ModelFacts
from zdiag.collectors.model_schema import (
    ActivationSizes,
    BlockActivations,
    ModelDescription,
    ModuleNode,
    RepeatedSet,
)

MIB = 2**20


def described(blocks: int = 4, block_bytes: int = 2 * MIB, rest: int = MIB // 2) -> ModelFacts:
    """A model of `blocks` equal blocks under `layers` plus `rest` bytes in an embedding; the
    description keeps the first two blocks' nodes and collapses the others."""
    total = blocks * block_bytes + rest
    modules = (
        ModuleNode(path="", cls="Net", total_bytes=total, children=2),
        ModuleNode(path="embed", cls="Embedding", depth=1, total_bytes=rest),
        ModuleNode(
            path="layers",
            cls="ModuleList",
            depth=1,
            total_bytes=blocks * block_bytes,
            children=blocks,
            collapsed_children=blocks - 2,
        ),
        ModuleNode(path="layers.0", cls="Block", depth=2, total_bytes=block_bytes),
        ModuleNode(path="layers.1", cls="Block", depth=2, total_bytes=block_bytes),
    )
    rep = RepeatedSet(
        path="layers",
        child_class="Block",
        count=blocks,
        child_names=("0", "1"),
        bytes_per_child_min=block_bytes,
        bytes_per_child_max=block_bytes,
        total_bytes=blocks * block_bytes,
    )
    desc = ModelDescription(framework="fsdp2", param_bytes=total, modules=modules, repeated=(rep,))
    return ModelFacts(desc)


def measured(blocks: int, saved: int, inputs: int) -> ModelFacts:
    """A captured model of `blocks` blocks under `layers` whose forward saved `saved` bytes
    per block for backward, from inputs of `inputs` bytes (what `zdiag run --profile-memory`
    records)."""
    facts = described(blocks=blocks)
    act = ActivationSizes(
        saved_bytes=blocks * saved,
        tensors=4 * blocks,
        containers=("layers",),
        blocks=tuple(BlockActivations(f"layers.{k}", saved, inputs) for k in range(blocks)),
    )
    return ModelFacts(dataclasses.replace(facts.description, activations=act))
