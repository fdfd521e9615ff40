"""Describe the live model once, at its first forward: module tree, framework settings, optimizer.

`ModelCapture.arm()` registers a global module forward pre-hook. The first forward of a module
that holds parameters is the model's (nothing encloses the first forward of a run; a parameterless
module, a data transform say, is passed over). It writes `RUN_DIR/model/rank-<N>.json` (schema
`zdiag.model/1.3`, types in `model_schema.py`). A global optimizer step post-hook records the
optimizer(s) that step before the next forward and rewrites the file once with them. At that next
forward both hooks are removed (a step hook cannot remove itself: torch iterates them live), so
after the first iteration neither the forward path nor the step carries a zdiag hook of this
module; until then the forward pre-hook costs one flag test per module call. A model that runs
forward again before any optimizer step (gradient accumulation, no torch optimizer) stops the
forward hook there; a later first step re-adds it once, to remove both at the next forward. Every failure is reported through the session's collector-error channel
and never reaches training. With `probe_activations` (`zdiag run --profile-memory`) that first
forward is also measured by `activation_probe.py` (what it saves for backward, by block) and the
file rewritten with the sizes when the forward ends; a compiled model, or a first forward without
gradients, is not measured and the description's notes say why.

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
  The unit's mesh is its group's `mesh_info.mesh` (the data-parallel mesh, with
  `shard_mesh_dim` / `replicate_mesh_dim`), else the DTensor's public `device_mesh`.
- The device mesh, each DTensor parameter's placements (the tensor-parallel plan) and every
  process group with its members: `mesh_capture.py` says where torch keeps them.
- The pipeline stages and schedules the script built (they live outside the model):
  `pipeline_capture.py` records them as they are constructed; each write of the file takes what
  it recorded so far (the first forward, then the first optimizer step).
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
from .activation_probe import ActivationProbe, is_compiled
from .compile_safe import eager_or_opaque
from .framework_settings import (
    ddp_config,
    deepspeed_config,
    describe_optimizer,
    fsdp1_instance,
    fsdp2_unit,
    is_ddp,
    is_deepspeed_engine,
    is_flat_parameter,
    is_fsdp1,
    is_fsdp2,
    user_class,
)
from .fsio import write_atomically
from .mesh_capture import capture_mesh
from .model_schema import (
    KEEP_REPEATED_CHILDREN,
    MAX_FSDP_UNITS,
    MAX_MODULES,
    MAX_REPEATED_SETS,
    ActivationSizes,
    ModelDescription,
    ModuleNode,
    OptimizerInfo,
    PipelineInfo,
    RepeatedSet,
)
from .pipeline_capture import with_pipeline

MAX_OPTIMIZERS = 8
MAX_CHILD_NAMES = 8


def _unwrap_step(module: nn.Module) -> nn.Module | None:
    """The module one wrapper inside `module` (DDP, DeepSpeed engine, FSDP1, checkpoint, compile),
    None when `module` wraps nothing."""
    if is_ddp(module) or is_deepspeed_engine(module):
        inner = getattr(module, "module", None)
        return inner if isinstance(inner, nn.Module) else None
    if is_fsdp1(module):
        return module._fsdp_wrapped_module  # type: ignore[return-value]
    for name in ("_checkpoint_wrapped_module", "_orig_mod"):
        inner = getattr(module, name, None)
        if isinstance(inner, nn.Module):
            return inner
    return None


def wrapper_chain(module: nn.Module) -> list[nn.Module]:
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
        for p in model.parameters():
            if not is_flat_parameter(p):
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
            if is_flat_parameter(p):
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
        self.cls = user_class(self.module)
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
        chain = list(wrapper_chain(module))
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
            kid.fsdp2_ancestor = node.fsdp2_ancestor or is_fsdp2(node.module)
            kid.fsdp1_ancestor = node.fsdp1_ancestor or any(is_fsdp1(m) for m in node.chain)
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


def probed_blocks(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """(container path, block path, the module its parent calls) of each repeated block that
    holds parameters, in pre-order; only the outermost sets (a MoE's experts inside repeated
    layers are part of their layer)."""
    _, order = _build_tree(model)
    out: list[tuple[str, str, nn.Module]] = []
    inside: list[str] = []
    for node in order:
        if any(node.path == b or node.path.startswith(b + ".") for b in inside):
            continue
        groups: dict[tuple[str, str], list[_Node]] = {}
        for kid in node.children:
            if kid.total[1] > 0:
                groups.setdefault(_class_key(kid.cls), []).append(kid)
        for kids in groups.values():
            if len(kids) >= 2:
                out += [(node.path, k.path, k.chain[0]) for k in kids]
                inside += [k.path for k in kids]
    return out


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
                fsdp2_unit=is_fsdp2(node.module),
            )
        )
        stack.extend(reversed(kept))
    return out, dropped


# ------------------------------------------------------------------------- the description
def describe_model(
    model: nn.Module, *, rank: int = 0, optimizers: tuple[OptimizerInfo, ...] = ()
) -> ModelDescription:
    """Describe `model` (the outermost module, wrappers included) as it is now."""
    root, order = _build_tree(model)
    paths = {id(m): n.path for n in order for m in n.chain}
    notes: list[str] = []
    fsdp2_nodes = [n for n in order if is_fsdp2(n.module)]
    units = [
        fsdp2_unit(n.module, n.path, n.cls, nested=n.fsdp2_ancestor, paths=paths)
        for n in fsdp2_nodes[:MAX_FSDP_UNITS]
    ]
    if len(fsdp2_nodes) > MAX_FSDP_UNITS:
        notes.append(
            f"{len(fsdp2_nodes) - MAX_FSDP_UNITS} FSDP2 units past the first {MAX_FSDP_UNITS} left out"
        )
    fsdp1 = [
        fsdp1_instance(m, n.path, n.cls, root=not n.fsdp1_ancestor)
        for n in order
        for m in n.chain
        if is_fsdp1(m)
    ]
    ddp = next((m for n in order for m in n.chain if is_ddp(m)), None)
    engine = next((m for n in order for m in n.chain if is_deepspeed_engine(m)), None)
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
    mesh = capture_mesh([(n.path, n.cls.__name__, n.module) for n in order])
    notes.extend(mesh.notes)
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
        deepspeed=deepspeed_config(engine) if engine is not None else None,
        ddp=ddp_config(ddp) if ddp is not None else None,
        optimizers=tuple(opts),
        mesh=mesh.mesh,
        dtensor_modules=mesh.dtensor_modules,
        process_groups=mesh.process_groups,
        notes=tuple(notes),
    )


# ------------------------------------------------------------------------- the hooks
class ModelCapture:
    """One-shot hooks that write `RUN_DIR/model/rank-<N>.json`; errors go to `report`."""

    def __init__(
        self,
        run_dir: str | Path,
        rank: int,
        report: Callable[[str], None],
        pipeline: Callable[[], PipelineInfo | None] | None = None,
        probe_activations: bool = False,
    ) -> None:
        """`probe_activations`: measure what the model's first forward saves for backward, by
        block (`activation_probe.py`; `zdiag run --profile-memory`)."""
        self.path = Path(run_dir) / rundir.model_description_relpath(rank)
        self.rank = rank
        self.written = False
        self._report = report
        self._forward_hook: Any = None
        self._step_hook: Any = None
        self._description: ModelDescription | None = None
        self._optimizers: dict[int, OptimizerInfo] = {}
        self._model_id: int | None = None
        self._pipeline = pipeline  # the pipeline stages and schedules recorded so far
        self._probe_activations = probe_activations
        self._probe: ActivationProbe | None = None

    @property
    def model_id(self) -> int | None:
        """`id()` of the module described as the model (None before its first forward)."""
        return self._model_id

    def arm(self) -> ModelCapture:
        """Register the forward pre-hook and the optimizer hook (both remove themselves)."""
        self._forward_hook = register_module_forward_pre_hook(eager_or_opaque(self._on_forward))
        self._step_hook = register_optimizer_step_post_hook(eager_or_opaque(self._on_step))
        return self

    def disarm(self) -> None:
        """Remove whatever hook is still registered (the run ends)."""
        self._remove_forward_hook()
        self._remove_step_hook()
        if self._probe is not None:
            self._probe.stop()

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
            return
        if self._probe_activations:
            self._start_probe(module)

    def _start_probe(self, model: nn.Module) -> None:
        """Measure this forward's saved tensors by block (not under torch.compile)."""
        try:
            why = (
                "the model runs under torch.compile (its graphs would break on the hooks)"
                if is_compiled(model)
                else "the model's first forward ran without gradients (no_grad, inference "
                "mode), so it saved nothing for backward"
                if not torch.is_grad_enabled()
                else None
            )
            if why is not None and self._description is not None:
                note = f"activation sizes not measured: {why}"
                self._description = dataclasses.replace(
                    self._description, notes=(*self._description.notes, note)
                )
                self._write()
                return
            self._probe = ActivationProbe(probed_blocks(model), self._on_activations, self._report)
            self._probe.start(model)
        except Exception as exc:
            if self._probe is not None:
                self._probe.stop()
            self._report(f"activation sizes not measured: {type(exc).__name__}: {exc}")

    def _on_activations(self, sizes: ActivationSizes) -> None:
        self._probe = None
        if self._description is None:
            return
        try:
            self._description = dataclasses.replace(self._description, activations=sizes)
            self._write()
        except Exception as exc:
            self._report(f"activation sizes not written: {type(exc).__name__}: {exc}")

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
        if self._pipeline is not None:
            desc = self._description = with_pipeline(desc, self._pipeline())
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
