"""What the model's forward saves for backward, per repeated block: one forward, measured.

`zdiag run --profile-memory` arms it with the model description (`model_capture.py`). At the
model's first forward, `ActivationProbe.start` registers, for that one forward only:

- a saved-tensor hook pair (`torch.autograd.graph.saved_tensors_hooks`) whose pack hook notes
  each tensor autograd saves for backward, by storage (a storage several ops save, or several
  views of, counts once, with its whole size), and returns the tensor itself (nothing changes);
  parameters, and views of them (a linear's `weight.t()`), are left out: they are not
  activations, and FSDP frees and re-gathers its unsharded ones on its own schedule;
- a forward pre-hook and a forward hook on each repeated block (the children of the outermost
  containers that hold two or more children of one class: `transformer.h.0`, ...), so that each
  saved tensor is charged to the innermost block running, and each block's tensor inputs
  (positional and keyword: what activation checkpointing keeps) are summed;
- a forward hook on the model itself (`always_call`: it also runs when the forward raises) that
  stops everything and hands the sizes (`ActivationSizes`) to the model capture.

Saved tensors of the loss, outside the model's forward, are not counted. Inside a region the user
already checkpoints, torch's own hooks take the saved tensors: only what they keep is seen.
Errors are reported through the session's channel and never reach training: the pack hook
returns its tensor untouched whatever happens, and a model under `torch.compile` is not probed
(its graphs would break on the hooks). The cost is one Python call per saved tensor in one
forward; the blocks kept are capped (`MAX_PROBED_BLOCKS`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .compile_safe import eager_or_opaque
from .model_schema import ActivationSizes, BlockActivations

MAX_PROBED_BLOCKS = 1024


def _storage_key(t: torch.Tensor) -> tuple[Any, int, int]:
    """(device, storage address, bytes) of a dense tensor; a tensor subclass without a storage
    (DTensor) counts its own bytes under its id."""
    try:
        st = t.untyped_storage()
        return (t.device, st.data_ptr(), st.nbytes())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return ("id", id(t), t.numel() * t.element_size())


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (`weight.t()` saved by a linear)."""
    if isinstance(t, nn.Parameter):
        return True
    base = getattr(t, "_base", None)
    return isinstance(base, nn.Parameter)


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    """The tensors among a call's arguments (one level into tuples, lists and dicts)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from (x for x in v if isinstance(x, torch.Tensor))
        elif isinstance(v, dict):
            yield from (x for x in v.values() if isinstance(x, torch.Tensor))


def is_compiled(model: nn.Module) -> bool:
    """Whether torch.compile wraps the model or any of its modules."""
    return any(
        type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
        for m in model.modules()
    )


class ActivationProbe:
    """One forward's saved tensors, by block (see the module docstring)."""

    def __init__(
        self,
        blocks: list[tuple[str, str, nn.Module]],
        done: Callable[[ActivationSizes], None],
        report: Callable[[str], None],
    ) -> None:
        """`blocks`: (container path, block path, the module its parent calls), in forward
        order as far as known; `done` receives the sizes once the model's forward ends."""
        self._blocks = blocks[:MAX_PROBED_BLOCKS]
        self._dropped = max(0, len(blocks) - MAX_PROBED_BLOCKS)
        self._done = done
        self._report = report
        self._handles: list[Any] = []
        self._context: Any = None
        self._seen: set[tuple[Any, int]] = set()
        self._running: list[int] = []  # indices of the blocks whose forward is running
        self._saved = [0] * len(self._blocks)
        self._inputs = [0] * len(self._blocks)
        self._outside = 0
        self._tensors = 0
        self._failed = False
        self._stopped = False

    def start(self, model: nn.Module) -> None:
        """Arm the hooks for the forward of `model` that is starting now."""
        for k, (_, _, module) in enumerate(self._blocks):
            self._handles.append(
                module.register_forward_pre_hook(
                    eager_or_opaque(lambda _m, args, kwargs, k=k: self._enter(k, args, kwargs)),
                    with_kwargs=True,
                )
            )
            self._handles.append(
                module.register_forward_hook(
                    eager_or_opaque(lambda *_a, k=k: self._leave(k)), always_call=True
                )
            )
        self._handles.append(
            model.register_forward_hook(eager_or_opaque(lambda *_a: self.stop()), always_call=True)
        )
        context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        context.__enter__()
        self._context = context  # only once entered: `stop` leaves what it did not push

    def stop(self) -> None:
        """Remove every hook and hand over the sizes (once; an error is reported, never
        raised: this runs inside the model's forward hook)."""
        if self._stopped:
            return
        self._stopped = True
        context, self._context = self._context, None
        try:
            if context is not None:
                context.__exit__(None, None, None)
        except Exception as exc:
            self._fail(exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
        if self._failed or context is None:
            return
        try:
            self._done(self._sizes())
        except Exception as exc:
            self._fail(exc)

    def _sizes(self) -> ActivationSizes:
        return ActivationSizes(
            saved_bytes=self._outside + sum(self._saved),
            tensors=self._tensors,
            outside_blocks_bytes=self._outside,
            containers=tuple(dict.fromkeys(c for c, _, _ in self._blocks)),
            blocks=tuple(
                BlockActivations(path=p, saved_bytes=s, input_bytes=i)
                for (_, p, _), s, i in zip(self._blocks, self._saved, self._inputs, strict=True)
            ),
            blocks_dropped=self._dropped,
        )

    def _enter(self, k: int, args: Any, kwargs: Any) -> None:
        try:
            self._running.append(k)
            keys = {_storage_key(t) for t in _tensors([*args, kwargs]) if not _is_parameter(t)}
            self._inputs[k] += sum(n for *_, n in keys)
        except Exception as exc:
            self._fail(exc)

    def _leave(self, k: int) -> None:
        if self._running and self._running[-1] == k:
            self._running.pop()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            if not _is_parameter(t):
                device, ptr, nbytes = _storage_key(t)
                if (device, ptr) not in self._seen:
                    self._seen.add((device, ptr))
                    self._tensors += 1
                    if self._running:
                        self._saved[self._running[-1]] += nbytes
                    else:
                        self._outside += nbytes
        except Exception as exc:
            self._fail(exc)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def _fail(self, exc: Exception) -> None:
        if not self._failed:
            self._failed = True
            self._report(f"activation sizes not measured: {type(exc).__name__}: {exc}")
