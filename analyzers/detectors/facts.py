"""The facts about a user's run that the detectors hand to the framework remedies, from what an
analysis knows today: trace labels (FSDP unit names, `with_stack` module events), the manifest's
units and the harness's recorded options. A model description captured from the live model will
fill the same `BlockSet` / `RunFacts` values with facts instead of inferences.
"""

from __future__ import annotations

from collections.abc import Iterable

from zdiag.analyzers import frameworks
from zdiag.analyzers.detectors.blocks import BlockPattern
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.frameworks import BlockSet, Framework, RunFacts


def block_set(
    pattern: BlockPattern | None,
    module_class: tuple[str, int] | None = None,
    source: str = "trace labels",
) -> BlockSet | None:
    """The repeated blocks as remedies take them: the `<list>.<N>` pattern found in module names
    (container path and count), else a class repeated in `with_stack` module events."""
    if pattern is not None:
        return BlockSet(container=pattern.list_path, count=pattern.count, source=source)
    if module_class is not None:
        return BlockSet(block_class=module_class[0], count=module_class[1], source=source)
    return None


def blocks_are_units(pattern: BlockPattern | None, units: Iterable[str]) -> bool | None:
    """Whether each repeated block is itself an FSDP unit (a unit named `<list>.<N>`), None when
    no pattern is known."""
    if pattern is None:
        return None
    return any(pattern.block_of(u) == u for u in units)


def framework_of(ctx: DetectorContext, name: str | None = None) -> Framework:
    """The run's framework: `name` (a ledger's), else the manifest's, else the first whose labels
    a trace holds, else FSDP2."""
    if name:
        return frameworks.get(name)
    found = frameworks.from_manifest(ctx.manifest)
    for facts in ctx.facts.values():
        if found is None and facts.framework:
            found = frameworks.get(facts.framework)
    return found or frameworks.get(None)


def run_facts(
    ctx: DetectorContext,
    fw: Framework,
    blocks: BlockSet | None = None,
    are_units: bool | None = None,
) -> RunFacts:
    """The RunFacts of a run for framework `fw`: settings from what the manifest records (the
    harness's options for FSDP2), node and world counts from the context."""
    settings = fw.manifest_settings(ctx.manifest) if ctx.manifest is not None else {}
    return RunFacts(
        framework=fw.name,
        blocks=blocks,
        blocks_are_units=are_units,
        settings=settings,
        nnodes=ctx.nnodes,
        world_size=ctx.world_size,
    )
