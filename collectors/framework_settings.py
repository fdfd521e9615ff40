"""What each framework's wrapper says about its settings, read from the live objects: FSDP2 units,
FSDP1 instances, DDP, the DeepSpeed engine, and optimizers (`model_capture.py` says where torch
keeps each; every private attribute is read with a fallback and listed in `missing` when absent).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .model_schema import (
    MAX_PREFETCH_NAMES,
    DdpConfig,
    DeepSpeedConfig,
    Fsdp1Instance,
    Fsdp2Unit,
    OptimizerInfo,
    Precision,
)

_OPTIMIZER_OPTIONS = (
    "lr",
    "foreach",
    "fused",
    "capturable",
    "differentiable",
    "weight_decay",
    "momentum",
    "betas",
    "eps",
)

try:  # public since torch 2.6
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
except ImportError:  # pragma: no cover - older torch, or built without distributed
    _FSDPModule = None  # type: ignore[assignment,misc]

try:
    from torch.distributed.fsdp import FullyShardedDataParallel as _FSDP1
    from torch.distributed.fsdp._flat_param import FlatParameter as _FlatParameter
except ImportError:  # pragma: no cover
    _FSDP1 = None  # type: ignore[assignment,misc]
    _FlatParameter = None  # type: ignore[assignment,misc]

try:
    from torch.nn.parallel import DistributedDataParallel as _DDP
except ImportError:  # pragma: no cover
    _DDP = None  # type: ignore[assignment,misc]


# ------------------------------------------------------------------------- small readers
def _dtype_name(dtype: Any) -> str | None:
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


def _enum_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(getattr(value, "name", value))


def is_deepspeed_engine(module: Any) -> bool:
    """Whether `module` is a DeepSpeed engine (an nn.Module wrapping `.module`)."""
    return any(c.__name__ == "DeepSpeedEngine" for c in type(module).__mro__) and hasattr(
        module, "module"
    )


def is_fsdp2(module: Any) -> bool:
    """Whether `module` is a `fully_shard` (FSDP2) unit."""
    return _FSDPModule is not None and isinstance(module, _FSDPModule)


def user_class(module: Any) -> type:
    """The module's own class: FSDP2 swaps in a dynamic `FSDP<Class>` subclass; see through it."""
    cls = type(module)
    if is_fsdp2(module):
        for base in cls.__bases__:
            if not issubclass(base, _FSDPModule):
                return base
    return cls


def is_fsdp1(module: Any) -> bool:
    """Whether `module` is an FSDP1 `FullyShardedDataParallel` wrapper."""
    return _FSDP1 is not None and isinstance(module, _FSDP1)


def is_ddp(module: Any) -> bool:
    """Whether `module` is a `DistributedDataParallel` wrapper."""
    return _DDP is not None and isinstance(module, _DDP)


def is_flat_parameter(param: Any) -> bool:
    """Whether `param` is FSDP1's FlatParameter (its `_param_infos` name the originals)."""
    return _FlatParameter is not None and isinstance(param, _FlatParameter)


# ------------------------------------------------------------------------- FSDP2
def _precision(policy: Any) -> Precision | None:
    if policy is None:
        return None
    return Precision(
        param_dtype=_dtype_name(getattr(policy, "param_dtype", None)),
        reduce_dtype=_dtype_name(getattr(policy, "reduce_dtype", None)),
        output_dtype=_dtype_name(getattr(policy, "output_dtype", None)),
        buffer_dtype=_dtype_name(getattr(policy, "buffer_dtype", None)),
        cast_forward_inputs=getattr(policy, "cast_forward_inputs", None),
    )


def fsdp2_unit(
    module: nn.Module, path: str, cls: type, *, nested: bool, paths: dict[int, str]
) -> Fsdp2Unit:
    """The FSDP2 unit `module` (at `path`, of the user's class `cls`; `nested`: inside another
    unit); `paths` names modules by id for the prefetch lists."""
    missing: list[str] = []

    def read(obj: Any, name: str) -> Any:
        if obj is None or not hasattr(obj, name):
            missing.append(name)
            return None
        return getattr(obj, name)

    state = None
    try:
        state = module._get_fsdp_state()  # type: ignore[operator]
    except Exception:
        missing.append("_get_fsdp_state")
    groups = getattr(state, "_fsdp_param_groups", None)  # newer torch: a list of groups
    if groups is None:  # older torch: one group
        group = read(state, "_fsdp_param_group")
        groups = [group] if group is not None else []
    sizes = _ParamTotals.of(_group_params(groups) if groups else list(_unit_params(module)))
    group = groups[0] if groups else None
    reshard = _reshard_after_forward(group, missing)
    auto = read(state, "_auto_reshard_after_forward")
    if auto and not nested and getattr(state, "_is_root", None) is None:
        reshard = False  # a root unit with the default: torch turns it off at lazy init
    fwd = read(state, "_states_to_forward_prefetch")
    bwd = read(state, "_states_to_backward_prefetch")
    policy = getattr(group, "mp_policy", None) if group is not None else None
    if policy is None:
        policy = read(state, "_mp_policy")
    offload = getattr(group, "offload_policy", None) if group is not None else None
    mesh, roles = unit_mesh(group)
    if mesh is None:  # torch keeps no mesh_info: the parameters' mesh (HSDP when 2-D)
        mesh = sizes.mesh
        ndim = len(mesh.shape) if mesh is not None else 0
        roles = ("shard",) if ndim == 1 else ("replicate", "shard") if ndim == 2 else ()
    return Fsdp2Unit(
        path=path,
        cls=cls.__name__,
        param_count=sizes.count,
        sharded_bytes=sizes.sharded,
        unsharded_bytes=sizes.unsharded,
        dtype=_dtype_name(sizes.dtype),
        reshard_after_forward=reshard,
        reshard_after_forward_auto=None if auto is None else bool(auto),
        forward_prefetch=_state_paths(fwd, paths),
        backward_prefetch=_state_paths(bwd, paths),
        mixed_precision=_precision(policy),
        offload_policy=type(offload).__name__ if offload is not None else None,
        mesh_shape=tuple(int(n) for n in mesh.shape) if mesh is not None else (),
        mesh_dim_names=tuple(mesh.mesh_dim_names or ()) if mesh is not None else (),
        mesh_roles=roles,
        hsdp="replicate" in roles and "shard" in roles,
        unshard_async_op=getattr(group, "unshard_async_op", None) if group is not None else None,
        missing=tuple(dict.fromkeys(missing)),
    )


def fsdp2_param_group(module: nn.Module) -> Any:
    """The first FSDP parameter group of the FSDP2 unit `module` (private torch state), or None."""
    try:
        state = module._get_fsdp_state()  # type: ignore[operator]
    except Exception:
        return None
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups:
        return groups[0]
    return getattr(state, "_fsdp_param_group", None)


def unit_mesh(group: Any) -> tuple[Any, tuple[str, ...]]:
    """An FSDP2 parameter group's own mesh (its private `mesh_info.mesh`: the data-parallel mesh,
    never the tensor-parallel one its DTensors may also span) and each dimension's role, "shard"
    or "replicate" (HSDP: dim 0 replicate, dim 1 shard); (None, ()) when torch keeps none."""
    info = getattr(group, "mesh_info", None)
    mesh = getattr(info, "mesh", None)
    if mesh is None:
        return None, ()
    roles = ["unused"] * len(mesh.shape)
    for attr, role in (("replicate_mesh_dim", "replicate"), ("shard_mesh_dim", "shard")):
        dim = getattr(info, attr, None)
        if isinstance(dim, int) and 0 <= dim < len(roles):
            roles[dim] = role
    return mesh, tuple(roles)


def _group_params(groups: list[Any]) -> list[Any]:
    """The sharded parameters (DTensors) of a unit's FSDP parameter groups."""
    params: list[Any] = []
    for group in groups:
        for fsdp_param in getattr(group, "fsdp_params", None) or []:
            p = getattr(fsdp_param, "sharded_param", None)
            if p is not None:
                params.append(p)
    return params


@dataclass(frozen=True)
class _ParamTotals:
    """A unit's parameter count, unsharded and sharded bytes, dtype and its first DTensor's mesh."""

    count: int = 0
    unsharded: int = 0
    sharded: int = 0
    dtype: Any = None
    mesh: Any = None

    @classmethod
    def of(cls, params: list[Any]) -> _ParamTotals:
        count = unsharded = sharded = 0
        dtype = mesh = None
        for p in params:
            count += p.numel()
            unsharded += p.numel() * p.dtype.itemsize
            local = p.to_local() if hasattr(p, "to_local") else p
            sharded += local.numel() * p.dtype.itemsize
            dtype = dtype or p.dtype
            mesh = mesh or getattr(p, "device_mesh", None)
        return cls(count, unsharded, sharded, dtype, mesh)


def _reshard_after_forward(group: Any, missing: list[str]) -> bool | int | None:
    """From the group's post-forward mesh: False (kept), True (resharded), or the group size it
    reshards to; None when torch does not say."""
    if group is None or not hasattr(group, "post_forward_mesh_info"):
        missing.append("post_forward_mesh_info")
        return None
    post, full = group.post_forward_mesh_info, getattr(group, "mesh_info", None)
    if post is None:
        return False
    if post is full or post == full:
        return True
    return int(getattr(post, "shard_mesh_size", 0)) or True


def _unit_params(module: nn.Module) -> Iterator[Any]:
    stack = [module]
    while stack:
        m = stack.pop()
        yield from (p for p in m._parameters.values() if p is not None)
        stack.extend(c for c in m.children() if not is_fsdp2(c))


def _state_paths(states: Any, paths: dict[int, str]) -> tuple[str, ...] | None:
    if states is None:
        return None
    out = []
    for state in list(states)[:MAX_PREFETCH_NAMES]:
        for m in getattr(state, "_modules", ()) or ():
            out.append(paths.get(id(m), f"<{type(m).__name__}>"))
    return tuple(out)


# ------------------------------------------------------------------------- FSDP1
def fsdp1_instance(fsdp: Any, path: str, cls: type, *, root: bool) -> Fsdp1Instance:
    """The FSDP1 wrapper `fsdp` around the module at `path` (of the user's class `cls`)."""
    flat = getattr(fsdp, "_flat_param", None)
    numel = sum(int(n) for n in getattr(flat, "_numels", ()) or ()) if flat is not None else 0
    itemsize = flat.dtype.itemsize if flat is not None else 0
    offload = getattr(fsdp, "cpu_offload", None)
    mp = getattr(fsdp, "mixed_precision", None)
    if mp is not None and all(
        getattr(mp, f, None) is None for f in ("param_dtype", "reduce_dtype", "buffer_dtype")
    ):
        mp = None  # FSDP1 stores an empty MixedPrecision() when none was given
    return Fsdp1Instance(
        path=path,
        cls=cls.__name__,
        root=root,
        flat_param_count=numel,
        flat_param_bytes=numel * itemsize,
        sharded_bytes=flat.numel() * itemsize if flat is not None else 0,
        dtype=_dtype_name(flat.dtype) if flat is not None else None,
        sharding_strategy=_enum_name(getattr(fsdp, "sharding_strategy", None)),
        forward_prefetch=getattr(fsdp, "forward_prefetch", None),
        backward_prefetch=_enum_name(getattr(fsdp, "backward_prefetch", None)),
        limit_all_gathers=getattr(fsdp, "limit_all_gathers", None),
        use_orig_params=getattr(fsdp, "_use_orig_params", None),
        cpu_offload=getattr(offload, "offload_params", None),
        mixed_precision=_precision(mp),
        auto_wrap_policy=None,
    )


# ------------------------------------------------------------------------- DDP, DeepSpeed
def ddp_config(ddp: Any) -> DdpConfig:
    """The DDP wrapper's bucket, hook and graph settings."""
    return DdpConfig(
        bucket_cap_bytes=getattr(ddp, "bucket_bytes_cap", None),
        find_unused_parameters=getattr(ddp, "find_unused_parameters", None),
        gradient_as_bucket_view=getattr(ddp, "gradient_as_bucket_view", None),
        static_graph=getattr(ddp, "static_graph", None),
        broadcast_buffers=getattr(ddp, "broadcast_buffers", None),
        comm_hook=_comm_hook_name(ddp),
    )


def _comm_hook_name(ddp: Any) -> str | None:
    """The name of the hook given to `register_comm_hook` (`_comm_hooks`, torch 2.x), or None."""
    hooks = getattr(ddp, "_comm_hooks", None) or []
    if not hooks:
        return None
    hook = hooks[0][0] if isinstance(hooks[0], tuple) else hooks[0]
    return str(getattr(hook, "__name__", type(hook).__name__))


def _call(obj: Any, name: str) -> Any:
    fn = getattr(obj, name, None)
    if not callable(fn):
        return None
    try:
        value = fn()
    except Exception:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and type(value) is not int:
        return int(value)  # an IntEnum such as DeepSpeed's ZeroStageEnum
    if isinstance(value, (bool, int, float, str)):
        return value
    return None


def deepspeed_config(engine: Any) -> DeepSpeedConfig:
    """The DeepSpeed engine's ZeRO settings, through its documented accessors."""
    return DeepSpeedConfig(
        engine_class=type(engine).__name__,
        zero_stage=_call(engine, "zero_optimization_stage"),
        reduce_bucket_size=_call(engine, "zero_reduce_bucket_size"),
        allgather_bucket_size=_call(engine, "zero_allgather_bucket_size"),
        prefetch_bucket_size=_call(engine, "zero_prefetch_bucket_size"),
        param_persistence_threshold=_call(engine, "zero_param_persistence_threshold"),
        max_live_parameters=_call(engine, "zero_max_live_parameters"),
        overlap_comm=_call(engine, "zero_overlap_comm"),
        contiguous_gradients=_call(engine, "zero_contiguous_gradients"),
        bf16=_call(engine, "bfloat16_enabled"),
        fp16=_call(engine, "fp16_enabled"),
        gradient_accumulation_steps=_call(engine, "gradient_accumulation_steps"),
        micro_batch_size=_call(engine, "train_micro_batch_size_per_gpu"),
    )


# ------------------------------------------------------------------------- optimizer
def describe_optimizer(optimizer: Any) -> OptimizerInfo:
    """Class, parameter groups, parameter count and the options that change its cost."""
    groups = getattr(optimizer, "param_groups", None) or []
    seen: set[int] = set()
    count = 0
    for group in groups:
        for p in group.get("params", ()) if isinstance(group, dict) else ():
            if id(p) not in seen and isinstance(p, torch.Tensor):
                seen.add(id(p))
                count += int(getattr(p, "ds_numel", 0) or p.numel())
    defaults = getattr(optimizer, "defaults", None) or {}
    options = tuple(
        (k, str(defaults[k]))
        for k in _OPTIMIZER_OPTIONS
        if isinstance(defaults, dict) and k in defaults
    )
    cls = type(optimizer)
    return OptimizerInfo(
        cls=cls.__name__,
        module=cls.__module__,
        param_groups=len(groups),
        param_count=count,
        options=options,
    )
