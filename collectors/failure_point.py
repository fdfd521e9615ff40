"""Where in the model an exception was raised: the modules whose forward was running.

Read from the exception's traceback once, when the rank fails (never on the training path): each
frame whose `self` is an `nn.Module` is a module being called. The described model (the module
`ModelCapture` saw first) is the root, and the others get its description's paths (wrappers
unwrapped: DDP, FSDP1, checkpoint and compile wrappers name no path of their own). A traceback
that passes through autograd's backward ran in backward: there a module's frames belong to a
recompute (activation checkpointing), not to the forward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import TracebackType

from torch import nn

from .model_capture import wrapper_chain

MAX_FRAMES = 512
MAX_MODULES_NAMED = 32
MAX_MODULES_WALKED = 200_000
_AUTOGRAD = f"{os.sep}torch{os.sep}autograd{os.sep}"
_TENSOR = f"{os.sep}torch{os.sep}_tensor.py"


@dataclass(frozen=True)
class FailurePoint:
    """The module paths whose call was running, outermost first (the model itself is ""; only
    modules under the described model), and whether the failure came inside backward."""

    modules: tuple[str, ...] = ()
    in_backward: bool = False


def _frames(tb: TracebackType | None) -> list[TracebackType]:
    out: list[TracebackType] = []
    while tb is not None and len(out) < MAX_FRAMES:
        out.append(tb)
        tb = tb.tb_next
    return out


def _paths(root: nn.Module) -> dict[int, str]:
    """{id(module): its path under `root`}, wrappers and the module they wrap alike."""
    paths: dict[int, str] = {}
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack and len(paths) < MAX_MODULES_WALKED:
        path, module = stack.pop()
        chain = wrapper_chain(module)
        if any(id(m) in paths for m in chain):
            continue
        for m in chain:
            paths[id(m)] = path
        for name, child in chain[-1].named_children():
            if child is not None:
                stack.append((f"{path}.{name}" if path else name, child))
    return paths


def failure_point(exc: BaseException, model_id: int | None) -> FailurePoint:
    """The modules whose call was running when `exc` was raised (see the module docstring)."""
    modules: list[nn.Module] = []
    in_backward = False
    for tb in _frames(exc.__traceback__):
        code = tb.tb_frame.f_code
        if code.co_filename.endswith(_TENSOR) and code.co_name == "backward":
            in_backward = True
        elif _AUTOGRAD in code.co_filename and "backward" in code.co_name:
            in_backward = True
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and not any(owner is m for m in modules):
            modules.append(owner)
    root = next((m for m in modules if id(m) == model_id), None)
    if root is None:
        return FailurePoint(in_backward=in_backward)
    paths = _paths(root)
    named: list[str] = []
    for m in modules:
        path = paths.get(id(m))
        if path is not None and path not in named:
            named.append(path)
    return FailurePoint(tuple(named[-MAX_MODULES_NAMED:]), in_backward)
