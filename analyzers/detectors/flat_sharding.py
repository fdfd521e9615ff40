"""`flat-sharding-multinode`: FSDP shards over every rank of a multi-node job.

Then every all-gather and reduce-scatter crosses the network. Hybrid sharding (HSDP: shard within
a node, replicate across nodes) keeps those collectives on the fast intra-node links and leaves
one gradient all-reduce across nodes, as long as the model state fits a node's memory.
"""

from __future__ import annotations

from ..report import Finding
from .context import DetectorContext
from .facts import framework_of, run_facts

# HSDP replaces cross-node gathers with intra-node ones. NVLink/xGMI is typically >= 4x the
# per-GPU network bandwidth; we claim only half of that: the exposed FSDP comm time halves.
INTRA_NODE_SPEEDUP = 2.0


def detect(ctx: DetectorContext) -> list[Finding]:
    """The flat-sharding-multinode finding, or none."""
    ledgers = ctx.fsdp_ledgers()
    nnodes = ctx.nnodes
    world = ctx.world_size
    if not ledgers or not nnodes or nnodes < 2 or not world or world % nnodes:
        return []
    lg = ledgers[0]
    groups = ctx.group_sizes(lg.rank)
    if groups and max(groups) < world:
        return []  # FSDP already runs in sub-groups (HSDP or 2-D sharding)
    fw = framework_of(ctx, lg.framework)
    remedy = fw.hybrid_shard(run_facts(ctx, fw))
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
