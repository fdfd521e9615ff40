"""The run's device mesh as detectors read it: dimensions, roles, every rank's group, the TP plan.

Built from a model description (`zdiag.model/1.1`, collectors/mesh_capture.py says what is
captured); descriptions without a mesh (older files, models with no DeviceMesh: DDP, FSDP1,
DeepSpeed; traces recorded elsewhere) give None. FSDP2 without `mesh=` has a 1-D mesh of the world. One rank's description is enough: the layout (`ranks`, row-major over
`shape`) gives every rank's group along every dimension; the capturing rank's own groups, as c10d
reported them, are kept beside it (`captured_groups`) so a reader can check the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ...collectors.model_schema import DeviceMeshInfo, DTensorModule, ProcessGroupInfo


@dataclass(frozen=True)
class MeshDimFacts:
    """One mesh dimension: its name, size, role ("shard", "replicate", "tp", "pp", "unused") and the
    groups along it (each a tuple of global ranks; every rank of the mesh is in exactly one)."""

    name: str
    size: int
    role: str
    groups: tuple[tuple[int, ...], ...] = ()

    def group_of(self, rank: int) -> tuple[int, ...] | None:
        """The members of `rank`'s group along this dimension; None when `rank` is not in it."""
        return next((g for g in self.groups if rank in g), None)


@dataclass(frozen=True)
class TpEntry:
    """One module of the tensor-parallel plan: "colwise", "rowwise", "replicate" or "other" over
    the mesh dimensions `dims`."""

    path: str
    cls: str
    style: str
    dims: tuple[str, ...]


@dataclass(frozen=True)
class MeshFacts:
    """The device mesh of a run (module docstring)."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    ranks: tuple[int, ...]
    dims: tuple[MeshDimFacts, ...]
    tp_plan: tuple[TpEntry, ...] = ()
    process_groups: tuple[ProcessGroupInfo, ...] = ()
    captured_rank: int = 0
    captured_groups: tuple[tuple[int, ...], ...] = ()  # per dimension, as c10d reported them

    @property
    def ndim(self) -> int:
        """The number of mesh dimensions."""
        return len(self.shape)

    def dim(self, name: str) -> MeshDimFacts | None:
        """The dimension named `name`, None when there is none."""
        return next((d for d in self.dims if d.name == name), None)

    def dims_with_role(self, role: str) -> tuple[MeshDimFacts, ...]:
        """The dimensions whose role is `role` ("shard", "replicate", "tp", "pp", "unused")."""
        return tuple(d for d in self.dims if d.role == role)

    def groups_of(self, rank: int) -> dict[str, tuple[int, ...]]:
        """{dimension name: the members of `rank`'s group along it} (unnamed: "dim<i>")."""
        out = {}
        for i, d in enumerate(self.dims):
            group = d.group_of(rank)
            if group is not None:
                out[d.name or f"dim{i}"] = group
        return out


def mesh_groups(
    shape: tuple[int, ...], ranks: tuple[int, ...], dim: int
) -> tuple[tuple[int, ...], ...]:
    """The groups along dimension `dim` of a row-major layout `ranks` of `shape`: the ranks that
    differ only in their coordinate on `dim`, in layout order; () when the layout does not fit."""
    if not shape or len(ranks) != prod(shape) or not 0 <= dim < len(shape):
        return ()
    stride = prod(shape[dim + 1 :])
    size = shape[dim]
    groups = []
    for start in range(len(ranks)):
        if (start // stride) % size:  # not the first coordinate on `dim`
            continue
        groups.append(tuple(ranks[start + k * stride] for k in range(size)))
    return tuple(groups)


def mesh_facts(
    mesh: DeviceMeshInfo | None,
    dtensor_modules: tuple[DTensorModule, ...] = (),
    process_groups: tuple[ProcessGroupInfo, ...] = (),
    rank: int = 0,
) -> MeshFacts | None:
    """The mesh facts of a description's parts; None without a mesh."""
    if mesh is None or not mesh.shape:
        return None
    dims = []
    for i, size in enumerate(mesh.shape):
        captured = mesh.dims[i] if i < len(mesh.dims) else None
        dims.append(
            MeshDimFacts(
                name=captured.name if captured else (mesh.dim_names[i : i + 1] or ("",))[0],
                size=size,
                role=captured.role if captured else "unused",
                groups=mesh_groups(mesh.shape, mesh.ranks, i),
            )
        )
    return MeshFacts(
        shape=mesh.shape,
        dim_names=mesh.dim_names,
        ranks=mesh.ranks,
        dims=tuple(dims),
        tp_plan=tuple(TpEntry(m.path, m.cls, m.style, m.tp_dims) for m in dtensor_modules),
        process_groups=process_groups,
        captured_rank=rank,
        captured_groups=tuple(d.group_ranks for d in mesh.dims),
    )
