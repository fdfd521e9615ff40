"""The device mesh, the tensor-parallel plan and the process groups of a live model.

Read once, with the model description (`model_capture.describe_model`), from what the model holds:

- The mesh: the root (`DeviceMesh._get_root_mesh()`, private, else the mesh itself) of the first
  FSDP2 unit's mesh (its parameter group's private `mesh_info.mesh`), else of the first DTensor
  parameter's public `device_mesh`. Shape, dimension names, device type and the layout
  (`mesh.mesh`, public) are recorded, and per dimension this rank's group
  (`mesh.get_group(dim)`, a lookup: DeviceMesh creates its groups when it is built) with its
  members (`torch.distributed.get_process_group_ranks`) and c10d name (`group_name`).
- The roles: a dimension FSDP2 shards over is "shard", one it replicates over (HSDP) is
  "replicate" (from the units' `mesh_info.shard_mesh_dim` / `replicate_mesh_dim`); one that the
  user's DTensor parameters are placed over besides FSDP's is "tp"; any other is "unused" here
  (a pipeline dimension becomes "pp" when `pipeline_capture.with_pipeline` adds the stages).
- The TP plan: per module, its own DTensor parameters whose mesh has dimensions FSDP does not use,
  with their placements (`str(placement)`: "S(0)", "R", "_S(0, 2)") and a style read from the
  weight: a Linear's weight sharded on dim 0 is "colwise", on dim 1 "rowwise" (an Embedding's the
  other way round).
- The process groups: every group c10d registered on this rank (private `_world.pg_names`, with
  the public `get_process_group_ranks`), its name, description and members.

Every step is contained: what fails is named in the returned notes, never raised. Dimensions are
matched between meshes by name; unnamed dimensions only when the unit's mesh is the root itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .framework_settings import fsdp2_param_group, is_fsdp2, unit_mesh
from .model_schema import (
    MAX_DTENSOR_MODULES,
    MAX_PROCESS_GROUPS,
    DeviceMeshInfo,
    DTensorModule,
    DTensorParam,
    MeshDim,
    ProcessGroupInfo,
)

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    _DTensor = None  # type: ignore[assignment,misc]


@dataclass
class MeshCapture:
    """What `capture_mesh` found (each part empty when absent) and the notes on what failed."""

    mesh: DeviceMeshInfo | None = None
    dtensor_modules: tuple[DTensorModule, ...] = ()
    process_groups: tuple[ProcessGroupInfo, ...] = ()
    notes: list[str] = field(default_factory=list)


def capture_mesh(modules: Sequence[tuple[str, str, Any]]) -> MeshCapture:
    """The mesh facts of the model whose modules are `modules`: (path, user class name, module)
    in pre-order, each module once. Never raises: failures become notes."""
    out = MeshCapture()
    fsdp_meshes: list[tuple[Any, tuple[str, ...]]] = []
    try:
        for _, _, module in modules:
            if is_fsdp2(module):
                mesh, roles = unit_mesh(fsdp2_param_group(module))
                if mesh is not None:
                    fsdp_meshes.append((mesh, roles))
    except Exception as exc:
        out.notes.append(f"FSDP2 meshes not read: {type(exc).__name__}: {exc}")
    fsdp_dims = _fsdp_dim_roles(fsdp_meshes)
    first_dtensor_mesh = None
    try:
        entries, first_dtensor_mesh = _dtensor_modules(modules, set(fsdp_dims))
        if len(entries) > MAX_DTENSOR_MODULES:
            out.notes.append(
                f"{len(entries) - MAX_DTENSOR_MODULES} DTensor modules past the first "
                f"{MAX_DTENSOR_MODULES} left out"
            )
        out.dtensor_modules = tuple(entries[:MAX_DTENSOR_MODULES])
    except Exception as exc:
        out.notes.append(f"DTensor placements not read: {type(exc).__name__}: {exc}")
    seed = fsdp_meshes[0][0] if fsdp_meshes else first_dtensor_mesh
    if seed is not None:
        try:
            tp_dims = {d for m in out.dtensor_modules for d in m.tp_dims}
            out.mesh = _mesh_info(_root(seed), fsdp_dims, tp_dims, fsdp_meshes)
        except Exception as exc:
            out.notes.append(f"device mesh not read: {type(exc).__name__}: {exc}")
    try:
        out.process_groups = _process_groups()
    except Exception as exc:
        out.notes.append(f"process groups not read: {type(exc).__name__}: {exc}")
    return out


# ------------------------------------------------------------------------- the mesh
def _root(mesh: Any) -> Any:
    """The mesh `mesh` was sliced from (itself when it is a root)."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    try:
        root = get_root() if callable(get_root) else None
    except Exception:
        root = None
    return root if root is not None else mesh


def _fsdp_dim_roles(meshes: Iterable[tuple[Any, tuple[str, ...]]]) -> dict[str, str]:
    """{dimension name: "shard" | "replicate"} over the FSDP2 units' meshes (the first unit that
    names a dimension decides)."""
    roles: dict[str, str] = {}
    for mesh, unit_roles in meshes:
        for name, role in zip(mesh.mesh_dim_names or (), unit_roles, strict=False):
            if role != "unused":
                roles.setdefault(name, role)
    return roles


def _mesh_info(
    root: Any,
    fsdp_dims: dict[str, str],
    tp_dims: set[str],
    fsdp_meshes: list[tuple[Any, tuple[str, ...]]],
) -> DeviceMeshInfo:
    """The root mesh's shape, names, layout, and per dimension its role and this rank's group."""
    shape = tuple(int(n) for n in root.shape)
    names = tuple(root.mesh_dim_names or ())
    by_index: dict[int, str] = {}
    for mesh, unit_roles in fsdp_meshes:  # an unnamed mesh: only when the unit uses the root
        if mesh is root and not names:
            by_index.update((i, r) for i, r in enumerate(unit_roles) if r != "unused")
    dims = []
    for i, size in enumerate(shape):
        name = names[i] if i < len(names) else ""
        role = fsdp_dims.get(name) if name else by_index.get(i)
        if role is None:
            role = "tp" if name and name in tp_dims else "unused"
        ranks, group_name = _dim_group(root, i)
        dims.append(MeshDim(name, size, role, ranks, group_name))
    layout = root.mesh
    return DeviceMeshInfo(
        shape=shape,
        dim_names=names,
        device_type=str(getattr(root, "device_type", "")),
        ranks=tuple(int(r) for r in layout.flatten().tolist()),
        dims=tuple(dims),
    )


def _dim_group(mesh: Any, dim: int) -> tuple[tuple[int, ...], str | None]:
    """This rank's group along `dim` of `mesh`: its members and c10d name (empty when unknown)."""
    try:
        group = mesh.get_group(dim)
        ranks = tuple(int(r) for r in torch.distributed.get_process_group_ranks(group))
    except Exception:
        return (), None
    name = getattr(group, "group_name", None)
    return ranks, str(name) if name is not None else None


# ------------------------------------------------------------------------- the TP plan
def _dtensor_modules(
    modules: Sequence[tuple[str, str, Any]], fsdp_dims: set[str]
) -> tuple[list[DTensorModule], Any]:
    """The modules whose own DTensor parameters span dimensions FSDP does not use, and the first
    DTensor parameter's mesh (None without one)."""
    if _DTensor is None:
        return [], None
    entries: list[DTensorModule] = []
    first_mesh = None
    for path, cls, module in modules:
        params = [
            (name, p)
            for name, p in module._parameters.items()
            if p is not None and isinstance(p, _DTensor)
        ]
        if not params:
            continue
        mesh = params[0][1].device_mesh
        first_mesh = first_mesh if first_mesh is not None else mesh
        names = tuple(mesh.mesh_dim_names or ())
        tp = tuple(n for n in names if n not in fsdp_dims)
        if not tp:
            continue
        entries.append(
            DTensorModule(
                path=path,
                cls=cls,
                mesh_dims=names,
                tp_dims=tp,
                style=_style(cls, params, names.index(tp[0])),
                params=tuple(
                    DTensorParam(name, tuple(str(pl) for pl in p.placements)) for name, p in params
                ),
            )
        )
    return entries, first_mesh


def _style(cls: str, params: list[tuple[str, Any]], dim: int) -> str:
    """ "colwise" / "rowwise" from the weight's placement on mesh dimension `dim` (a Linear's
    output features are dim 0, an Embedding's are dim 1), "replicate", or "other"."""
    weight = next((p for name, p in params if name == "weight"), params[0][1])
    placement = weight.placements[dim]
    if placement.is_replicate():
        return "replicate"
    if not placement.is_shard():
        return "other"
    sharded = getattr(placement, "dim", None)
    out_dim = 1 if "Embedding" in cls else 0
    if sharded == out_dim:
        return "colwise"
    if sharded == 1 - out_dim and weight.ndim == 2:
        return "rowwise"
    return "other"


# ------------------------------------------------------------------------- process groups
def _process_groups() -> tuple[ProcessGroupInfo, ...]:
    """Every process group c10d registered on this rank, with its members."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return ()
    from torch.distributed import distributed_c10d

    out = []
    for pg, name in list(distributed_c10d._world.pg_names.items())[:MAX_PROCESS_GROUPS]:
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(pg))
        out.append(ProcessGroupInfo(str(name), str(getattr(pg, "group_desc", "") or ""), ranks))
    return tuple(out)
