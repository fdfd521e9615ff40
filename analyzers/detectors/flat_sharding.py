"""`flat-sharding-multinode`: FSDP shards over every rank of a multi-node job.

Then every all-gather and reduce-scatter crosses the network. Hybrid sharding (HSDP: shard within
a node, replicate across nodes) keeps those collectives on the fast intra-node links and leaves
one gradient all-reduce across nodes, as long as the model state fits a node's memory.
"""

from __future__ import annotations

from ..report import Finding
from .context import DetectorContext
from .rule import Rule, Threshold

# (the reasoning behind the value: RULE's thresholds, at the end of the module)
INTRA_NODE_SPEEDUP = 2.0


def detect(ctx: DetectorContext) -> list[Finding]:
    """The flat-sharding-multinode finding, or none."""
    ledgers = ctx.fsdp_ledgers()
    nnodes = ctx.sheet.nnodes
    world = ctx.sheet.world_size
    if not ledgers or not nnodes or nnodes < 2 or not world or world % nnodes:
        return []
    lg = ledgers[0]
    groups = ctx.group_sizes(lg.rank)
    if groups and max(groups) < world:
        return []  # FSDP already runs in sub-groups (HSDP or 2-D sharding)
    remedy = ctx.sheet.framework.hybrid_shard(ctx.sheet.run_facts())
    if remedy is None:
        return []  # the run already shards hierarchically (or the framework has no such mode)
    n_steps = max(1, len(lg.steps))
    exposed = sum(r.exposed_us for r in lg.records) / 1e3 / n_steps
    return [
        Finding(
            id="flat-sharding-multinode",
            severity="warning",
            title=f"FSDP shards across all {world} ranks on {nnodes} nodes",
            ranks=[x.rank for x in ledgers],
            steps=list(lg.steps),
            evidence={
                "world_size": world,
                "nnodes": nnodes,
                "group_sizes": sorted(groups),
                "exposed_fsdp_comm_ms_per_step": round(exposed, 3),
            },
            recommendation=(
                f"Use hybrid sharding (HSDP): {remedy.text}, if the model state fits in one "
                "node's memory."
            ),
            code=remedy.code,
            expected_gain_ms=round(exposed * (1 - 1 / INTRA_NODE_SPEEDUP), 3),
            gain_method=(
                f"exposed FSDP comm time x (1 - 1/{INTRA_NODE_SPEEDUP:g}): assumes intra-node "
                "collectives at least 2x faster than the cross-node ones they replace"
            ),
        )
    ]


RULE = Rule(
    id="flat-sharding-multinode",
    summary="FSDP shards over every rank of a multi-node job",
    detect=detect,
    what=(
        "FSDP shards over every rank of a multi-node job: more than one node, and the FSDP "
        "groups span the whole world (no sub-groups: not HSDP or 2-D sharding already)."
    ),
    why=(
        "Every all-gather and reduce-scatter then crosses the network. Hybrid sharding (shard "
        "within a node, replicate across nodes) keeps them on the fast intra-node links and "
        "leaves one gradient all-reduce across nodes, as long as the model state fits a node."
    ),
    example="FSDP shards across all 16 ranks on 2 nodes.",
    fix="An HSDP mesh `(nnodes, ranks_per_node)` in the run's framework.",
    gain="Half the exposed FSDP communication (assumes intra-node collectives >= 2x faster).",
    scope="multi-node FSDP/ZeRO runs (nodes from the manifest, else distinct trace hosts)",
    fsdp_only=True,
    thresholds=(
        Threshold(
            "INTRA_NODE_SPEEDUP",
            INTRA_NODE_SPEEDUP,
            "HSDP replaces cross-node gathers with intra-node ones. NVLink/xGMI is typically "
            ">= 4x the per-GPU network bandwidth; the gain claims only half of that: the "
            "exposed FSDP communication time halves (the gain's arithmetic).",
        ),
    ),
    markers=(),
)
