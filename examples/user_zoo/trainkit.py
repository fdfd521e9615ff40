"""Small training utilities shared by the user-zoo scripts (a team's own `utils.py`, no zdiag).

What a team keeps next to its training scripts: process-group set-up from torchrun's
environment, the knobs every script has (steps, batch, a debug slow rank, fault injection for
testing the job's restart logic), an activation-memory budget that turns "too many saved
activations" into a real `torch.OutOfMemoryError` on a CPU box (so memory mistakes show up
before the job reaches the GPU cluster), and a one-line summary at the end of the run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

MIB = 1024**2


def add_common_args(parser: argparse.ArgumentParser, steps: int = 6, batch: int = 16) -> None:
    """The knobs every script shares."""
    g = parser.add_argument_group("run")
    g.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    g.add_argument("--batch", type=int, default=batch, help="per-rank batch size")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--mem-budget-mib",
        type=float,
        default=0.0,
        help="emulated device memory per rank in MiB (0: unlimited); "
        "saved activations past it raise torch.OutOfMemoryError",
    )
    g.add_argument("--pg-timeout-s", type=float, default=120.0, help="collective timeout")
    g.add_argument(
        "--paste",
        metavar="FILE",
        default=None,
        help="Python code run on the model (named `model`), as a suggested change is pasted: "
        "in place of the script's own wrap when it wraps (calls fully_shard( or FSDP( ), "
        "else after it",
    )
    f = parser.add_argument_group("debugging and fault injection")
    f.add_argument("--nan-check", action="store_true", help="check every block's output for NaN")
    f.add_argument(
        "--checks-on-device",
        action="store_true",
        help="keep the debug checks' results on the device and read them once, at the end of "
        "the run (no host sync per block)",
    )
    f.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps before each step")
    f.add_argument("--slow-ms", type=float, default=300.0, help="how long --slow-rank sleeps")
    f.add_argument("--crash-at-step", type=int, default=-1, help="raise at this step")
    f.add_argument("--crash-rank", type=int, default=0, help="the rank that raises")
    f.add_argument("--hang-rank", type=int, default=-1, help="this rank stops before a collective")
    f.add_argument("--hang-at-step", type=int, default=2, help="step at which --hang-rank stops")


def add_fsdp2_args(parser: argparse.ArgumentParser) -> None:
    """`--unshard-async`: FSDP2's unshard as an async op on the root (a private API)."""
    parser.add_argument(
        "--unshard-async",
        action="store_true",
        help="FSDP2's unshard as an async op on the root (private API): on CPU/gloo the "
        "prefetched all-gathers then overlap compute",
    )
    parser.add_argument(
        "--mesh-shape",
        metavar="R,S",
        help="HSDP: R replicas of S-way sharding on a (replicate, shard) mesh (1,N: a 1-D mesh); "
        "default: shard over the world",
    )


def fsdp_mesh(args: argparse.Namespace) -> Any:
    """The DeviceMesh `--mesh-shape R,S` asks for: (replicate, shard) for HSDP, a 1-D "shard"
    mesh when R is 1; None without the option (fully_shard's default: the world)."""
    if not args.mesh_shape:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    r, s = (int(v) for v in args.mesh_shape.split(","))
    if r == 1:
        return init_device_mesh(device().type, (s,), mesh_dim_names=("shard",))
    return init_device_mesh(device().type, (r, s), mesh_dim_names=("replicate", "shard"))


def set_unshard_async(model: nn.Module, on: bool) -> None:
    """Issue FSDP2's unshard as an async op (gloo's worker thread runs prefetched gathers)."""
    if on:
        model._set_unshard_async_op(True)  # type: ignore[operator]


def wrap_or_paste(
    model: nn.Module, paste: str | None, wrap: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    """The model wrapped: by the code of the file `paste` when that code wraps (calls
    `fully_shard(` or `FSDP(`), else by the script's own `wrap` followed by that code (if any).
    The code sees `model` and `torch`, and may rebind `model`."""
    code = Path(paste).read_text() if paste else ""
    if not re.search(r"\b(fully_shard|FSDP)\(", code):
        model = wrap(model)
    if code:
        scope: dict[str, Any] = {"model": model, "torch": torch}
        exec(compile(code, paste or "<paste>", "exec"), scope)
        model = scope["model"]
    return model


def init_distributed(backend: str | None = None, timeout_s: float = 120.0) -> tuple[int, int]:
    """Join the process group torchrun describes; returns (rank, world size)."""
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), dist.get_world_size()


def device() -> torch.device:
    """This rank's device."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _DeviceChecks:
    """The debug checks' mode (`--checks-on-device`, set by `Faults`) and, in that mode, the
    accumulated "something was not finite" flag, still on the device."""

    on_device = False
    bad: torch.Tensor | None = None


def checks_on_device() -> bool:
    """Whether debug checks keep their results on the device (`--checks-on-device`)."""
    return _DeviceChecks.on_device


def nan_check(x: torch.Tensor) -> None:
    """Raise on NaN/Inf (blocks the host until the tensor is computed); with
    `--checks-on-device`, fold the result into a flag on the device instead (read at the end)."""
    finite = torch.isfinite(x).all()
    if _DeviceChecks.on_device:
        bad = ~finite
        _DeviceChecks.bad = bad if _DeviceChecks.bad is None else _DeviceChecks.bad | bad
    elif not bool(finite.item()):
        raise FloatingPointError("non-finite activation")


def raise_if_checks_failed() -> None:
    """Read the on-device checks' flag (one host sync) and raise if any failed."""
    if _DeviceChecks.bad is not None and bool(_DeviceChecks.bad.item()):
        raise FloatingPointError("non-finite activation (an on-device check)")


class Faults:
    """The debug knobs applied at the start of each step."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args = args
        self.rank = rank
        _DeviceChecks.on_device = args.checks_on_device

    def before_step(self, step: int) -> None:
        """Sleep, crash or hang as the flags say."""
        a = self.args
        if a.slow_rank == self.rank:
            time.sleep(a.slow_ms / 1000.0)
        if a.crash_at_step == step and a.crash_rank == self.rank:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {step}")
        if a.hang_rank == self.rank and a.hang_at_step == step:
            time.sleep(10**6)  # stuck before the next collective; the others wait on it


def _local_bytes(p: torch.Tensor) -> int:
    """Bytes of this rank's shard of a sharded parameter (FSDP2 DTensor, ZeRO-3 partition; an
    FSDP1 flat parameter's data is its shard while it is sharded)."""
    if isinstance(p, DTensor):
        p = p.to_local()
    elif hasattr(p, "ds_tensor"):
        p = p.ds_tensor
    return p.numel() * p.element_size()


def _param_groups(module: nn.Module) -> list[Any]:
    """An FSDP2 unit's parameter groups (torch's private state; [] where it differs)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _pending_gather_bytes(group: Any) -> int:
    """Bytes of an FSDP2 parameter group's all-gather output issued and not yet waited for."""
    result = getattr(group, "_all_gather_result", None)
    out = getattr(result, "all_gather_output", None)
    if out is None or getattr(group, "is_unsharded", False):
        return 0
    return out.numel() * out.element_size()


class _Held:
    __slots__ = ("budget", "key", "tensor")

    def __init__(self, budget: ActivationBudget, tensor: torch.Tensor, key: int) -> None:
        self.budget, self.tensor, self.key = budget, tensor, key

    def __del__(self) -> None:
        self.budget.release(self.key)


class ActivationBudget:
    """Counts this rank's device memory as a GPU would hold it and enforces a budget.

    In use = the local parameter shards x 4 (parameter, gradient, two AdamW moments) +
    the parameters gathered right now (FSDP2: plain tensors next to DTensor shards; FSDP1: flat
    parameters whose data is not their local shard; ZeRO-3: parameters whose status is
    AVAILABLE; FSDP2 units prefetched, their all-gather output issued and not yet waited for) +
    the tensors autograd saved for backward (each storage once, until autograd frees it).
    Gradients are not counted. The peak is sampled whenever autograd saves a tensor (forward,
    and the recompute of checkpointed blocks) and whenever backward reads one. Build it after
    the model is sharded: the shard sizes are read then, while every parameter is still
    sharded. Past `budget_bytes` (0: no limit) a new saved tensor raises
    `torch.OutOfMemoryError`.
    """

    def __init__(self, model: nn.Module, budget_bytes: int = 0) -> None:
        # a weak reference: the saved-tensor hooks hold this budget, and gloo's work objects
        # hold the hooks (in their thread-local state) past the step. A strong reference to a
        # DDP model made the last reference to its Reducer drop on gloo's worker thread at exit,
        # where ~ProcessGroupGloo deadlocks (seen once in ~200 runs: the rank never exited)
        self._model = weakref.ref(model)
        self.budget_bytes = budget_bytes
        self.saved_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, list[int]] = {}
        self._fsdp2 = any(isinstance(p, DTensor) for p in model.parameters())
        # FSDP1's flat parameters (use_orig_params=True or not): the gathered buffers live there
        flat = [getattr(m, "_flat_param", None) for m in model.modules()]
        # sharded now: their data is the shard (the wrapper and its inner module both name it)
        self._flat = list({id(f): f for f in flat if f is not None}.values())
        state = self._flat or list(model.parameters())
        self._state_bytes = 4 * sum(_local_bytes(p) for p in state)
        # FSDP2's parameter groups: a prefetched unit's all-gather output is held from its
        # issue to its own wait, before its parameters are swapped in (FSDP1's flat
        # parameters point at the gathered buffer from the issue on: counted above)
        self._fsdp2_groups = [
            g
            for m in model.modules()
            if self._fsdp2 and hasattr(m, "_get_fsdp_state")
            for g in _param_groups(m)
        ]

    def unsharded_bytes(self) -> int:
        """Parameters gathered right now, beyond their local shards."""
        if self._flat:
            return sum(
                f.numel() * f.element_size()
                for f in self._flat
                if (shard := getattr(f, "_local_shard", None)) is not None
                and f.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr()
            )
        total = sum(_pending_gather_bytes(g) for g in self._fsdp2_groups)
        model = self._model()
        for p in model.parameters() if model is not None else ():
            if self._fsdp2:
                if not isinstance(p, DTensor):
                    total += p.numel() * p.element_size()
            elif hasattr(p, "ds_status") and p.ds_status.name == "AVAILABLE":  # ZeRO-3
                total += p.ds_numel * p.element_size()  # type: ignore[attr-defined]
        return total

    def state_bytes(self) -> int:
        """Local parameter shards x 4, read when the budget was built."""
        return self._state_bytes

    def _acquire(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        entry = self._live.get(key)
        if entry is None:
            nbytes = storage.nbytes()
            in_use = self.saved_bytes + self.state_bytes() + self.unsharded_bytes() + nbytes
            self.peak_bytes = max(self.peak_bytes, in_use)
            if self.budget_bytes and in_use > self.budget_bytes:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (emulated). Tried to allocate {nbytes / MIB:.2f} MiB; "
                    f"budget {self.budget_bytes / MIB:.1f} MiB, "
                    f"{self.saved_bytes / MIB:.2f} MiB held by saved activations."
                )
            self.saved_bytes += nbytes
            self._live[key] = [1, nbytes]
        else:
            entry[0] += 1
        return key

    def release(self, key: int) -> None:
        """Drop one reference to a saved storage."""
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] <= 0:
            del self._live[key]
            self.saved_bytes -= entry[1]

    def _pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        return _Held(self, t, self._acquire(t))

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Held):
            return packed
        # backward reads a saved tensor: what is in use now (the units gathered for backward and
        # the one prefetched, beside the activations not yet freed) counts toward the peak too
        in_use = self.saved_bytes + self.state_bytes() + self.unsharded_bytes()
        self.peak_bytes = max(self.peak_bytes, in_use)
        return packed.tensor

    @contextmanager
    def track(self) -> Iterator[None]:
        """Count what autograd saves inside this block (forward and backward of one step)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
        self.peak_bytes = max(self.peak_bytes, self.state_bytes())


class StepLog:
    """Step times and the closing summary line (printed by rank 0)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.times_ms: list[float] = []
        self._t0 = time.perf_counter()

    def step_done(self, step: int, loss: torch.Tensor | float) -> None:
        """Record a step; print the loss on rank 0."""
        now = time.perf_counter()
        self.times_ms.append((now - self._t0) * 1000.0)
        self._t0 = now
        if self.rank == 0:
            value = loss.item() if isinstance(loss, torch.Tensor) else loss
            print(f"step {step} loss {value:.4f} {self.times_ms[-1]:.1f} ms", flush=True)

    def summary(self, budget: ActivationBudget) -> None:
        """`summary: median_step_ms=... peak_mem_mib=...` (steps 0-1 are warm-up), after
        reading the on-device checks (`--checks-on-device`)."""
        raise_if_checks_failed()
        steady = self.times_ms[2:] or self.times_ms
        med = statistics.median(steady) if steady else 0.0
        if torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated() / MIB
        else:
            peak = budget.peak_bytes / MIB
        print(
            f"summary: rank={self.rank} median_step_ms={med:.2f} peak_mem_mib={peak:.3f}",
            flush=True,
        )
