"""The one table of memory category rules, read by every memory categorizer.

A category says what an allocation holds (`OPTIMIZER_STATE`, `PARAMETER_UNSHARDED`, ...), in the
names torch's memory timeline uses where one fits. Each rule names its category and what it
matches: the frames of an allocation's stack (CUDA snapshots: `memory_snapshot.categorize` and
`stack_categorizer.Categorizer`), or the host ranges around an allocation on its thread
(Kineto `[memory]` events, which have no stack: `kineto_memory`). The table is in precedence
order: an allocation gets the category of the first rule that matches it, and a categorizer
reads only the rules of its kind (`STACK_RULES`, `RANGE_RULES`), in that order.

An allocation that no rule matches is `UNKNOWN`; one made before the recording started (no
stack, or freed without its allocation in the window) is `PREEXISTING`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..inputs.events import EventKind

UNKNOWN = "UNKNOWN"
PREEXISTING = "PREEXISTING"
COMM_BUFFER = "COMM_BUFFER"

ANY_NAME = ("",)
"""Name parts that match any name ("" is in every string)."""


@dataclass(frozen=True)
class Rule:
    """One category rule. A stack rule (`file` set) matches a frame whose filename contains
    `file` and whose function name contains one of `names`; a range rule (`kinds` set) matches
    an allocation inside a host range of one of `kinds` whose name contains one of `names`."""

    category: str
    names: tuple[str, ...]
    file: str | None = None
    kinds: tuple[EventKind, ...] = ()


_OPTIMIZER = "/torch/optim/"
_FSDP = "/distributed/fsdp/"
# Backward: the Python entry points, and the C++ engine when C++ frames are recorded (on CUDA
# backward runs in the engine's device thread, whose stack has no Python frames). Not any
# `torch::autograd::` frame: forward ops from Python pass through `torch::autograd::VariableType`.
_BACKWARD_FRAMES = ("_engine_run_backward", "run_backward", "autograd::Engine")
_OPS = (EventKind.CPU_OP,)

RULES: tuple[Rule, ...] = (
    Rule("OPTIMIZER_STATE", ANY_NAME, file=_OPTIMIZER),
    Rule(
        "OPTIMIZER_STATE",
        ("Optimizer.step", "Optimizer.zero_grad"),
        kinds=(EventKind.USER_ANNOTATION, EventKind.CPU_OP),
    ),
    Rule("PARAMETER_UNSHARDED", ("all_gather", "unshard"), file=_FSDP),
    Rule(
        "PARAMETER_UNSHARDED",
        ("all_gather", "unshard", "pre_forward", "pre_backward"),
        kinds=(EventKind.FSDP_ANNOTATION,),
    ),
    Rule("GRADIENT", ("post_backward", "reduce"), file=_FSDP),
    Rule(
        "GRADIENT",
        ("AccumulateGrad", "reduce"),
        kinds=(EventKind.CPU_OP, EventKind.FSDP_ANNOTATION),
    ),
    # The collectives' own frames (c10d's Python API, functional collectives) and DDP's buckets,
    # after FSDP's own rules: an FSDP gather's output stays an unsharded parameter even though
    # it passes through c10d.
    Rule(COMM_BUFFER, ANY_NAME, file="/torch/distributed/distributed_c10d.py"),
    Rule(COMM_BUFFER, ANY_NAME, file="/torch/distributed/_functional_collectives.py"),
    Rule(COMM_BUFFER, ("__init__", "_ddp_init_helper"), file="/torch/nn/parallel/distributed.py"),
    Rule(COMM_BUFFER, ANY_NAME, file="/deepspeed/runtime/comm/"),
    Rule(COMM_BUFFER, ANY_NAME, kinds=(EventKind.COMM_OP,)),
    Rule("ACTIVATION", ANY_NAME, file="/torch/utils/checkpoint.py"),
    Rule("AUTOGRAD_DETAIL", _BACKWARD_FRAMES, file=""),
    Rule("AUTOGRAD_DETAIL", ("autograd::engine::evaluate_function",), kinds=_OPS),
    Rule("ACTIVATION", ("_call_impl",), file="/torch/nn/modules/module.py"),
    Rule("ACTIVATION", ANY_NAME, kinds=(EventKind.PROFILER_STEP,)),
    Rule("MODEL_STATE", ANY_NAME, file=_FSDP),
    Rule("MODEL_STATE", ("reset_parameters", "__init__"), file="/torch/nn/"),
)
"""Every category rule, in precedence order (first match wins)."""

StackRule = tuple[str, str, tuple[str, ...]]
"""(category, filename part, name parts) of a stack rule."""

STACK_RULES: tuple[StackRule, ...] = tuple(
    (r.category, r.file, r.names) for r in RULES if r.file is not None
)
"""The rules on allocation stacks, in precedence order."""

RangeRule = tuple[str, tuple[EventKind, ...], tuple[str, ...]]
"""(category, range kinds, name parts) of a range rule."""

RANGE_RULES: tuple[RangeRule, ...] = tuple((r.category, r.kinds, r.names) for r in RULES if r.kinds)
"""The rules on the host ranges around an allocation, in precedence order."""


def _display_order(rules: tuple[tuple[str, object, object], ...]) -> tuple[str, ...]:
    """The categories of `rules` in first-rule order, then UNKNOWN and PREEXISTING."""
    return (*dict.fromkeys(r[0] for r in rules), UNKNOWN, PREEXISTING)


STACK_CATEGORIES = _display_order(STACK_RULES)
"""Every category a snapshot block can fall in, in display order."""
RANGE_CATEGORIES = _display_order(RANGE_RULES)
"""Every category a Kineto memory event can fall in, in display order."""


def stack_rule_rank(filename: str, name: str) -> int:
    """The index in STACK_RULES of the first rule a frame matches (len(STACK_RULES): none)."""
    for i, (_, file_part, name_parts) in enumerate(STACK_RULES):
        if file_part in filename and any(p in name for p in name_parts):
            return i
    return len(STACK_RULES)


def stack_category(rank: int) -> str:
    """The category of the best (lowest) stack rule rank of a stack's frames."""
    return STACK_RULES[rank][0] if rank < len(STACK_RULES) else UNKNOWN
