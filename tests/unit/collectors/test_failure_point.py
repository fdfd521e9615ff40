"""Where in the model an exception was raised (collectors/failure_point.py), on real modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from zdiag.collectors.failure_point import FailurePoint, failure_point


class _Block(nn.Module):
    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return self.proj(x)


class _Model(nn.Module):
    def __init__(self, failing: int) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(_Block(i == failing) for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


def _raised(fn: object) -> BaseException:
    with pytest.raises(torch.OutOfMemoryError) as info:
        fn()  # type: ignore[operator]
    return info.value


def test_a_failure_in_a_blocks_forward_names_the_block() -> None:
    model = _Model(failing=2)
    exc = _raised(lambda: model(torch.ones(2, 4)))
    assert failure_point(exc, id(model)) == FailurePoint(("", "blocks.2"), in_backward=False)


def test_wrappers_name_no_path_of_their_own() -> None:
    """A checkpoint wrapper around the failing block: the path is the block's, as the model
    description spells it (the wrapper's `_checkpoint_wrapped_module` is not a path)."""
    model = _Model(failing=1)
    model.blocks[1] = checkpoint_wrapper(model.blocks[1])
    exc = _raised(lambda: model(torch.ones(2, 4)))
    assert failure_point(exc, id(model)).modules == ("", "blocks.1")


def test_without_the_described_model_nothing_is_named() -> None:
    """Modules outside the model the description saw (another id) are not guessed at."""
    model = _Model(failing=0)
    exc = _raised(lambda: model(torch.ones(2, 4)))
    assert failure_point(exc, None) == FailurePoint()
    assert failure_point(exc, id(nn.Linear(1, 1))) == FailurePoint()


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 MiB")


def test_a_failure_inside_backward_says_so() -> None:
    model = _Model(failing=-1)
    x = torch.ones(2, 4, requires_grad=True)
    out = _FailsInBackward.apply(model(x)).sum()
    exc = _raised(out.backward)
    assert failure_point(exc, id(model)).in_backward
