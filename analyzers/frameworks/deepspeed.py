"""DeepSpeed ZeRO (stages 1-3): labels, units and remedies as DeepSpeed config keys.

ZeRO fetches each module's parameters itself (there is no wrap to choose: no wrap remedy). In a
trace it shows as Python-function ranges of its partitioning code (`fetch_sub_module`,
`all_gather_coalesced`, `reduce_ipg_grads`, ...; `with_stack` traces) and, for ZeRO-3, as cpu_ops
of its per-module autograd Functions (`AUTOGRAD_FUNCTION_RE`): the threads running those issue its
collectives. Units are named by position: `zero-gather-<k>` / `zero-reduce-<k>`. A run is DeepSpeed
when its manifest records a deepspeed version.
"""

from __future__ import annotations

import re

from .base import Framework, Remedy, RunFacts

NAME = "deepspeed"
ANNOTATION_RE = re.compile(r"^(DeepSpeedZeRO|ZeRO|deepspeed)")
LABEL_RE = re.compile(
    r"fetch_sub_module|all_gather_params|AllGatherCoalesced|all_gather_coalesced"
    r"|reduce_and_partition|reduce_ipg_grads|reduce_scatter_coalesced|DeepSpeedZero|deepspeed",
)
"""DeepSpeed's partitioning functions and ranges (re.search)."""
AUTOGRAD_FUNCTION_RE = re.compile(
    r"^(PreBackwardFunctionForModule|PostBackwardFunctionModule|PreBackwardFunction"
    r"|PostBackwardFunction|LinearFunctionForZeroStage3)(Backward)?$"
)
"""ZeRO-3's per-module autograd Functions (deepspeed/runtime/zero/parameter_offload.py,
linear.py; `PreBackwardFunction` / `PostBackwardFunction` before DeepSpeed 0.14), recorded as
cpu_ops named after the class (its backward node: the same name + "Backward")."""
GATHER_UNIT_PREFIX = "zero-gather-"
REDUCE_UNIT_PREFIX = "zero-reduce-"

_OVERLAP = (
    ("overlap_comm", True, '"overlap_comm": true'),
    ("stage3_prefetch_bucket_size", None, '"stage3_prefetch_bucket_size": 5e8'),
    ("stage3_max_live_parameters", None, '"stage3_max_live_parameters": 1e9'),
)


def _size_set(facts: RunFacts, key: str) -> bool:
    """Whether the config sets size `key` to something on: present and not a number <= 0 ("auto"
    counts as set)."""
    if key not in facts.settings:
        return False
    value = facts.settings[key]
    return not (isinstance(value, int | float) and not isinstance(value, bool) and value <= 0)


def overlap(facts: RunFacts) -> Remedy | None:
    """ZeRO-3's overlap keys (`overlap_comm`, a prefetch bucket and live-parameter budget): only
    those the run's config does not set (a positive size counts as set, any size as good as
    zdiag's; 0 turns prefetching off); None when all are."""
    keys = [
        text
        for key, value, text in _OVERLAP
        if not (facts.has(key, value) if value is not None else _size_set(facts, key))
    ]
    if not keys:
        return None
    if len(keys) == len(_OVERLAP):
        code = (
            f'"zero_optimization": {{"stage": 3, {keys[0]},\n'
            f"                      {keys[1]},\n"
            f"                      {keys[2]}}}"
        )
    else:
        code = '"zero_optimization": {"stage": 3, ' + ", ".join(keys) + "}"
    return Remedy(
        "Let ZeRO-3 overlap its gathers: overlap_comm=true and a stage3_prefetch_bucket_size "
        "large enough for the next module's parameters.",
        code,
    )


def bf16_comm(facts: RunFacts) -> Remedy | None:
    """The config's `bf16` section; None when the run already trains in bf16."""
    if facts.has("bf16", True):
        return None
    return Remedy(
        'train in bf16 (DeepSpeed config "bf16": {"enabled": true}; ZeRO then gathers bf16 '
        "parameters and the optimizer keeps fp32 master weights)",
        '"bf16": {"enabled": true}  # DeepSpeed config',
    )


def hybrid_shard(facts: RunFacts) -> Remedy | None:
    """ZeRO++ hierarchical partitioning (a secondary parameter copy per node); None when the
    config sets it or the run is not multi-node."""
    nnodes, world = facts.nnodes, facts.world_size
    if "zero_hpz_partition_size" in facts.settings or not nnodes or nnodes < 2:
        return None
    if not world or world % nnodes:
        return None
    per_node = world // nnodes
    return Remedy(
        f"ZeRO++ hierarchical partitioning: gather within the {per_node} ranks of a node",
        f'"zero_optimization": {{"stage": 3, "zero_hpz_partition_size": {per_node}}}',
    )


FRAMEWORK = Framework(
    name=NAME,
    title="DeepSpeed ZeRO",
    annotation_re=ANNOTATION_RE,
    label_re=re.compile(f"{LABEL_RE.pattern}|{AUTOGRAD_FUNCTION_RE.pattern}"),
    manifest_packages=("deepspeed",),
    wraps_units=False,
    overlap=overlap,
    bf16_comm=bf16_comm,
    hybrid_shard=hybrid_shard,
)
