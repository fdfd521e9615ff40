"""NVTX ranges for Nsight Systems: one per training step, and per FSDP unit forward and backward.

Active only when CUDA is available and NVTX is on (`--nvtx`, the default). Otherwise
`StepRanges` returns at once from every call (no torch.cuda call) and `UnitRanges` registers
nothing at all: no hook, no per-step work. The per-unit ranges also need an NVTX tool listening
(Nsight sets `NVTX_INJECTION64_PATH` in the processes it profiles): their hooks cost 50–100 µs
per unit and step on the host (measured on CPU with the NVTX calls replaced by no-ops:
`bench/nvtx_unit_cost.py`, docs/benchmarks.md), which is not spent when nothing would receive the
ranges. The step range is always pushed (~2 µs).

- `zdiag step N`: pushed and popped from the step hook (`range_push`/`range_pop`, training thread).
- `zdiag forward <fqn>` / `zdiag recompute <fqn>` / `zdiag backward <fqn>`, one per FSDP unit
  (FSDP2 `fully_shard` modules, FSDP1 `FullyShardedDataParallel`; `<fqn>` is the unit's name in the
  model the script calls, `root` when that model is itself a unit). They use
  `range_start`/`range_end`, which are not bound to a thread: on CUDA autograd runs backward on
  its own device thread.
  - forward: opened by a forward pre-hook placed before FSDP's own (so FSDP's unshard wait is
    inside) and closed by a forward hook placed after FSDP's (so the reshard is inside; it runs
    even if the forward raises). A forward that runs inside backward is activation checkpointing
    recomputing the unit: it is named `recompute`.
  - backward: opened when the first gradient of the unit's outputs is computed (a tensor hook
    placed in a forward hook that runs before FSDP's own post-forward, so it also fires before
    FSDP's pre-backward unshard), closed when the gradient of its inputs is computed (the
    boundary where FSDP2 issues its reduce-scatter), or, for a unit whose inputs need no
    gradient (the root takes token ids), when backward ends (an autograd engine callback).
    When a unit's backward opens, the open backward ranges of units that are not its ancestors
    are closed first: their backward is over (it also keeps sibling ranges from overlapping).
  - Nothing leaks: ranges still open when a backward pass ends (e.g. a checkpointed recompute that
    torch stopped early) are closed then, and everything still open is closed at each step end.
  The units are found at the first forward of an FSDP module during step 0, under the module the
  script called (the outermost forward open then, tracked by a global forward pre- and post-hook),
  so a model whose root is not itself wrapped (`fully_shard` on each block only) gets every unit,
  named as in that model. A model without FSDP costs these two global hooks until step 0 ends.

Every hook body runs holding one lock (autograd calls the backward hooks on its device thread
while the training thread may be in a forward hook). Every hook is contained: an exception is
reported once, all hooks are removed, open ranges are closed and training goes on. Module hooks
go through `eager_or_opaque`: a compiled model runs them eagerly at the unit boundaries, where
FSDP2's own hooks already sit.

Verified here (CPU only, no GPU): the ranges' names, nesting and balance with the NVTX functions
replaced by a recorder, on an FSDP2 model with and without activation checkpointing, and that
nothing is registered without CUDA. Never seen in Nsight Systems: how the ranges line up with
kernels on a real GPU timeline is unverified. Units inside a reentrant checkpoint
(`use_reentrant=True`) get forward/recompute ranges but no backward range.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from .compile_safe import eager_or_opaque

NO_GRAPH_TASK = -1
"""`torch._C._current_graph_task_id()` outside backward."""


class StepRanges:
    """One NVTX range per step: `begin(n)` opens `zdiag step n`, `end()` closes the open one."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = bool(enabled) and torch.cuda.is_available()
        self._open = False

    def begin(self, step: int) -> None:
        """Open the range of step `step`."""
        if self.enabled:
            torch.cuda.nvtx.range_push(f"zdiag step {step}")
            self._open = True

    def end(self) -> None:
        """Close the open range, if any."""
        if self.enabled and self._open:
            torch.cuda.nvtx.range_pop()
            self._open = False


def fsdp_unit_types() -> tuple[type, ...]:
    """The FSDP module classes of this torch build (FSDP2's `FSDPModule`, FSDP1's wrapper)."""
    found: list[type] = []
    try:
        from torch.distributed.fsdp import FSDPModule

        found.append(FSDPModule)
    except ImportError:
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        found.append(FullyShardedDataParallel)
    except ImportError:
        pass
    return tuple(found)


_WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def unit_name(fqn: str) -> str:
    """A unit's name in the model, without FSDP1/checkpoint/compile wrapper parts; `root` if ''."""
    for part in _WRAPPER_NAMES:
        fqn = fqn.replace(part, "")
    return fqn.rstrip(".") or "root"


def find_units(root: torch.nn.Module, types: tuple[type, ...]) -> list[tuple[str, Any]]:
    """(name, module) of every FSDP unit under `root` (itself included), outermost first."""
    return [(unit_name(n), m) for n, m in root.named_modules() if isinstance(m, types)]


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's inputs or outputs (tensors, and lists/tuples/dicts of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _needing_grad(obj: Any) -> list[torch.Tensor]:
    return [t for t in _tensors(obj) if t.requires_grad]


class _Once:
    """Calls `fn` the first time a gradient hook fires for it (any number of tensors)."""

    __slots__ = ("fired", "fn")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.fired = False

    def fire(self, *grads: Any) -> None:
        if not self.fired:
            self.fired = True
            self.fn()


@dataclass
class _Unit:
    name: str
    ancestors: frozenset[int] = frozenset()  # indexes of the units that contain this one
    forward: list[int] = field(default_factory=list)  # ids of open forward/recompute ranges


@dataclass
class _Open:
    unit: int
    kind: str
    range_id: int
    task: int  # autograd graph task it opened in (NO_GRAPH_TASK: forward)


NVTX_TOOL_ENV = ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH")
"""Set by Nsight Systems / Nsight Compute (and any NVTX tool) in the processes they profile: the
library that receives NVTX calls. Without it every NVTX call is a no-op, so the per-unit hooks
would cost host time for nothing (the same test NVTX.jl uses to keep NVTX free)."""


def nvtx_tool_attached() -> bool:
    """Whether an NVTX tool listens in this process (see NVTX_TOOL_ENV)."""
    return any(os.environ.get(name) for name in NVTX_TOOL_ENV)


class UnitRanges:
    """NVTX ranges per FSDP unit (see the module docstring). Off: registers nothing."""

    def __init__(self, enabled: bool, report: Callable[[str], None]) -> None:
        self.enabled = bool(enabled) and torch.cuda.is_available() and nvtx_tool_attached()
        self._report = report
        self._types = fsdp_unit_types() if self.enabled else ()
        self._units: list[_Unit] = []
        self._open: list[_Open] = []
        self._handles: list[Any] = []
        self._unit_index: dict[int, int] = {}  # id(unit module) -> its index in _units
        self._finder: list[Any] = []  # the global hooks that look for the units (step 0)
        self._depth = 0  # module forwards open while looking (the global pre/post hooks)
        self._outer: Any = None  # the module called while none was open: the script's model
        self._tasks_with_callback: set[int] = set()
        self._broken = False
        # Hooks run on the training thread and, in backward, on autograd's device thread: every
        # hook body holds this lock, so the open ranges are never changed from both at once.
        # Re-entrant: a hook body that reports a failure closes ranges under the same hold.
        self._lock = threading.RLock()
        self._start: Callable[[str], int] = torch.cuda.nvtx.range_start
        self._end: Callable[[int], None] = torch.cuda.nvtx.range_end
        # Built once, in attach(): wrapping a function for torch.compile costs more than the hook
        # itself, and nothing is built while the ranges are off (no tool listening: the usual case).
        self._grad_hook: Callable[..., None] | None = None

    # ------------------------------------------------------------ lifecycle
    def watch(self) -> None:
        """Look for the FSDP units at the first forward of an FSDP module (from now until step 0 ends)."""
        if self.enabled and self._types:
            self._finder = [
                register_module_forward_pre_hook(
                    eager_or_opaque(self._contained(self._on_any_forward))
                ),
                register_module_forward_hook(
                    eager_or_opaque(self._contained(self._on_any_forward_end)), always_call=True
                ),
            ]

    def step_end(self) -> None:
        """Close every range still open; stop looking for units after step 0."""
        self._remove_finder()
        if self._open:
            self._contained(self._close_all)()

    def close(self) -> None:
        """Remove every hook and close what is open (the run ends)."""
        self._remove_finder()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._open:
            self._contained(self._close_all)()

    @property
    def unit_names(self) -> list[str]:
        """The units that got ranges, outermost first (empty until found)."""
        return [u.name for u in self._units]

    # ------------------------------------------------------------ finding the units
    def _on_any_forward(self, module: Any, args: Any) -> None:
        """Global forward pre-hook (step 0): find the units at the first FSDP forward.

        The root module need not be an FSDP unit (`fully_shard` on each block only): the units are
        looked for under the module the script called (the one entered while no forward was
        open), so every unit is found, with its name in that module.
        """
        if self._depth == 0:
            self._outer = module
        self._depth += 1
        if not (isinstance(module, self._types) and isinstance(module, torch.nn.Module)):
            return
        outer = self._outer
        self._remove_finder()
        within = outer is not None and any(m is module for m in outer.modules())
        self.attach(outer if within else module)
        index = self._unit_index.get(id(module))
        if index is not None:
            # This call's own pre-hooks were read before the range hooks were registered: open
            # its range here (its forward hooks are read after the forward, so they close it).
            self._forward_begins(index, args, {})

    def _on_any_forward_end(self, module: Any, args: Any, output: Any) -> None:
        """Global forward hook (step 0, always called): one module forward less is open."""
        self._depth = max(0, self._depth - 1)

    def _remove_finder(self) -> None:
        for handle in self._finder:
            handle.remove()
        self._finder = []
        self._outer = None

    def attach(self, root: torch.nn.Module) -> None:
        """Register the range hooks on every FSDP unit under `root` (itself included), once."""
        if self._units or not self.enabled:
            return
        if self._grad_hook is None:
            self._grad_hook = eager_or_opaque(self._contained(_Once.fire))
        found = find_units(root, self._types)
        names = [name for name, _ in found]
        for index, (name, module) in enumerate(found):
            ancestors = frozenset(
                i for i, other in enumerate(names) if i != index and _contains(other, name)
            )
            self._units.append(_Unit(name, ancestors))
            self._unit_index[id(module)] = index
            self._register(index, module)

    def _register(self, index: int, module: Any) -> None:
        def pre(mod: Any, args: Any, kwargs: Any) -> None:
            self._forward_begins(index, args, kwargs)

        def registers_backward(mod: Any, args: Any, output: Any) -> None:
            self._watch_outputs(index, output)

        def post(mod: Any, args: Any, output: Any) -> None:
            self._forward_ends(index)

        self._handles += [
            module.register_forward_pre_hook(
                eager_or_opaque(self._contained(pre)), prepend=True, with_kwargs=True
            ),
            module.register_forward_hook(
                eager_or_opaque(self._contained(registers_backward)), prepend=True
            ),
            module.register_forward_hook(eager_or_opaque(self._contained(post)), always_call=True),
        ]

    # ------------------------------------------------------------ forward
    def _forward_begins(self, index: int, args: Any, kwargs: Any) -> None:
        task = _graph_task()
        kind = "forward" if task == NO_GRAPH_TASK else "recompute"
        opened = self._open_range(index, kind, task)
        self._units[index].forward.append(opened.range_id)
        if task == NO_GRAPH_TASK:
            inputs = _needing_grad((args, kwargs))
            if inputs:
                self._on_grads(inputs, lambda: self._backward_ends(index), all_of=True)

    def _forward_ends(self, index: int) -> None:
        stack = self._units[index].forward
        if stack:
            self._close_range(stack.pop())

    # ------------------------------------------------------------ backward
    def _watch_outputs(self, index: int, output: Any) -> None:
        if _graph_task() != NO_GRAPH_TASK:
            return  # a recompute: its outputs are not where backward flows
        outputs = _needing_grad(output)
        if outputs:
            self._on_grads(outputs, lambda: self._backward_begins(index), all_of=False)

    def _backward_begins(self, index: int) -> None:
        ancestors = self._units[index].ancestors
        for o in [o for o in self._open if o.kind == "backward" and o.unit not in ancestors]:
            self._close_range(o.range_id)
        self._open_range(index, "backward", _graph_task())

    def _backward_ends(self, index: int) -> None:
        for o in reversed(self._open):
            if o.kind == "backward" and o.unit == index:
                self._close_range(o.range_id)
                return

    def _on_grads(self, tensors: list[torch.Tensor], fn: Callable[[], None], all_of: bool) -> None:
        """Call `fn` once: when the first (or, with `all_of`, the last) of their gradients is computed.

        The hooks live as long as the tensors (one step), so no handle is kept.
        """
        assert self._grad_hook is not None  # built by attach(), which registered the caller
        once = _Once(fn)
        hook = functools.partial(self._grad_hook, once)
        if all_of and len(tensors) > 1:
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="all")
            return
        for t in tensors:
            t.register_hook(hook)

    # ------------------------------------------------------------ ranges
    def _open_range(self, index: int, kind: str, task: int) -> _Open:
        opened = _Open(index, kind, self._start(f"zdiag {kind} {self._units[index].name}"), task)
        self._open.append(opened)
        if task != NO_GRAPH_TASK and task not in self._tasks_with_callback:
            self._tasks_with_callback.add(task)
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(self._contained(lambda: self._backward_pass_ends(task)))
        return opened

    def _close_range(self, range_id: int) -> None:
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i].range_id == range_id:
                del self._open[i]
                self._end(range_id)
                return

    def _backward_pass_ends(self, task: int) -> None:
        self._tasks_with_callback.discard(task)
        for o in reversed([o for o in self._open if o.task == task]):
            self._close_range(o.range_id)
        for unit in self._units:  # recomputes stopped early never reached their forward hook
            unit.forward = [r for r in unit.forward if any(o.range_id == r for o in self._open)]

    def _close_all(self) -> None:
        while self._open:
            self._end(self._open.pop().range_id)
        for unit in self._units:
            unit.forward.clear()
        self._tasks_with_callback.clear()

    # ------------------------------------------------------------ containment
    def _contained(self, fn: Callable[..., None]) -> Callable[..., None]:
        """`fn` that never raises: the first error is reported, every hook removed, ranges closed.

        It runs holding the lock (one hook body at a time, whichever thread calls it).
        """

        def call(*args: Any) -> None:
            if self._broken:
                return
            with self._lock:
                if self._broken:
                    return
                try:
                    fn(*args)
                except Exception as exc:
                    self._fail(exc)

        return call

    def _fail(self, exc: Exception) -> None:
        self._broken = True
        self._report(f"NVTX unit ranges failed: {type(exc).__name__}: {exc}; they are off")
        self._remove_finder()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        open_ids, self._open = [o.range_id for o in self._open], []
        for range_id in reversed(open_ids):
            try:
                self._end(range_id)
            except Exception:
                pass


def _contains(outer: str, inner: str) -> bool:
    """Whether unit `outer` contains unit `inner` (by name)."""
    return outer == "root" or inner.startswith(outer + ".")


def _graph_task() -> int:
    """The autograd graph task running on this thread (NO_GRAPH_TASK outside backward)."""
    return int(torch._C._current_graph_task_id())
