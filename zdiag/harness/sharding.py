"""FSDP2 wrapping, prefetch policy, ZeRO stage, mixed precision and activation checkpointing.

How each knob maps onto FSDP2 (see docs/harness.md for the reasoning):

- `--wrap block`: `fully_shard(block)` for each of `model.layers`, then `fully_shard(model)`;
  `whole`: only `fully_shard(model)`; `leaf`: every Linear/Embedding/RMSNorm, then the root.
- `--zero 3`: `reshard_after_forward=True` (parameters freed after forward, gathered again for
  backward: ZeRO-3). `--zero 2`: `reshard_after_forward=False` (parameters stay gathered from
  forward to backward, gradients and optimizer state stay sharded: ZeRO-2 memory, one gather per
  step). The root unit (embeddings, final norm, output) is not resharded after forward when
  other units exist, as FSDP2's own root default does; with `--wrap whole` it follows `--zero`.
- `--prefetch explicit`: each unit prefetches the next unit's all-gather in forward and the
  previous one's in backward (`set_modules_to_forward_prefetch` / `..._backward_prefetch`). On CPU,
  FSDP2's streams are no-ops and its default all-gather is synchronous (blocks the only thread), so
  the harness also switches the unshard to `async_op=True` there: the gloo worker thread then
  runs the prefetched gather while the main thread computes. Likewise on CPU the reduce-scatters
  are issued asynchronously (`AsyncCPUReduceScatter`, FSDP2's custom-comm hook) and completed
  just before `optimizer.step()`, as CUDA's reduce-scatter stream lets them overlap backward.
- `--prefetch implicit`: FSDP2's defaults, untouched.
- `--prefetch off`: the broken setup. Each unit's prefetch lists name the unit itself (so FSDP2's
  implicit backward prefetch is switched off and nothing is fetched ahead: the off-by-one
  prefetch-list bug), and every block carries a "debug" NaN check on its output in forward and on
  its output gradient in backward that calls `.item()`, which blocks the host until the device has
  finished that block. The host can no longer run ahead to issue the next gather, so each gather
  starts only when its compute needs it and serializes with compute, on CUDA as on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zdiag.errors import UserError
from zdiag.harness.config import HarnessConfig
from zdiag.harness.model import Transformer

try:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError as exc:  # torch < 2.6
    raise UserError(
        f"zdiag's harness needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6), but "
        f"torch {torch.__version__} lacks it; install a newer torch, e.g. pip install 'torch>=2.6'."
    ) from exc

try:  # the comm interface FSDPModule.set_custom_reduce_scatter takes (newer torch only)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - older torch: reduce-scatters stay synchronous on CPU
    ReduceScatter = object  # type: ignore[assignment,misc]

LEAF_TYPES = (nn.Linear, nn.Embedding, nn.RMSNorm)


class AsyncCPUReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter for CPU/gloo that runs on gloo's worker thread, waited before step().

    On CUDA FSDP2 runs reduce-scatters on a side stream, so they overlap the rest of backward. On
    CPU its streams are no-ops and the default reduce-scatter blocks the main thread. This comm
    issues it with `async_op=True`, keeps the input and output alive, and `wait_all()` (run by an
    optimizer step pre-hook) completes them before the optimizer reads the sharded gradients.
    FSDP2 only views the output as `.grad` before that point; the harness never accumulates
    gradients across backwards, which would read it early.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[dist.Work, torch.Tensor, torch.Tensor]] = []

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A plain buffer, as FSDP2's default comm allocates."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Issue the reduce-scatter asynchronously; FSDP2 ignores the returned work."""
        if hasattr(dist, "reduce_scatter_single"):  # torch >= 2.12 name; the old one warns
            work = dist.reduce_scatter_single(
                output=output_tensor, input=input_tensor, op=op, group=group, async_op=True
            )
        else:
            work = dist.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=group, async_op=True
            )
        assert work is not None
        self.pending.append((work, input_tensor, output_tensor))
        return work

    def wait_all(self) -> None:
        """Block until every issued reduce-scatter has finished."""
        for work, _input, _output in self.pending:
            work.wait()
        self.pending.clear()


@dataclass(frozen=True)
class FSDPUnit:
    """One FSDP unit: its module fqn ("" for the root, as in FSDP2's labels) and its own parameters."""

    name: str
    param_count: int
    param_bytes: int

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form for the run manifest."""
        return {"name": self.name, "param_count": self.param_count, "param_bytes": self.param_bytes}


def execution_order(model: Transformer) -> list[nn.Module]:
    """Leaf modules (Linear/Embedding/RMSNorm) in the order the forward pass runs them."""
    order: list[nn.Module] = [model.tok_embeddings]
    for block in model.blocks():
        att, ffn = block.attention, block.feed_forward
        order += [block.attention_norm, att.wq, att.wk, att.wv, att.wo, block.ffn_norm]
        order += [ffn.w1, ffn.w3, ffn.w2]
    order += [model.norm, model.output]
    return order


def install_host_sync_checks(model: Transformer) -> None:
    """Per-block "debug" NaN checks that block the host (`.item()`) in forward and backward.

    Must run before `fully_shard` so the gradient check fires before FSDP's pre-backward hook
    (tensor hooks run in registration order) and the host waits before issuing the gather.
    """

    def check_grad(grad: torch.Tensor) -> torch.Tensor:
        if bool(torch.isnan(grad).any().item()):
            raise FloatingPointError("NaN in a block's output gradient")
        return grad

    def check_output(module: nn.Module, args: object, output: torch.Tensor) -> None:
        if bool(torch.isnan(output).any().item()):
            raise FloatingPointError("NaN in a block's output")
        if output.requires_grad:
            output.register_hook(check_grad)

    for block in model.blocks():
        block.register_forward_hook(check_output)


def apply_fsdp(model: Transformer, cfg: HarnessConfig, mesh: DeviceMesh) -> list[FSDPUnit]:
    """Shard `model` in place as the config says; returns the FSDP units in forward order."""
    for block in model.blocks():
        block.checkpointed = cfg.ac == "block"
    if cfg.prefetch == "off":
        install_host_sync_checks(model)
    if cfg.precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    reshard = cfg.zero == 3

    if cfg.wrap == "block":
        units: list[nn.Module] = list(model.layers)
    elif cfg.wrap == "leaf":
        units = execution_order(model)
    else:
        units = []
    for module in units:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    # The root's parameters are needed again first thing in backward: like FSDP2's own default
    # for the root (reshard_after_forward=None), keep them gathered, unless it is the only unit.
    root_reshard = reshard if not units else False
    fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard, mp_policy=mp)
    fsdp_units: list[FSDPModule] = [m for m in units if isinstance(m, FSDPModule)]
    root = model
    assert isinstance(root, FSDPModule)
    _set_prefetch(root, fsdp_units, cfg, mesh.device_type)
    return describe_units(model)


def _set_prefetch(
    root: FSDPModule, units: list[FSDPModule], cfg: HarnessConfig, device_type: str
) -> None:
    if cfg.prefetch == "explicit":
        if units:
            root.set_modules_to_forward_prefetch([units[0]])
            root.set_modules_to_backward_prefetch([units[-1]])
        for i, unit in enumerate(units):
            if i + 1 < len(units):
                unit.set_modules_to_forward_prefetch([units[i + 1]])
            if i > 0:
                unit.set_modules_to_backward_prefetch([units[i - 1]])
        if device_type == "cpu" and hasattr(root, "_set_unshard_async_op"):
            root._set_unshard_async_op(True)
    elif cfg.prefetch == "off":
        for unit in [root, *units]:
            unit.set_modules_to_forward_prefetch([unit])
            unit.set_modules_to_backward_prefetch([unit])


def enable_async_cpu_reduce_scatter(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> AsyncCPUReduceScatter | None:
    """Make every unit's reduce-scatter asynchronous (CPU only), completed before `optimizer.step()`.

    Returns None (and changes nothing) where this torch lacks `set_custom_reduce_scatter`.
    """
    if ReduceScatter is object:
        return None
    comm = AsyncCPUReduceScatter()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            if not hasattr(module, "set_custom_reduce_scatter"):
                return None
            module.set_custom_reduce_scatter(comm)
    optimizer.register_step_pre_hook(lambda *_: comm.wait_all())
    return comm


def describe_units(model: nn.Module) -> list[FSDPUnit]:
    """Each FSDP unit (fqn, its own parameters' count and unsharded bytes): root first, module order."""
    units: list[FSDPUnit] = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        count = 0
        nbytes = 0
        for pname, param in cast(nn.Module, module).named_parameters():
            owner_path = pname.split(".")[:-1]
            owned_by_child = False
            sub: object = module
            for part in owner_path:
                sub = getattr(sub, part)
                if isinstance(sub, FSDPModule):
                    owned_by_child = True
                    break
            if owned_by_child:
                continue
            count += param.numel()
            nbytes += param.numel() * param.element_size()
        units.append(FSDPUnit(name=name, param_count=count, param_bytes=nbytes))
    return units
