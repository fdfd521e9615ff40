"""Which mesh dimension a process-group instance belongs to, for the detectors.

A group instance is known by its members (a name is not a group: the replicate group of rank 0
is {0, 2}, of rank 1 {1, 3}, both maybe named alike). Its dimension comes from the captured mesh
(`RunFactSheet.mesh`: each dimension's role and every group along it), else, for traces recorded
without a captured model, from the trace header's `pg_config` descriptions: DeviceMesh names the
groups it creates `mesh_<dim name>` ("mesh_tp", "mesh_dp", "mesh_replicate").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..inputs.mesh_facts import MeshFacts

if TYPE_CHECKING:
    from ..rank.rank_analysis import RankFacts

TP = "tp"
MESH_PREFIX = "mesh_"
# dimension names -> role, for a mesh known only by its pg_config descriptions (torchtitan's and
# the PyTorch tutorials' names)
ROLE_BY_NAME = {
    "tp": TP,
    "tensor": TP,
    "replicate": "replicate",
    "dp_replicate": "replicate",
    "shard": "shard",
    "dp_shard": "shard",
    "dp": "shard",
    "fsdp": "shard",
    "pp": "pp",
}


def group_roles(mesh: MeshFacts | None, facts: Iterable[RankFacts]) -> dict[tuple[int, ...], str]:
    """{group members: role} of the run's mesh groups ("shard", "replicate", "tp", "pp",
    "unused"): the captured `mesh`'s, then what the ranks' pg_config descriptions add."""
    roles: dict[tuple[int, ...], str] = {}
    by_name = {d.name: d.role for d in mesh.dims} if mesh is not None else {}
    if mesh is not None:
        for d in mesh.dims:
            for g in d.groups:
                roles[tuple(sorted(g))] = d.role
    for f in facts:
        for pg in f.process_groups:
            if pg.ranks is None or not pg.description.startswith(MESH_PREFIX):
                continue
            name = pg.description[len(MESH_PREFIX) :]
            role = by_name.get(name) or ROLE_BY_NAME.get(name)
            if role is not None:
                roles.setdefault(tuple(pg.ranks), role)
    return roles


def tensor_parallel(mesh: MeshFacts | None, roles: dict[tuple[int, ...], str]) -> bool:
    """Whether the run has a tensor-parallel dimension (its collectives are not FSDP traffic):
    in the captured `mesh`, or among the group `roles`."""
    return bool(mesh is not None and mesh.dims_with_role(TP)) or TP in roles.values()
