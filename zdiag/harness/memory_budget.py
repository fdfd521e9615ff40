"""Emulate a device's memory capacity on CPU so an activation-driven OOM happens without a GPU.

In-use bytes are counted the way they grow on a GPU during training:

- activations: every tensor autograd saves for backward (`saved_tensors_hooks`), each storage
  counted once, released when autograd frees it after use; with activation checkpointing, the
  input each checkpointed block keeps until its backward;
- unsharded parameters: the FSDP units currently gathered (plain tensors in `model.parameters()`,
  where sharded ones are DTensors);
- model state: the local shards of parameters, gradients and the optimizer's state, counted as
  `state_factor` times the local parameter bytes (4 for AdamW: parameter, gradient, two moments).

When a new saved tensor would bring the sum over the budget, a real `torch.OutOfMemoryError` is
raised from inside the forward pass, worded like CUDA's. On CUDA the real capacity applies instead:
`cap_cuda_memory` caps the caching allocator with `torch.cuda.set_per_process_memory_fraction`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

GIB = 1024**3
MIB = 1024**2


class _Saved:
    """A saved tensor plus the accounting that releases its bytes when autograd drops it."""

    __slots__ = ("budget", "key", "tensor")

    def __init__(self, budget: MemoryBudget, tensor: torch.Tensor, key: int) -> None:
        self.budget = budget
        self.tensor = tensor
        self.key = key

    def __del__(self) -> None:
        self.budget._release(self.key)


class MemoryBudget:
    """Counts emulated device memory for one rank and raises OutOfMemoryError past `budget_bytes`."""

    def __init__(
        self, budget_bytes: int, model: nn.Module, state_factor: int = 4, label: str = ""
    ) -> None:
        self.budget_bytes = budget_bytes
        self.model = model
        self.state_factor = state_factor
        self.label = label
        self.activation_bytes = 0
        self.peak_bytes = 0
        self._storages: dict[int, tuple[int, int]] = {}  # storage ptr -> (refcount, nbytes)
        self._model_state_bytes: int | None = None

    # ---- accounting -------------------------------------------------------------------------
    def model_state_bytes(self) -> int:
        """Local parameter shards x state_factor (parameters, gradients, optimizer state).

        Counted in full from the start (as if gradients and optimizer state already existed,
        as they do from the second step on), and computed once: the shards never change size.
        """
        if self._model_state_bytes is None:
            total = 0
            for param in self.model.parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                total += local.numel() * local.element_size()
            self._model_state_bytes = total * self.state_factor
        return self._model_state_bytes

    def unsharded_param_bytes(self) -> int:
        """Bytes of parameters currently gathered by FSDP (registered as plain tensors)."""
        return sum(
            p.numel() * p.element_size()
            for p in self.model.parameters()
            if not isinstance(p, DTensor)
        )

    def in_use_bytes(self) -> int:
        """Everything counted right now."""
        return self.activation_bytes + self.model_state_bytes() + self.unsharded_param_bytes()

    def _acquire(self, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        count, nbytes = self._storages.get(key, (0, storage.nbytes()))
        if count == 0:
            self._check(nbytes)
            self.activation_bytes += nbytes
        self._storages[key] = (count + 1, nbytes)
        return key

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        count, nbytes = entry
        if count <= 1:
            del self._storages[key]
            self.activation_bytes -= nbytes
        else:
            self._storages[key] = (count - 1, nbytes)

    def _check(self, new_bytes: int) -> None:
        state = self.model_state_bytes()
        unsharded = self.unsharded_param_bytes()
        in_use = self.activation_bytes + state + unsharded
        self.peak_bytes = max(self.peak_bytes, in_use + new_bytes)
        if in_use + new_bytes <= self.budget_bytes:
            return
        free = max(0, self.budget_bytes - in_use)
        raise torch.OutOfMemoryError(
            f"Emulated device out of memory{self.label}. Tried to allocate "
            f"{new_bytes / MIB:.2f} MiB. The device budget (--memory-budget-gb) has a total "
            f"capacity of {self.budget_bytes / GIB:.2f} GiB of which {free / MIB:.2f} MiB is free. "
            f"In use: {self.activation_bytes / MIB:.2f} MiB activations saved for backward, "
            f"{unsharded / MIB:.2f} MiB unsharded parameters, {state / MIB:.2f} MiB sharded "
            "parameters, gradients and optimizer state. Activation checkpointing (--ac block), "
            "a smaller --batch or --seq, or a larger budget would avoid it."
        )

    # ---- hooks ------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        base = tensor._base if tensor._base is not None else tensor
        if isinstance(base, nn.Parameter) or isinstance(tensor, nn.Parameter):
            return tensor  # parameters are counted as parameters, not activations
        return _Saved(self, tensor, self._acquire(tensor))

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Saved):
            return packed.tensor
        assert isinstance(packed, torch.Tensor)
        return packed

    def hold_until_backward(self, kept: torch.Tensor, output: torch.Tensor) -> None:
        """Count `kept` (a checkpointed block's input) until autograd frees `output`'s node."""
        if output.grad_fn is None:
            return
        # Node.metadata is a dict property (typed as a method in torch's stubs)
        metadata = cast(dict[str, Any], output.grad_fn.metadata)
        metadata["zdiag_kept_input"] = _Saved(self, kept, self._acquire(kept))

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count saved activations while the block runs (wrap each forward + backward)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def install_checkpoint_accounting(self, blocks: nn.ModuleList) -> None:
        """Count each checkpointed block's input, which checkpointing keeps outside our hooks."""

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if getattr(module, "checkpointed", False) and isinstance(output, torch.Tensor):
                if args and isinstance(args[0], torch.Tensor) and torch.is_grad_enabled():
                    self.hold_until_backward(args[0], output)

        for block in blocks:
            block.register_forward_hook(hook)


def cap_cuda_memory(budget_gb: float, device: torch.device) -> None:
    """Cap the CUDA caching allocator at `budget_gb` GiB (no-op when it exceeds the device)."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = budget_gb * GIB / total
    if fraction < 1.0:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
