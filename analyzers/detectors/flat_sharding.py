"""`flat-sharding-multinode`: FSDP shards over every rank of a multi-node job.

Then every all-gather and reduce-scatter crosses the network. Hybrid sharding (HSDP: shard within
a node, replicate across nodes) keeps those collectives on the fast intra-node links and leaves
one gradient all-reduce across nodes, as long as the model state fits a node's memory.
"""

from __future__ import annotations

from ..frameworks import fsdp2
from ..rank.fsdp_ledger import RankLedger
from ..report import Finding
from ..whatif.mesh_shape import INTRA_NODE_SPEEDUP
from ..whatif.run_whatif import Change
from .context import DetectorContext
from .replayed_gain import gain_text, replayed
from .rule import Rule, Threshold


def fsdp_group(ctx: DetectorContext, rank: int) -> tuple[int, ...] | None:
    """The ranks `rank` shards its parameters with: its group along the captured mesh's shard
    dimension; else the world when its collectives run in world-sized groups; None when FSDP
    already replicates across a dimension (HSDP) or runs in sub-groups of unknown members."""
    mesh = ctx.sheet.mesh
    if mesh is not None and mesh.dims_with_role("replicate"):
        return None
    shard = mesh.dims_with_role("shard") if mesh is not None else ()
    if len(shard) == 1:
        return shard[0].group_of(rank)
    world = ctx.sheet.world_size
    groups = ctx.group_sizes(rank)
    if not world or (groups and max(groups) < world):
        return None  # FSDP already runs in sub-groups (HSDP or 2-D sharding)
    return tuple(range(world))


def nodes_spanned(ctx: DetectorContext, group: tuple[int, ...]) -> int:
    """How many nodes the group's ranks sit on (the manifest's node count for the whole world
    when the nodes' ranks are unknown)."""
    nodes = ctx.sheet.nodes
    if nodes:
        return sum(1 for node in nodes if set(node) & set(group))
    world = ctx.sheet.world_size
    nnodes = ctx.sheet.nnodes or 1
    return nnodes if world and len(group) == world and world % nnodes == 0 else 1


def shards_across_nodes(ctx: DetectorContext) -> bool:
    """Whether some rank shards its parameters with ranks on other nodes (no HSDP yet)."""
    for rank in sorted(ctx.breakdowns):
        group = fsdp_group(ctx, rank)
        if group is not None and nodes_spanned(ctx, group) > 1:
            return True
    return False


def hsdp_change(ctx: DetectorContext) -> Change | None:
    """The HSDP shape the replay can run on this run: (nodes, ranks per node) when FSDP shards
    over the whole world on two or more nodes of equal size; None otherwise (sub-groups, one
    node, or a mesh whose FSDP groups sit beside other dimensions)."""
    ledgers = ctx.fsdp_ledgers()
    group = fsdp_group(ctx, ledgers[0].rank) if ledgers else None
    if group is None:
        return None
    spanned = nodes_spanned(ctx, group)
    if spanned < 2 or len(group) != ctx.sheet.world_size or len(group) % spanned:
        return None
    return Change(mesh_shape=(spanned, len(group) // spanned))


def cross_node_bytes(lg: RankLedger, replicas: int, shard_size: int) -> dict[str, int] | None:
    """Bytes per step one rank exchanges with other nodes: now (of every gather it receives and
    every reduce-scatter it sends, the share held by the other nodes: 1 - 1/nodes) and with HSDP
    (only the ring all-reduce of its gradient shard across the replicas: 2 (r-1)/r x reduced
    bytes / shard size); None when the ledger has no message sizes."""
    n_steps = max(1, len(lg.steps))
    gathered = sum(r.bytes for r in lg.gathers if r.bytes > 0) / n_steps
    reduced = sum(r.bytes for r in lg.reduces if r.bytes > 0) / n_steps
    if not gathered and not reduced:
        return None
    now = (1 - 1 / replicas) * (gathered + reduced)
    hsdp = 2 * (replicas - 1) / replicas * reduced / shard_size
    return {"now": int(now), "hsdp": int(hsdp)}


def detect(ctx: DetectorContext) -> list[Finding]:
    """The flat-sharding-multinode finding, or none."""
    ledgers = ctx.fsdp_ledgers()
    if not ledgers:
        return []
    lg = ledgers[0]
    group = fsdp_group(ctx, lg.rank)
    if group is None:
        return []
    spanned = nodes_spanned(ctx, group)
    if spanned < 2:
        return []
    facts = ctx.sheet.run_facts()
    remedy = ctx.sheet.framework.hybrid_shard(facts)
    if remedy is None:
        return []  # the run already shards hierarchically (or the framework has no such mode)
    n_steps = max(1, len(lg.steps))
    exposed = sum(r.exposed_us for r in lg.records) / 1e3 / n_steps
    world = ctx.sheet.world_size
    evidence: dict[str, object] = {
        "world_size": world,
        "nnodes": ctx.sheet.nnodes,
        "group_sizes": sorted(ctx.group_sizes(lg.rank)),
        "exposed_fsdp_comm_ms_per_step": round(exposed, 3),
    }
    title = f"FSDP shards across all {world} ranks on {ctx.sheet.nnodes} nodes"
    if len(group) != world:
        title = f"FSDP shards across {len(group)} ranks on {spanned} nodes"
        evidence["fsdp_group"] = list(group)
        evidence["nodes_spanned"] = spanned
    layout = fsdp2.hsdp_layout(facts) if ctx.sheet.framework.name == fsdp2.NAME else None
    if layout is not None:
        cut = cross_node_bytes(lg, layout.replicas, layout.shard_size)
        if cut is not None:
            evidence["cross_node_bytes_per_step_per_rank"] = cut
    gain, method = _gain(ctx, exposed)
    return [
        Finding(
            id="flat-sharding-multinode",
            severity="warning",
            title=title,
            ranks=[x.rank for x in ledgers],
            steps=list(lg.steps),
            evidence=evidence,
            recommendation=(
                f"Use hybrid sharding (HSDP): {remedy.text}, if the model state fits in one "
                "node's memory."
            ),
            code=remedy.code,
            expected_gain_ms=gain,
            gain_method=method,
        )
    ]


def _gain(ctx: DetectorContext, exposed: float) -> tuple[float | None, str]:
    """(ms per step, how): the replay of the HSDP shape (`zdiag whatif --mesh-shape
    nodes,ranks-per-node`: the shard groups inside a node, their bytes INTRA_NODE_SPEEDUP times
    as fast, a replicate all-reduce across nodes); where the run cannot be replayed on another
    shape, the exposed FSDP comm time x (1 - 1/INTRA_NODE_SPEEDUP)."""
    change = hsdp_change(ctx)
    if change is not None:
        result = replayed(ctx, change)
        if result is not None and result.ranks:
            if result.gain_ms <= 0:
                return None, (
                    f"none predicted: {gain_text(result)}; the added all-reduce across nodes "
                    "costs more than the faster gathers save"
                )
            return round(result.gain_ms, 3), gain_text(result)
    return round(exposed * (1 - 1 / INTRA_NODE_SPEEDUP), 3), (
        f"exposed FSDP comm time x (1 - 1/{INTRA_NODE_SPEEDUP:g}): assumes intra-node "
        "collectives at least 2x faster than the cross-node ones they replace (the run's "
        "steps could not be replayed on the HSDP shape)"
    )


RULE = Rule(
    id="flat-sharding-multinode",
    summary="FSDP shards over every rank of a multi-node job",
    detect=detect,
    what=(
        "FSDP shards over every rank of a multi-node job: more than one node, and the FSDP "
        "groups span the whole world (no sub-groups: not HSDP or 2-D sharding already); or, on "
        "a captured mesh with other dimensions (TP, PP), FSDP's shard groups span several "
        "nodes and no dimension replicates. Nodes: the manifest's node ranks, else hosts."
    ),
    why=(
        "Every all-gather and reduce-scatter then crosses the network. Hybrid sharding (shard "
        "within a node, replicate across nodes) keeps them on the fast intra-node links and "
        "leaves one gradient all-reduce across nodes, as long as the model state fits a node."
    ),
    example="FSDP shards across all 16 ranks on 2 nodes.",
    fix=(
        "An HSDP mesh built from the run's host layout, `(nnodes, ranks_per_node)` (an explicit "
        "`DeviceMesh` when nodes hold non-consecutive ranks); on a mesh with TP/PP, the run's "
        "mesh with its FSDP dimension split into `<dim>_replicate` x `<dim>_shard` and the "
        'pair flattened back into `<dim>` (the script\'s other `mesh["<dim>"]` keeps its '
        "ranks). The evidence gives the cross-node bytes per step before and after."
    ),
    gain=(
        "Replayed: the step on the HSDP shape (`zdiag whatif --mesh-shape nodes,ranks-per-node`), "
        "the shard groups' bytes INTRA_NODE_SPEEDUP times as fast inside a node, plus the "
        "replicate all-reduce across nodes; else half the exposed FSDP communication."
    ),
    scope="multi-node FSDP/ZeRO runs (nodes from the manifest, else distinct trace hosts)",
    fsdp_only=True,
    thresholds=(
        Threshold(
            "INTRA_NODE_SPEEDUP",
            INTRA_NODE_SPEEDUP,
            "HSDP replaces cross-node gathers with intra-node ones. NVLink/xGMI is typically "
            ">= 4x the per-GPU network bandwidth; the replay claims only half of that for the "
            "bytes of the collectives that move inside a node (`zdiag whatif "
            "--intra-node-speedup` sets another).",
        ),
    ),
    markers=(),
)
