"""Hooks that run inside training without ever entering a torch.compile graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _skip_in_dynamo(code: Any) -> None:
    """Have dynamo run `code` (and everything it calls) eagerly, never compiling those frames."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except Exception:  # private API moved: dynamo then compiles (and falls back on) our frames
        pass


def eager_or_opaque(fn: Callable[..., None]) -> Callable[..., None]:
    """`fn` as a hook that is a plain call in eager mode and that torch.compile leaves alone.

    Wrapping every call in `torch.compiler.disable` is not free: on gloo it left Python state in
    the thread-local state that collectives capture, and `destroy_process_group` could then
    deadlock. So the hook is a plain function whose frames dynamo is told to skip; only while
    dynamo traces through it (a compiled `optimizer.step`) does it call the disabled wrapper.
    """
    opaque = torch.compiler.disable(fn)
    is_compiling = torch.compiler.is_compiling

    def hook(*args: Any) -> None:
        if is_compiling():
            opaque(*args)
        else:
            fn(*args)

    _skip_in_dynamo(hook.__code__)
    return hook
