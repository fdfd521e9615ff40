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
from ..run.comm_dimensions import dimension_role

if TYPE_CHECKING:
    from ..rank.rank_analysis import RankFacts

TP = "tp"
MESH_PREFIX = "mesh_"
# the report's dimension roles (run/comm_dimensions.py, from the dimension's name) -> the
# captured mesh's role vocabulary the detectors use
_MESH_ROLE = {"dp-shard": "shard", "dp": "shard", "dp-replicate": "replicate", "tp": TP, "pp": "pp"}


def _role_by_name(name: str) -> str | None:
    """A dimension's role from its name alone (torchtitan's and the tutorials' names)."""
    return _MESH_ROLE.get(dimension_role(name, (), None)[0])


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
            role = by_name.get(name) or _role_by_name(name)
            if role is not None:
                roles.setdefault(tuple(pg.ranks), role)
    return roles


def tensor_parallel(mesh: MeshFacts | None, roles: dict[tuple[int, ...], str]) -> bool:
    """Whether the run has a tensor-parallel dimension (its collectives are not FSDP traffic):
    in the captured `mesh`, or among the group `roles`."""
    return bool(mesh is not None and mesh.dims_with_role(TP)) or TP in roles.values()
