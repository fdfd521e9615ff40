"""Describe the live model once, at its first forward: module tree, framework settings, optimizer.

`ModelCapture.arm()` registers a global module forward pre-hook. The first forward of a module
that holds parameters is the model's (nothing encloses the first forward of a run; a parameterless
module, a data transform say, is passed over). It writes `RUN_DIR/model/rank-<N>.json` (schema
`zdiag.model/1`, types in `model_schema.py`). A global optimizer step post-hook records the
optimizer(s) that step before the next forward and rewrites the file once with them. At that next
forward both hooks are removed (a step hook cannot remove itself: torch iterates them live), so
after the first iteration neither the forward path nor the step carries a zdiag hook of this
module; until then the forward pre-hook costs one flag test per module call. A model that runs
forward again before any optimizer step (gradient accumulation, no torch optimizer) stops the
forward hook there; a later first step re-adds it once, to remove both at the next forward. Every failure is reported through the session's collector-error channel
and never reaches training.

What is read, and where torch keeps it (torch 2.13; each private attribute is read with a fallback
and listed in `missing` when absent, so torch 2.6+ degrades to fewer fields, never to an error):

- FSDP2 (`fully_shard`): per unit `module._get_fsdp_state()`; its `_fsdp_param_groups` (or
  `_fsdp_param_group`) give the parameters (`fsdp_params[i].sharded_param`, a DTensor: global
  `numel()`, local shard `to_local()`), `post_forward_mesh_info` (None: no reshard after forward;
  the same as `mesh_info`: reshard; another mesh: reshard to that group size), `mp_policy`,
  `offload_policy` and `unshard_async_op`; the state's `_states_to_forward_prefetch` /
  `_states_to_backward_prefetch` (set by `set_modules_to_forward_prefetch` / `..._backward_...`)
  and `_auto_reshard_after_forward` (the user left `reshard_after_forward=None`: torch then turns
  it off for root units at lazy init, which this capture, taken before lazy init, applies itself).
  Mesh shape and names come from the DTensor's public `device_mesh`.
- FSDP1: the FullyShardedDataParallel instance's `sharding_strategy`, `forward_prefetch`,
  `backward_prefetch`, `limit_all_gathers`, `_use_orig_params`, `cpu_offload`, `mixed_precision`,
  and its FlatParameter (`_param_infos`, `_numels`: per original parameter, its module and
  unsharded numel). torch does not keep the auto wrap policy: it is recorded as None.
- DeepSpeed: the engine (an nn.Module wrapping `.module`) through its documented accessors
  (`zero_optimization_stage()`, `zero_reduce_bucket_size()`, `zero_allgather_bucket_size()`,
  `zero_prefetch_bucket_size()`, `zero_param_persistence_threshold()`,
  `zero_max_live_parameters()`, `zero_overlap_comm()`, `zero_contiguous_gradients()`,
  `bfloat16_enabled()`, `fp16_enabled()`, ...); ZeRO-3 parameters count by `ds_numel`.
- DDP: `bucket_bytes_cap`, `find_unused_parameters`, `gradient_as_bucket_view`, `static_graph`,
  `broadcast_buffers`, and the communication hook's name (private `_comm_hooks`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import rundir
from .compile_safe import eager_or_opaque
from .fsio import write_atomically
from .model_schema import (
    KEEP_REPEATED_CHILDREN,
    MAX_FSDP_UNITS,
    MAX_MODULES,
    MAX_PREFETCH_NAMES,
    MAX_REPEATED_SETS,
    DdpConfig,
    DeepSpeedConfig,
    Fsdp1Instance,
    Fsdp2Unit,
    ModelDescription,
    ModuleNode,
    OptimizerInfo,
    Precision,
    RepeatedSet,
)

MAX_OPTIMIZERS = 8
MAX_CHILD_NAMES = 8
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


def _is_deepspeed_engine(module: Any) -> bool:
    return any(c.__name__ == "DeepSpeedEngine" for c in type(module).__mro__) and hasattr(
        module, "module"
    )


def _is_fsdp2(module: Any) -> bool:
    return _FSDPModule is not None and isinstance(module, _FSDPModule)


def _user_class(module: Any) -> type:
    """The module's own class: FSDP2 swaps in a dynamic `FSDP<Class>` subclass; see through it."""
    cls = type(module)
    if _is_fsdp2(module):
        for base in cls.__bases__:
            if not issubclass(base, _FSDPModule):
                return base
    return cls


def _unwrap_step(module: nn.Module) -> nn.Module | None:
    """The module one wrapper inside `module` (DDP, DeepSpeed engine, FSDP1, checkpoint, compile),
    None when `module` wraps nothing."""
    if (_DDP is not None and isinstance(module, _DDP)) or _is_deepspeed_engine(module):
        inner = getattr(module, "module", None)
        return inner if isinstance(inner, nn.Module) else None
    if _FSDP1 is not None and isinstance(module, _FSDP1):
        return module._fsdp_wrapped_module
    for name in ("_checkpoint_wrapped_module", "_orig_mod"):
        inner = getattr(module, name, None)
        if isinstance(inner, nn.Module):
            return inner
    return None


def _chain(module: nn.Module) -> list[nn.Module]:
    """The wrappers around a module, outermost first, then the user's module itself."""
    chain = [module]
    for _ in range(16):
        inner = _unwrap_step(chain[-1])
        if inner is None:
            break
        chain.append(inner)
    return chain


# ------------------------------------------------------------------------- parameter accounting
class _ParamSizes:
    """Logical (unsharded) parameter sizes, each parameter counted once."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: set[int] = set()
        self.skip: set[int] = set()  # FSDP1 views of original parameters (counted by infos)
        self.fsdp1_own: dict[int, list[int]] = {}  # id(module) -> [numel, bytes]
        if _FlatParameter is None:
            return
        for p in model.parameters():
            if not isinstance(p, _FlatParameter):
                continue
            itemsize = p.dtype.itemsize
            for info, numel in zip(
                getattr(p, "_param_infos", ()), getattr(p, "_numels", ()), strict=False
            ):
                entry = self.fsdp1_own.setdefault(id(info.module), [0, 0])
                entry[0] += int(numel)
                entry[1] += int(numel) * itemsize
            for orig in (getattr(p, "_params", None) or []) + (
                getattr(p, "_shared_params", None) or []
            ):
                self.skip.add(id(orig))

    def own(self, module: nn.Module) -> tuple[int, int]:
        """(params, bytes) registered directly on `module`, not counted before."""
        count = nbytes = 0
        for p in module._parameters.values():
            if p is None or id(p) in self.seen or id(p) in self.skip:
                continue
            self.seen.add(id(p))
            if _FlatParameter is not None and isinstance(p, _FlatParameter):
                continue
            numel = int(getattr(p, "ds_numel", 0) or p.numel())  # DTensor: global numel
            count += numel
            nbytes += numel * p.dtype.itemsize
        extra = self.fsdp1_own.pop(id(module), None)
        if extra is not None:
            count += extra[0]
            nbytes += extra[1]
        return count, nbytes


# ------------------------------------------------------------------------- the tree
class _Node:
    __slots__ = (
        "chain",
        "children",
        "cls",
        "depth",
        "fsdp1_ancestor",
        "fsdp2_ancestor",
        "module",
        "name",
        "own",
        "path",
        "total",
        "wrappers",
    )

    def __init__(self, path: str, name: str, chain: list[nn.Module], depth: int) -> None:
        self.path = path
        self.name = name
        self.chain = chain
        self.module = chain[-1]
        self.cls = _user_class(self.module)
        self.depth = depth
        self.wrappers = tuple(type(m).__name__ for m in chain[:-1])
        self.own = (0, 0)
        self.total = [0, 0]
        self.children: list[_Node] = []
        self.fsdp2_ancestor = False
        self.fsdp1_ancestor = False


def _build_tree(model: nn.Module) -> tuple[_Node, list[_Node]]:
    """The unwrapped module tree, pre-order, each module object once; totals filled in."""
    sizes = _ParamSizes(model)
    visited: set[int] = set()

    def make(path: str, name: str, module: nn.Module, depth: int) -> _Node:
        chain = list(_chain(module))
        for m in chain:
            visited.add(id(m))
        node = _Node(path, name, chain, depth)
        own_count = own_bytes = 0
        for m in chain:
            c, b = sizes.own(m)
            own_count += c
            own_bytes += b
        node.own = (own_count, own_bytes)
        return node

    root = make("", "", model, 0)
    stack = [root]
    while stack:
        node = stack.pop()
        kids = []
        for name, child in node.module.named_children():
            if child is None or id(child) in visited:
                continue
            path = f"{node.path}.{name}" if node.path else name
            kid = make(path, name, child, node.depth + 1)
            kid.fsdp2_ancestor = node.fsdp2_ancestor or _is_fsdp2(node.module)
            kid.fsdp1_ancestor = node.fsdp1_ancestor or any(
                _FSDP1 is not None and isinstance(m, _FSDP1) for m in node.chain
            )
            kids.append(kid)
        node.children = kids
        stack.extend(reversed(kids))
    order = list(_preorder(root))
    for node in reversed(order):
        node.total = [node.own[0], node.own[1]]
        for kid in node.children:
            node.total[0] += kid.total[0]
            node.total[1] += kid.total[1]
    return root, order


def _preorder(root: _Node) -> Iterator[_Node]:
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children))


def _class_key(cls: type) -> tuple[str, str]:
    return cls.__module__, cls.__qualname__


def _repeated_sets(order: list[_Node]) -> list[RepeatedSet]:
    found: list[RepeatedSet] = []
    for node in order:
        groups: dict[tuple[str, str], list[_Node]] = {}
        for kid in node.children:
            groups.setdefault(_class_key(kid.cls), []).append(kid)
        for (module_name, _), kids in groups.items():
            if len(kids) < 2:
                continue
            sizes = [k.total[1] for k in kids]
            found.append(
                RepeatedSet(
                    path=node.path,
                    child_class=kids[0].cls.__name__,
                    child_module=module_name,
                    count=len(kids),
                    child_names=tuple(k.name for k in kids[:MAX_CHILD_NAMES]),
                    child_modules=sum(1 for _ in _preorder(kids[0])),
                    bytes_per_child_min=min(sizes),
                    bytes_per_child_max=max(sizes),
                    params_per_child_max=max(k.total[0] for k in kids),
                    total_bytes=sum(sizes),
                    container_class=node.cls.__name__,
                    depth=kids[0].depth,
                )
            )
    found.sort(key=lambda r: -(r.total_bytes or 0))
    return found


def _emitted_nodes(root: _Node) -> tuple[list[ModuleNode], int]:
    """The capped tree: same-class siblings past the first few collapsed, then MAX_MODULES."""
    out: list[ModuleNode] = []
    dropped = 0
    stack = [root]
    while stack:
        node = stack.pop()
        seen_per_class: dict[tuple[str, str], int] = {}
        kept: list[_Node] = []
        collapsed = 0
        for kid in node.children:
            key = _class_key(kid.cls)
            seen_per_class[key] = seen_per_class.get(key, 0) + 1
            if seen_per_class[key] > KEEP_REPEATED_CHILDREN:
                collapsed += 1
                dropped += sum(1 for _ in _preorder(kid))
            else:
                kept.append(kid)
        if len(out) >= MAX_MODULES:
            dropped += 1
            stack.extend(reversed(kept))
            continue
        out.append(
            ModuleNode(
                path=node.path,
                cls=node.cls.__name__,
                module=node.cls.__module__,
                depth=node.depth,
                own_params=node.own[0],
                own_bytes=node.own[1],
                total_params=node.total[0],
                total_bytes=node.total[1],
                children=len(node.children),
                collapsed_children=collapsed,
                wrappers=node.wrappers,
                fsdp2_unit=_is_fsdp2(node.module),
            )
        )
        stack.extend(reversed(kept))
    return out, dropped


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


def _fsdp2_unit(node: _Node, paths: dict[int, str]) -> Fsdp2Unit:
    module = node.module
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
    params: list[Any] = []
    for group in groups:
        for fsdp_param in getattr(group, "fsdp_params", None) or []:
            p = getattr(fsdp_param, "sharded_param", None)
            if p is not None:
                params.append(p)
    if not groups:  # fall back on the public view: this unit's DTensor parameters
        params = list(_unit_params(module))
    count = unsharded = sharded = 0
    dtype = None
    mesh = None
    for p in params:
        count += p.numel()
        unsharded += p.numel() * p.dtype.itemsize
        local = p.to_local() if hasattr(p, "to_local") else p
        sharded += local.numel() * p.dtype.itemsize
        dtype = dtype or p.dtype
        mesh = mesh or getattr(p, "device_mesh", None)
    group = groups[0] if groups else None
    reshard: bool | int | None = None
    if group is not None and hasattr(group, "post_forward_mesh_info"):
        post, full = group.post_forward_mesh_info, getattr(group, "mesh_info", None)
        if post is None:
            reshard = False
        elif post is full or post == full:
            reshard = True
        else:
            reshard = int(getattr(post, "shard_mesh_size", 0)) or True
    else:
        missing.append("post_forward_mesh_info")
    auto = read(state, "_auto_reshard_after_forward")
    if auto and not node.fsdp2_ancestor and getattr(state, "_is_root", None) is None:
        reshard = False  # a root unit with the default: torch turns it off at lazy init
    fwd = read(state, "_states_to_forward_prefetch")
    bwd = read(state, "_states_to_backward_prefetch")
    policy = getattr(group, "mp_policy", None) if group is not None else None
    if policy is None:
        policy = read(state, "_mp_policy")
    offload = getattr(group, "offload_policy", None) if group is not None else None
    shape: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    if mesh is not None:
        shape = tuple(int(s) for s in mesh.shape)
        names = tuple(mesh.mesh_dim_names or ())
    return Fsdp2Unit(
        path=node.path,
        cls=node.cls.__name__,
        param_count=count,
        sharded_bytes=sharded,
        unsharded_bytes=unsharded,
        dtype=_dtype_name(dtype),
        reshard_after_forward=reshard,
        reshard_after_forward_auto=None if auto is None else bool(auto),
        forward_prefetch=_state_paths(fwd, paths),
        backward_prefetch=_state_paths(bwd, paths),
        mixed_precision=_precision(policy),
        offload_policy=type(offload).__name__ if offload is not None else None,
        mesh_shape=shape,
        mesh_dim_names=names,
        hsdp=len(shape) >= 2,
        unshard_async_op=getattr(group, "unshard_async_op", None) if group is not None else None,
        missing=tuple(dict.fromkeys(missing)),
    )


def _unit_params(module: nn.Module) -> Iterator[Any]:
    stack = [module]
    while stack:
        m = stack.pop()
        yield from (p for p in m._parameters.values() if p is not None)
        stack.extend(c for c in m.children() if not _is_fsdp2(c))


def _state_paths(states: Any, paths: dict[int, str]) -> tuple[str, ...] | None:
    if states is None:
        return None
    out = []
    for state in list(states)[:MAX_PREFETCH_NAMES]:
        for m in getattr(state, "_modules", ()) or ():
            out.append(paths.get(id(m), f"<{type(m).__name__}>"))
    return tuple(out)


# ------------------------------------------------------------------------- FSDP1
def _fsdp1_instance(node: _Node, fsdp: Any) -> Fsdp1Instance:
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
        path=node.path,
        cls=node.cls.__name__,
        root=not node.fsdp1_ancestor,
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
def _ddp_config(ddp: Any) -> DdpConfig:
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


def _deepspeed_config(engine: Any) -> DeepSpeedConfig:
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


# ------------------------------------------------------------------------- the description
def describe_model(
    model: nn.Module, *, rank: int = 0, optimizers: tuple[OptimizerInfo, ...] = ()
) -> ModelDescription:
    """Describe `model` (the outermost module, wrappers included) as it is now."""
    root, order = _build_tree(model)
    paths = {id(m): n.path for n in order for m in n.chain}
    notes: list[str] = []
    fsdp2_nodes = [n for n in order if _is_fsdp2(n.module)]
    units = [_fsdp2_unit(n, paths) for n in fsdp2_nodes[:MAX_FSDP_UNITS]]
    if len(fsdp2_nodes) > MAX_FSDP_UNITS:
        notes.append(
            f"{len(fsdp2_nodes) - MAX_FSDP_UNITS} FSDP2 units past the first {MAX_FSDP_UNITS} left out"
        )
    fsdp1 = [
        _fsdp1_instance(n, m)
        for n in order
        for m in n.chain
        if _FSDP1 is not None and isinstance(m, _FSDP1)
    ]
    ddp = next(
        (m for n in order for m in n.chain if _DDP is not None and isinstance(m, _DDP)), None
    )
    engine = next((m for n in order for m in n.chain if _is_deepspeed_engine(m)), None)
    opts = list(optimizers)
    if engine is not None and getattr(engine, "optimizer", None) is not None:
        opts.insert(0, describe_optimizer(engine.optimizer))
    if engine is not None:
        framework = "deepspeed"
    elif units:
        framework = "fsdp2"
    elif fsdp1:
        framework = "fsdp1"
    elif ddp is not None:
        framework = "ddp"
    else:
        framework = "none"
    if fsdp1:
        notes.append("torch does not keep FSDP1's auto_wrap_policy: the wrapped classes show it")
    repeated = _repeated_sets(order)
    if len(repeated) > MAX_REPEATED_SETS:
        notes.append(f"{len(repeated) - MAX_REPEATED_SETS} smallest repeated sets left out")
        repeated = repeated[:MAX_REPEATED_SETS]
    nodes, dropped = _emitted_nodes(root)
    if dropped:
        notes.append(
            f"{dropped} of {len(order)} modules left out of the tree (same-class siblings past "
            f"the first {KEEP_REPEATED_CHILDREN}, and a cap of {MAX_MODULES}); totals include them"
        )
    return ModelDescription(
        rank=rank,
        captured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        torch_version=torch.__version__,
        model_class=root.cls.__name__,
        model_module=root.cls.__module__,
        framework=framework,
        wrappers=root.wrappers,
        param_count=root.total[0],
        param_bytes=root.total[1],
        modules=tuple(nodes),
        modules_total=len(order),
        modules_dropped=dropped,
        repeated=tuple(repeated),
        fsdp2_units=tuple(units),
        fsdp2_units_total=len(fsdp2_nodes),
        fsdp1=tuple(fsdp1),
        deepspeed=_deepspeed_config(engine) if engine is not None else None,
        ddp=_ddp_config(ddp) if ddp is not None else None,
        optimizers=tuple(opts),
        notes=tuple(notes),
    )


# ------------------------------------------------------------------------- the hooks
class ModelCapture:
    """One-shot hooks that write `RUN_DIR/model/rank-<N>.json`; errors go to `report`."""

    def __init__(self, run_dir: str | Path, rank: int, report: Callable[[str], None]) -> None:
        self.path = Path(run_dir) / rundir.model_description_relpath(rank)
        self.rank = rank
        self.written = False
        self._report = report
        self._forward_hook: Any = None
        self._step_hook: Any = None
        self._description: ModelDescription | None = None
        self._optimizers: dict[int, OptimizerInfo] = {}
        self._model_id: int | None = None

    def arm(self) -> ModelCapture:
        """Register the forward pre-hook and the optimizer hook (both remove themselves)."""
        self._forward_hook = register_module_forward_pre_hook(eager_or_opaque(self._on_forward))
        self._step_hook = register_optimizer_step_post_hook(eager_or_opaque(self._on_step))
        return self

    def disarm(self) -> None:
        """Remove whatever hook is still registered (the run ends)."""
        self._remove_forward_hook()
        self._remove_step_hook()

    def _remove_forward_hook(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def _remove_step_hook(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if self._description is not None:
            if self._optimizers:  # the first forward after the first optimizer step: done
                self.disarm()
            elif id(module) == self._model_id:
                # The model runs again before any optimizer step (gradient accumulation, or a
                # loop with no torch optimizer): stop watching forwards; a first step, if one
                # comes, re-arms this hook once to remove the step hook.
                self._remove_forward_hook()
            return
        try:
            if next(module.parameters(), None) is None:
                return  # a parameterless module (a transform): wait for the model
            self._model_id = id(module)
            self._description = describe_model(module, rank=self.rank)
            self._write()
        except Exception as exc:
            self.disarm()
            self._report(f"model description failed: {type(exc).__name__}: {exc}")

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # torch iterates the step hooks while calling them: removing one here would break the
        # step; the next forward pre-hook call removes both hooks instead.
        if id(optimizer) in self._optimizers or len(self._optimizers) >= MAX_OPTIMIZERS:
            return
        try:
            self._optimizers[id(optimizer)] = describe_optimizer(optimizer)
            if self._description is not None:
                self._write()
        except Exception as exc:
            self._optimizers[id(optimizer)] = OptimizerInfo(cls=type(optimizer).__name__)
            self._report(f"optimizer description failed: {type(exc).__name__}: {exc}")
        if self._forward_hook is None:  # (the forward hook may add itself here: another dict)
            self._forward_hook = register_module_forward_pre_hook(eager_or_opaque(self._on_forward))

    def _write(self) -> None:
        desc = self._description
        if desc is None:
            return
        known = {(o.cls, o.param_count) for o in desc.optimizers}
        extra = tuple(o for o in self._optimizers.values() if (o.cls, o.param_count) not in known)
        if extra:
            desc = self._description = _replace_optimizers(desc, desc.optimizers + extra)
        text = json.dumps(desc.to_json(), separators=(",", ":"))  # compact: ~40 % smaller

        def write(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)

        write_atomically(self.path, write)
        self.written = True


def _replace_optimizers(
    desc: ModelDescription, optimizers: tuple[OptimizerInfo, ...]
) -> ModelDescription:
    return dataclasses.replace(desc, optimizers=optimizers)
