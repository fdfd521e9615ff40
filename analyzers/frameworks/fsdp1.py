"""FSDP1 (`FullyShardedDataParallel`): labels, units and remedies in its own API.

In a trace, FSDP1 writes record_function labels `FullyShardedDataParallel.<phase>`
(`_pre_forward_unshard`, `_pre_backward_prefetch`, ...) that name no module, so its units are
named by position: the k-th forward gather of a step is `fsdp1-unit-<k>` (`unit_name`), and the
backward gathers and gradient reductions go to the unit of the latest forward gather. Its
collectives are issued on the thread that runs the label. No label marks one forward per step (the
same names repeat per unit), so FSDP1 has no forward marker.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .base import Framework, Remedy, RunFacts

NAME = "fsdp1"
ANNOTATION_RE = re.compile(r"^FullyShardedDataParallel\.")
LABEL_RE = ANNOTATION_RE
UNIT_PREFIX = "fsdp1-unit-"
BF16_NAMES = ("bfloat16", "torch.bfloat16", "bf16")
_FSDP_IMPORT = "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP"
KEEP_ARGS = "  # + your other FSDP arguments (device_id, sharding_strategy, ...)"
"""Ends every `FSDP(...)` call a remedy writes: the remedy changes the arguments it names and the
user's own (`device_id`, ...) stay."""
CPU_KEEP_ARGS = "  # + your other FSDP arguments (sharding_strategy, ...)"
CPU_DEVICE_ARG = 'device_id=torch.device("cpu")'
"""A CPU run's own device: FSDP1 without it raises "FSDP needs a non-CPU accelerator device"."""


def _device(facts: RunFacts) -> tuple[list[str], str, str]:
    """(imports, `, device_id=...` argument, the closing comment) for the run's device: a CPU
    run's calls carry its `device_id` (pasted without it they raise on CPU); an accelerator
    run's keep the user's own."""
    if facts.device_type == "cpu":
        return ["import torch"], f", {CPU_DEVICE_ARG}", CPU_KEEP_ARGS
    return [], "", KEEP_ARGS


_OWN = (  # (setting, FSDP's default, the argument's enum: the run's value is kept when it differs)
    ("sharding_strategy", "FULL_SHARD", "ShardingStrategy"),
    ("backward_prefetch", "BACKWARD_PRE", "BackwardPrefetch"),
    ("forward_prefetch", False, ""),
    ("limit_all_gathers", True, ""),
    ("use_orig_params", False, ""),
)


def _own_arguments(facts: RunFacts) -> tuple[list[str], list[str]]:
    """(imports, `, name=value` arguments) for the run's own FSDP settings that differ from
    FSDP's defaults, where the captured configuration knows them: a wrap remedy pasted in place
    of the user's call keeps them (forward_prefetch=True, use_orig_params=True, ...)."""
    imports: list[str] = []
    args: list[str] = []
    for key, default, enum in _OWN:
        value = facts.settings.get(key)
        if value is None or value == default:
            continue
        if enum and value == "NONE":
            args.append(f", {key}=None")
        elif enum:
            imports.append(f"from torch.distributed.fsdp import {enum}")
            args.append(f", {key}={enum}.{value}")
        elif isinstance(value, bool):
            args.append(f", {key}={value}")
    return imports, args


def unit_name(k: int | str) -> str:
    """The name of FSDP1's k-th unit of a step ("fsdp1-unit-3"; k "?" when unplaced)."""
    return f"{UNIT_PREFIX}{k}"


def _policy(facts: RunFacts) -> tuple[str, list[str]] | None:
    """(auto_wrap_policy expression, lines that define it) naming the user's block set."""
    b = facts.blocks
    if b is None:
        return None
    if b.classes:
        return f"ModuleWrapPolicy({{{', '.join(b.classes)}}})", [
            "from torch.distributed.fsdp.wrap import ModuleWrapPolicy",
            *b.imports,
        ]
    if b.containers:
        return "CustomPolicy(lambda module: module in blocks)", [
            "from torch.distributed.fsdp.wrap import CustomPolicy",
            f"blocks = set({b.python})",
        ]
    return None


def wrap_blocks(facts: RunFacts, replacing: Sequence[str] = ()) -> Remedy | None:
    """An auto-wrap policy wrapping each repeated block (`ModuleWrapPolicy({Block})`, or a
    `CustomPolicy` over the container when the class is unknown); None when blocks already are
    units or the block set is unknown."""
    if facts.blocks_are_units:
        return None
    policy = _policy(facts)
    if policy is None:
        return Remedy("wrap each repeated block as an FSDP unit", None)
    expr, lines = policy
    imports, device, keep = _device(facts)
    own_imports, own = _own_arguments(facts)
    code = [*imports, _FSDP_IMPORT, *own_imports, *lines]
    if replacing:
        code.append(f"# instead of wrapping each submodule ({', '.join(replacing)}, ...):")
    code.append(f"model = FSDP(model, auto_wrap_policy={expr}{''.join(own)}{device}){keep}")
    assert facts.blocks is not None
    return Remedy(f"wrap each {facts.blocks.describe()} as an FSDP unit", "\n".join(code))


_PREFETCH = (
    ("forward_prefetch", True, "forward_prefetch=True"),
    ("backward_prefetch", "BACKWARD_PRE", "backward_prefetch=BackwardPrefetch.BACKWARD_PRE"),
    ("limit_all_gathers", True, "limit_all_gathers=True"),
)


def overlap(facts: RunFacts) -> Remedy | None:
    """forward_prefetch, BACKWARD_PRE backward prefetch and limit_all_gathers: only those the run
    does not set (unknown counts as not set); None when it sets all three."""
    args = [arg for key, value, arg in _PREFETCH if not facts.has(key, value)]
    if not args:
        return None
    head = [
        "from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel as FSDP"
        if any("BackwardPrefetch" in a for a in args)
        else _FSDP_IMPORT
    ]
    return Remedy(
        "Turn on FSDP1's prefetching: " + ", ".join(args) + ".",
        _wrap_call(facts, head, ",\n             ".join(args)),
    )


def _wrap_call(facts: RunFacts, head: list[str], argument: str) -> str:
    """`model = FSDP(model, auto_wrap_policy=<the blocks' policy>, <argument>)` with its imports
    (`head` first); without a known block set the call keeps the user's own policy as a comment."""
    policy = _policy(facts)
    imports, device, keep = _device(facts)
    lines = list(dict.fromkeys([*imports, *head, *(policy[1] if policy else [])]))
    if policy is not None:
        lines.append(
            f"model = FSDP(model, auto_wrap_policy={policy[0]},\n"
            f"             {argument}{device}){keep}"
        )
    else:
        lines.append(f"model = FSDP(model, {argument}{device}){keep}, your auto_wrap_policy")
    return "\n".join(lines)


def bf16_comm(facts: RunFacts) -> Remedy | None:
    """`MixedPrecision(param_dtype=torch.bfloat16)`; None when the run already gathers bf16."""
    if str(facts.settings.get("param_dtype", "")).lower() in BF16_NAMES:
        return None
    return Remedy(
        "gather parameters in bf16, keeping fp32 shards and fp32 gradient reduction "
        "(FSDP(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32)))",
        _wrap_call(
            facts,
            ["import torch", _FSDP_IMPORT, "from torch.distributed.fsdp import MixedPrecision"],
            "mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, "
            "reduce_dtype=torch.float32)",
        ),
    )


def hybrid_shard(facts: RunFacts) -> Remedy | None:
    """`ShardingStrategy.HYBRID_SHARD` (shard within a node, replicate across nodes); None when the
    run already uses it or is not multi-node."""
    if facts.has("sharding_strategy", "HYBRID_SHARD") or not facts.nnodes or facts.nnodes < 2:
        return None
    return Remedy(
        "sharding_strategy=ShardingStrategy.HYBRID_SHARD (shard within a node, replicate across "
        f"the {facts.nnodes} nodes)",
        _wrap_call(
            facts,
            [_FSDP_IMPORT, "from torch.distributed.fsdp import ShardingStrategy"],
            "sharding_strategy=ShardingStrategy.HYBRID_SHARD",
        ),
    )


FRAMEWORK = Framework(
    name=NAME,
    title="FSDP1 (FullyShardedDataParallel)",
    annotation_re=ANNOTATION_RE,
    label_re=LABEL_RE,
    checkpoint_note="  # before wrapping in FSDP",
    wrap_blocks=wrap_blocks,
    overlap=overlap,
    bf16_comm=bf16_comm,
    hybrid_shard=hybrid_shard,
)
