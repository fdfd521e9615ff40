"""What the blocks a CUDA snapshot holds from before its recording began most likely are.

A snapshot's history starts when `_record_memory_history` is called, usually after the model was
built and sharded: the parameters (and, from the second step, gradients and optimizer state) are
then blocks without a stack, "before recording". Their total against the rank's sharded
parameter bytes P (from the captured model description) names them, as an inference:

- about 1 P: the parameters;
- about 2 P: the parameters and their gradients;
- about 3 P: the parameters and two optimizer moments per parameter (Adam/AdamW, gradients freed);
- about 4 P: the parameters, gradients and two optimizer moments.

"About" is within `TOLERANCE` of the multiple (buffers, padding to the allocator's 512-byte
rounding, a loss scale or RNG state add a little). Anything else is left unnamed.
"""

from __future__ import annotations

from .categories import PREEXISTING

TOLERANCE = 0.1
"""Relative distance to a multiple of P that still names it (a harness H100 OOM run: 1.016 P)."""

_MEANINGS = (
    (1, "the parameters"),
    (2, "the parameters and their gradients"),
    (3, "the parameters and two optimizer moments each (Adam/AdamW)"),
    (4, "the parameters, their gradients and two optimizer moments each (Adam/AdamW)"),
)


def infer_preexisting(category_bytes: dict[str, int], sharded_param_bytes: int | None) -> str:
    """A sentence naming what the before-recording bytes most likely are ("" when unknown)."""
    before = category_bytes.get(PREEXISTING, 0)
    if not before or not sharded_param_bytes or sharded_param_bytes <= 0:
        return ""
    ratio = before / sharded_param_bytes
    for multiple, meaning in _MEANINGS:
        if abs(ratio - multiple) <= TOLERANCE * multiple:
            return (
                f"most likely {meaning} ({ratio:.2f} x the {sharded_param_bytes / 2**20:.1f} MiB "
                "of parameters this rank holds; inferred from the sizes)"
            )
    return ""
