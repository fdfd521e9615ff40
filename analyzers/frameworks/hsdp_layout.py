"""HSDP meshes built from a run's host layout: shard within a node, replicate across nodes.

`flat_hsdp` is for a run that shards over the flat world: a (nodes, ranks per node) mesh whose
rows are the nodes. `split_dp` is for a run whose mesh already has other dimensions (tensor
parallel, pipeline): its one FSDP dimension is split in place into `<dim>_replicate` (across
the nodes it spans) and `<dim>_shard` (within one node), the other dimensions unchanged, so the
TP groups stay what they were. Both check the result against the nodes (every shard group on
one node) and give None when the layout cannot do it (nodes of unequal rank counts, a dimension
that does not divide).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import FsdpMesh


@dataclass(frozen=True)
class HsdpLayout:
    """A proposed HSDP mesh: `shape`, `dim_names` and row-major `ranks` of the whole new root
    mesh, `fsdp_dims` the two dimensions FSDP takes (replicate, shard), `replaces` the run's
    own mesh it replaces (None: the run has none, FSDP shards over the world)."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    ranks: tuple[int, ...]
    fsdp_dims: tuple[str, str]
    device_type: str
    replaces: FsdpMesh | None = None

    @property
    def replicas(self) -> int:
        """Size of the replicate dimension (the nodes a shard group's replicas sit on)."""
        return self.shape[self.dim_names.index(self.fsdp_dims[0])]

    @property
    def shard_size(self) -> int:
        """Size of the shard dimension (ranks one shard group spans, on one node)."""
        return self.shape[self.dim_names.index(self.fsdp_dims[1])]

    def build(self) -> str:
        """The expression that builds the mesh (`init_device_mesh` when the layout is row-major
        0..n-1, else `DeviceMesh` over the explicit layout)."""
        names = ", ".join(f'"{n}"' for n in self.dim_names)
        if self.ranks == tuple(range(len(self.ranks))):
            shape = "(" + ", ".join(map(str, self.shape)) + ")"
            return f'init_device_mesh("{self.device_type}", {shape}, mesh_dim_names=({names}))'
        return f'DeviceMesh("{self.device_type}", {nested(self.shape, self.ranks)}, mesh_dim_names=({names}))'

    def import_line(self) -> str:
        """The import the build expression needs."""
        name = "init_device_mesh" if self.ranks == tuple(range(len(self.ranks))) else "DeviceMesh"
        return f"from torch.distributed.device_mesh import {name}"


def quoted(names: tuple[str, ...]) -> str:
    """Dimension names as the code writes them: `("dp", "tp")`."""
    return "(" + ", ".join(f'"{n}"' for n in names) + ("," if len(names) == 1 else "") + ")"


def nested(shape: tuple[int, ...], ranks: tuple[int, ...]) -> str:
    """A row-major layout as a nested list literal of `shape`."""
    rows: list[Any] = list(ranks)
    for size in reversed(shape[1:]):
        rows = [rows[i : i + size] for i in range(0, len(rows), size)]
    return repr(rows)


def groups_along(shape: tuple[int, ...], ranks: tuple[int, ...], dim: int) -> list[list[int]]:
    """Every group along dimension `dim` of a row-major layout."""
    arr = np.asarray(ranks).reshape(shape)
    groups: list[list[int]] = np.moveaxis(arr, dim, -1).reshape(-1, shape[dim]).tolist()
    return groups


def node_map(nodes: Sequence[Sequence[int]]) -> dict[int, int]:
    """{rank: the index of its node} from each node's ranks."""
    return {r: k for k, node in enumerate(nodes) for r in node}


def nodes_spanned(group: Sequence[int], node_of: Mapping[int, int]) -> int:
    """How many nodes a group's ranks sit on (a rank on no known node counts as one more)."""
    return len({node_of.get(r, -1) for r in group})


def _fits(layout: HsdpLayout, nodes: tuple[tuple[int, ...], ...]) -> bool:
    """Whether every shard group lies on one node and every replicate group on distinct ones."""
    node_of = node_map(nodes)
    if set(node_of) != set(layout.ranks):
        return False
    rep, shard = (layout.dim_names.index(d) for d in layout.fsdp_dims)
    return all(
        nodes_spanned(g, node_of) == 1 for g in groups_along(layout.shape, layout.ranks, shard)
    ) and all(
        nodes_spanned(g, node_of) == len(g) for g in groups_along(layout.shape, layout.ranks, rep)
    )


def flat_hsdp(nodes: tuple[tuple[int, ...], ...], device_type: str) -> HsdpLayout | None:
    """(nodes, ranks per node) ("replicate", "shard"), each row one node's ranks; None with
    fewer than two nodes, nodes of unequal rank counts or of one rank each."""
    sizes = {len(n) for n in nodes}
    if len(nodes) < 2 or len(sizes) != 1 or min(sizes) < 2:
        return None  # one rank per node: nothing to shard within a node
    layout = HsdpLayout(
        shape=(len(nodes), sizes.pop()),
        dim_names=("replicate", "shard"),
        ranks=tuple(r for node in nodes for r in node),
        fsdp_dims=("replicate", "shard"),
        device_type=device_type,
    )
    return layout if _fits(layout, nodes) else None


def split_dp(mesh: FsdpMesh, nodes: tuple[tuple[int, ...], ...]) -> HsdpLayout | None:
    """The run's mesh with its one FSDP dimension split into `<dim>_replicate` (across the nodes
    its groups span) and `<dim>_shard` (within one node); None when FSDP already uses two
    dimensions, its groups sit on one node, a shard group would hold one rank (plain replication:
    the other dimensions fill each node), or the split does not keep shard groups on a node."""
    if len(mesh.fsdp_dims) != 1 or not mesh.dim_names:
        return None
    i = mesh.dim_names.index(mesh.fsdp_dims[0])
    node_of = node_map(nodes)
    if set(node_of) != set(mesh.ranks):
        return None
    spans = {nodes_spanned(g, node_of) for g in groups_along(mesh.shape, mesh.ranks, i)}
    replicas = max(spans)
    size = mesh.shape[i]
    if replicas < 2 or size % replicas or size // replicas < 2:
        return None  # a shard group of one rank would be plain replication, not HSDP
    name = mesh.dim_names[i]
    layout = HsdpLayout(
        shape=(*mesh.shape[:i], replicas, size // replicas, *mesh.shape[i + 1 :]),
        dim_names=(
            *mesh.dim_names[:i],
            f"{name}_replicate",
            f"{name}_shard",
            *mesh.dim_names[i + 1 :],
        ),
        ranks=mesh.ranks,
        fsdp_dims=(f"{name}_replicate", f"{name}_shard"),
        device_type=mesh.device_type,
        replaces=mesh,
    )
    return layout if _fits(layout, nodes) else None
