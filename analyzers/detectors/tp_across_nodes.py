"""`tp-across-nodes`: a tensor-parallel group spans more than one node.

Tensor parallelism puts collectives inside every layer's forward and backward (an all-reduce or
an all-gather / reduce-scatter per parallel block), on the critical path: they are meant for the
intra-node links. A TP group whose ranks sit on two nodes runs each of them over the network.
The usual cause is the mesh's dimension order: `init_device_mesh` lays ranks out row-major, so
only the last dimension's groups are consecutive ranks (one node's, when its size divides the
ranks per node).
"""

from __future__ import annotations

from ..frameworks.hsdp_layout import groups_along, node_map, nodes_spanned, quoted
from ..inputs.mesh_facts import MeshFacts
from ..report import Finding
from ..whatif.run_whatif import Change
from .context import DetectorContext
from .mesh_dims import TP
from .replayed_gain import gain_text, replayed
from .rule import Rule

NOT_ESTIMATED = (
    "not estimated: the run's mesh could not be replayed with the TP dimension last (no "
    "captured mesh, no modelled step, or a layout that keeps a TP group across nodes)"
)


def _inner_tp_mesh(mesh: MeshFacts, tp: str, nodes: tuple[tuple[int, ...], ...]) -> str | None:
    """`init_device_mesh` arguments with the TP dimension last (its groups consecutive ranks),
    when every TP group then sits on one node; None otherwise."""
    order = [d for d in mesh.dims if d.name != tp] + [d for d in mesh.dims if d.name == tp]
    shape = tuple(d.size for d in order)
    ranks = tuple(range(len(mesh.ranks)))
    node_of = node_map(nodes)
    if any(nodes_spanned(g, node_of) > 1 for g in groups_along(shape, ranks, len(shape) - 1)):
        return None
    names = ", ".join(f'"{d.name}"' for d in order)
    return f"{shape}, mesh_dim_names=({names})"


def _finding(
    name: str,
    groups: list[tuple[int, ...]],
    nodes: tuple[tuple[int, ...], ...],
    code_and_text: tuple[str | None, str] | None,
    evidence: dict[str, object],
    gain: tuple[float | None, str] = (None, NOT_ESTIMATED),
) -> Finding | None:
    """The finding for one TP dimension's `groups`, None when none spans two nodes."""
    node_of = node_map(nodes)
    crossing = [g for g in groups if nodes_spanned(g, node_of) > 1]
    if not crossing:
        return None
    per_node = sorted({len(n) for n in nodes})
    code, text = code_and_text or (
        None,
        f"Use a tensor-parallel degree that divides the ranks per node ({per_node[0]}) and put "
        "it last in the mesh, so each TP group stays on one node.",
    )
    size = len(groups[0])
    return Finding(
        id="tp-across-nodes",
        severity="warning",
        title=(
            f"Tensor-parallel groups span nodes: {len(crossing)} of {len(groups)} "
            f'"{name}" groups of {size} ranks cross a node boundary'
        ),
        ranks=sorted({r for g in crossing for r in g}),
        steps=[],
        evidence={
            "tp_dim": name,
            "tp_size": size,
            **evidence,
            "crossing_groups": [list(g) for g in crossing],
            "ranks_per_node": per_node,
        },
        recommendation=text,
        code=code,
        expected_gain_ms=gain[0],
        gain_method=gain[1],
    )


def _gain(ctx: DetectorContext, mesh: MeshFacts, name: str) -> tuple[float | None, str]:
    """(ms per step, how): the replay of the mesh with `name` last (`zdiag whatif --mesh-order`:
    each mesh dimension's collectives on its new group's link, a group inside one node moving
    bytes INTRA_NODE_SPEEDUP times as fast as one across nodes)."""
    order = (*(d.name for d in mesh.dims if d.name != name), name)
    result = replayed(ctx, Change(mesh_order=order))
    if result is None or not result.ranks:
        return None, NOT_ESTIMATED
    if result.gain_ms <= 0:
        return None, (
            f"none predicted: {gain_text(result)}; the other dimensions' groups, now across "
            "nodes, cost more than the TP groups save"
        )
    return round(result.gain_ms, 3), gain_text(result)


def _tp_last(ctx: DetectorContext, mesh: MeshFacts, name: str, size: int) -> tuple[str, str] | None:
    """(code, text) that rebuild the captured mesh with the TP dimension last, when that keeps
    every TP group on one node."""
    inner = _inner_tp_mesh(mesh, name, ctx.sheet.nodes) if name else None
    if inner is None:
        return None
    captured = ctx.model.description.mesh if ctx.model is not None else None
    device = (captured.device_type if captured is not None else None) or "cuda"
    return (
        "from torch.distributed.device_mesh import init_device_mesh\n"
        f'# replaces the run\'s mesh, {mesh.shape} {quoted(mesh.dim_names)}: "{name}" last, so '
        f"each TP group is {size} consecutive ranks of one node\n"
        f'mesh = init_device_mesh("{device}", {inner})',
        f'Build the mesh with "{name}" as its last dimension: init_device_mesh lays ranks out '
        "row-major, so only the last dimension's groups are consecutive ranks (one node's); "
        "slice the other dimensions by name as before.",
    )


def detect(ctx: DetectorContext) -> list[Finding]:
    """The tp-across-nodes findings (one per TP dimension), or none: the captured mesh's TP
    groups, else the traces' "mesh_tp" groups (then without code: no mesh to rebuild)."""
    mesh, nodes = ctx.sheet.mesh, ctx.sheet.nodes
    if len(nodes) < 2:
        return []
    found: list[Finding | None] = []
    if mesh is not None:
        for dim in mesh.dims_with_role(TP):
            shape = {"mesh_shape": list(mesh.shape), "mesh_dim_names": list(mesh.dim_names)}
            code = _tp_last(ctx, mesh, dim.name, dim.size)
            gain = _gain(ctx, mesh, dim.name) if code is not None else (None, NOT_ESTIMATED)
            found.append(_finding(dim.name, list(dim.groups), nodes, code, shape, gain))
    else:
        groups = sorted(m for m, role in ctx.group_roles.items() if role == TP)
        if groups:
            found.append(_finding("tp", groups, nodes, None, {}))
    return [f for f in found if f is not None]


RULE = Rule(
    id="tp-across-nodes",
    summary="a tensor-parallel group spans more than one node",
    detect=detect,
    what=(
        "A tensor-parallel dimension whose groups (the captured mesh's layout, else the traces' "
        "`mesh_tp` process groups) hold ranks of two or more nodes (the manifest's node ranks, "
        "else host names)."
    ),
    why=(
        "TP collectives sit inside every layer's forward and backward, on the critical path; "
        "across nodes each runs over the network instead of the intra-node links."
    ),
    example='Tensor-parallel groups span nodes: 2 of 2 "tp" groups of 2 ranks cross a node boundary.',
    fix=(
        "The run's mesh rebuilt with the TP dimension last (init_device_mesh's row-major layout "
        "makes its groups consecutive ranks of one node), when that keeps every TP group on "
        "one node; else a TP degree that divides the ranks per node."
    ),
    gain=(
        "Replayed (`zdiag whatif --mesh-order`, the TP dimension last): each mesh dimension's "
        "collectives on the link of its new group, a group inside one node moving bytes 2x as "
        "fast as one across nodes (stated, not measured: `--intra-node-speedup`). Not "
        "estimated without a captured mesh or a layout that keeps TP on one node."
    ),
    scope="runs with a TP dimension (captured mesh or pg_config), on two or more nodes",
    markers=None,
)
