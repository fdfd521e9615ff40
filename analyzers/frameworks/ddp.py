"""DDP (`DistributedDataParallel`): labels and remedies in its own API.

DDP replicates the model and all-reduces gradients in buckets during backward; it gathers no
parameters (no units to wrap, no prefetch). In a trace it writes `DistributedDataParallel.forward`
once per forward (a step marker); its labels stay ordinary user annotations in the event model.
This module is also the example of adding a framework: this file plus one line in
`frameworks/__init__.py`'s REGISTRY.
"""

from __future__ import annotations

import re

from .base import Framework, Remedy, RunFacts

NAME = "ddp"
LABEL_RE = re.compile(r"^DistributedDataParallel\.")
FORWARD_MARKER = r"^DistributedDataParallel\.forward$"

_OVERLAP = (
    ("bucket_cap_mb", None, "bucket_cap_mb=100"),
    ("gradient_as_bucket_view", True, "gradient_as_bucket_view=True"),
    ("static_graph", True, "static_graph=True"),
)


def overlap(facts: RunFacts) -> Remedy | None:
    """Bucketing arguments that let gradient all-reduces start during backward with fewer,
    larger messages: only those the run does not set (a set `bucket_cap_mb` counts as set)."""
    args = [
        arg
        for key, value, arg in _OVERLAP
        if not (facts.has(key, value) if value is not None else key in facts.settings)
    ]
    if not args:
        return None
    return Remedy(
        "Overlap gradient all-reduces with backward in fewer, larger buckets: " + ", ".join(args),
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        f"model = DDP(model, {', '.join(args)})",
    )


def bf16_comm(facts: RunFacts) -> Remedy | None:
    """The bf16 gradient-compression comm hook; None when the run registers one."""
    if facts.has("comm_hook", "bf16_compress_hook"):
        return None
    return Remedy(
        "all-reduce gradients in bf16 (DDP's bf16_compress_hook)",
        "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
        "model.register_comm_hook(None, default_hooks.bf16_compress_hook)",
    )


FRAMEWORK = Framework(
    name=NAME,
    title="DDP (DistributedDataParallel)",
    annotation_re=None,
    label_re=LABEL_RE,
    forward_markers=(FORWARD_MARKER,),
    shards_parameters=False,
    wraps_units=False,
    overlap=overlap,
    bf16_comm=bf16_comm,
)
