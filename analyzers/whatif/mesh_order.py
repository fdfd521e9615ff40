"""The run's device mesh with its dimensions in another order: which groups cross nodes.

`init_device_mesh` lays the ranks out row-major, so only the last dimension's groups are
consecutive ranks; on a multi-node run the order decides which dimension's groups stay inside a
node. `zdiag whatif --mesh-order dp,tp` rebuilds the captured mesh with its dimensions in that
order, each rank on the node it ran on, and re-times every collective of a mesh dimension:

- **Its group, before and after.** A collective's process group is matched by its members (the
  traces' process-group table) to the rank's group along one mesh dimension; in the new layout
  the rank's group along that dimension is the one `groups_along` gives. A group crosses nodes
  when its ranks sit on two or more of them (the manifest's node ranks, else the hosts).
- **The link.** A collective whose group moves inside one node from a group that crossed nodes
  moves its bytes `intra_node_speedup` times faster; the reverse, that many times slower; its
  fitted latency stays (`mesh_shape.Fabric.link`). The groups keep their sizes, so nothing else
  changes: the same collectives, the same bytes, the same memory.

Collectives on groups that are not one mesh dimension's (the world, a flattened dimension, or a
run whose process-group table does not list members) keep their measured link; the notes count
them. Limits: as for mesh shapes, one stated link speed per side of a node boundary, not
measured; groups sharing a link at once are not modelled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import msgspec

from ..frameworks.hsdp_layout import groups_along, node_map, nodes_spanned
from ..inputs.mesh_facts import MeshFacts
from ..rank.step_model import StepModel
from .mesh_shape import link_factor
from .platform import CommFit, latency_part


class MeshOrderError(ValueError):
    """The run cannot be replayed with its mesh in another order (the message says why)."""


@dataclass(frozen=True)
class Regrouping:
    """One rank under the reorder: its group along each mesh dimension ({name: (members as run,
    members in the new layout)}), its process groups' members by name, each rank's node (one
    map shared by every rank), and the stated link speed inside a node against across nodes."""

    groups: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    members: Mapping[str, tuple[int, ...]]
    node_of: Mapping[int, int]
    speedup: float

    def crosses(self, ranks: Sequence[int]) -> bool:
        """Whether `ranks` sit on two or more nodes."""
        return nodes_spanned(ranks, self.node_of) > 1

    @cached_property
    def _by_members(self) -> dict[frozenset[int], tuple[tuple[int, ...], tuple[int, ...]]]:
        return {frozenset(b): (b, a) for b, a in self.groups.values()}

    def regrouped(self, lane: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(members as run, members in the new layout) of the mesh-dimension group a collective
        on `lane` ran on; None when its group is no one dimension's."""
        ranks = self.members.get(lane.rsplit("|", 1)[0])
        return self._by_members.get(frozenset(ranks)) if ranks else None


def check_order(
    mesh: MeshFacts | None, order: Sequence[str], nodes: Sequence[Sequence[int]]
) -> MeshFacts:
    """The captured `mesh`, or MeshOrderError unless `order` reorders it on a run of several
    nodes."""
    if mesh is None:
        raise MeshOrderError(
            "reordering the mesh needs the run's device mesh, which 'zdiag run' captures from "
            "the model (these traces come without one)"
        )
    names = tuple(mesh.dim_names)
    if sorted(order) != sorted(names) or len(set(order)) != len(order):
        raise MeshOrderError(
            f"--mesh-order names each of the run's mesh dimensions once ({','.join(names)}), "
            f"not {','.join(order)}"
        )
    if tuple(order) == names:
        raise MeshOrderError(f"the run's mesh is already in the order {','.join(names)}")
    if len(nodes) < 2:
        raise MeshOrderError(
            "the mesh's order decides which groups stay inside a node, and this run has one "
            "node (or its nodes are not known), so the order changes nothing here"
        )
    return mesh


def regroupings(
    mesh: MeshFacts,
    order: Sequence[str],
    ranks: Iterable[int],
    nodes: Sequence[Sequence[int]],
    members: Mapping[int, Mapping[str, tuple[int, ...]]],
    speedup: float,
) -> dict[int, Regrouping]:
    """Each of `ranks` under the mesh laid out in `order` (`members`: per rank, its process
    groups' ranks by name); the new layout's groups and the nodes are worked out once."""
    shape = tuple(next(d.size for d in mesh.dims if d.name == n) for n in order)
    layout = tuple(mesh.ranks)
    after_of = {
        name: {r: tuple(g) for g in groups_along(shape, layout, i) for r in g}
        for i, name in enumerate(order)
    }
    node_of = node_map(nodes)
    out = {}
    for rank in ranks:
        groups: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for name in order:
            dim = mesh.dim(name)
            before = dim.group_of(rank) if dim is not None else None
            after = after_of[name].get(rank)
            if before is not None and after is not None:
                groups[name] = (tuple(before), after)
        out[rank] = Regrouping(groups, members.get(rank, {}), node_of, speedup)
    return out


def reordered(model: StepModel, regroup: Regrouping, fits: Mapping[str, CommFit]) -> StepModel:
    """The step with each mesh dimension's collectives on the link of the rank's new group
    (the others as measured)."""
    ops = []
    for op in model.ops:
        found = regroup.regrouped(op.lane)
        if found is None:
            ops.append(op)
            continue
        link = link_factor(regroup.crosses(found[0]), regroup.crosses(found[1]), regroup.speedup)
        a = latency_part(op, fits)
        ops.append(msgspec.structs.replace(op, dur_us=a + (op.dur_us - a) * link))
    return msgspec.structs.replace(model, ops=ops)


def order_notes(
    mesh: MeshFacts, order: Sequence[str], regroup: Regrouping, kept: int, retimed: int
) -> list[str]:
    """Which dimensions' groups cross nodes before and after, the link speed assumed, and the
    collectives kept on their measured link (`kept` of `kept + retimed`, per step)."""

    def where(ranks: Sequence[int]) -> str:
        return "across nodes" if regroup.crosses(ranks) else "inside a node"

    moves = "; ".join(
        f'"{name}" {where(before)} -> {where(after)}'
        for name, (before, after) in regroup.groups.items()
        if len(before) > 1
    )
    notes = [
        f"mesh order: the run's mesh ({','.join(mesh.dim_names)}) {tuple(mesh.shape)} laid out "
        f"as ({','.join(order)}), each rank on its node: {moves} (docs/whatif.md)",
        f"a group inside one node is assumed to move bytes {regroup.speedup:g}x as fast as one "
        "across nodes (--intra-node-speedup; stated, not measured); latencies stay as measured",
    ]
    if kept:
        notes.append(
            f"{kept} of {kept + retimed} collectives per step are on groups that are not one "
            "mesh dimension's (the world, a flattened dimension, or members the traces do not "
            "list): they keep their measured link"
        )
    return notes
