"""What would fit: the peak predicted under common memory fixes, from the blocks live at the peak.

Each prediction is `peak - freed + added`, with its arithmetic in `WhatIf.arithmetic`:

- **Activation checkpointing per block.** The repeated blocks are the module call site (the
  outermost user `forward` line, e.g. the loop `for layer in self.layers: h = layer(h)`) holding
  the most activation bytes; how many block calls are live is the most common number of live
  blocks per (call path, source line, size) signature in that group (each block call allocates
  each of its tensors once). With checkpointing a block keeps only its input, and backward
  recomputes one block at a time: `peak - A_blocks + n x input + A_blocks / n`. The input's size
  is taken as the group's most frequent activation size (a transformer block's residual stream:
  its norms, q/k/v and projections all have the input's shape). Measured against a real harness
  run with `--ac block` (tests/test_snapshot_whatif.py) the prediction is an upper bound within
  1.5x: backward temporaries at the unchanged peak are kept as they were.
- **Micro-batch halved** (with 2x gradient accumulation): activations and autograd temporaries
  scale with the batch: `peak - (A + T) / 2`.
- **reshard_after_forward=True**: only the unit being computed stays gathered:
  `peak - (U - one unit's U)`; one unit's U is the largest run of consecutive gather
  allocations in the history (a unit's all-gather allocates its buffers back to back), unknown
  without a history.
- **Optimizer state sharded over W ranks** (ZeRO-1/FSDP): `peak - O x (1 - 1/W)`, unknown
  without the world size or when FSDP already shards it (FSDP gathers seen); **offloaded to the
  CPU**: `peak - O`.
- **bf16 parameters and compute** (mixed precision): `peak - (U + P + A) / 2`, if they are fp32
  now (a snapshot does not record dtypes, so this is the most the change can save).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from ..report import WhatIf

MIB = 1024**2


class LiveBlock(Protocol):
    """A block live at the peak (snapshot_breakdown._Live)."""

    size: int
    category: str
    site: str
    module: str


def _mib(v: float) -> str:
    """Bytes in MiB, or GiB from 1 GiB on (the evidence is read by people)."""
    return f"{v / MIB / 1024:.2f} GiB" if abs(v) >= 1024 * MIB else f"{v / MIB:.1f} MiB"


def _fits(peak: int | None, capacity: int | None) -> bool | None:
    return None if peak is None or capacity is None else peak <= capacity


def repeated_blocks(live: Sequence[LiveBlock]) -> tuple[str, int, int, int] | None:
    """(call site, live block calls n, their activation bytes, input bytes) of the repeated
    blocks at the peak, None when no call site repeats."""
    acts = [b for b in live if b.category == "ACTIVATION" and b.module]
    by_root: dict[str, list[LiveBlock]] = {}
    for b in acts:
        by_root.setdefault(b.module.split(" > ")[0], []).append(b)
    best: tuple[str, int, int, int] | None = None
    for root, blocks in by_root.items():
        sig = Counter((b.module, b.site, b.size) for b in blocks)
        counts = Counter(sig.values())
        n = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
        if n < 2:
            continue
        total = sum(b.size for b in blocks)
        sizes = Counter(b.size for b in blocks)
        input_bytes = max(sizes.items(), key=lambda kv: (kv[1], -kv[0]))[0]
        if best is None or total > best[2]:
            best = (root, n, total, input_bytes)
    return best


def predict(
    live: Sequence[LiveBlock],
    peak_bytes: int,
    peak_category_bytes: dict[str, int],
    unit_gather_bytes: int | None,
    *,
    capacity_bytes: int | None = None,
    world_size: int | None = None,
) -> list[WhatIf]:
    """The what-if predictions for one rank's peak (see the module docstring)."""
    cats = peak_category_bytes
    out: list[WhatIf] = []
    rep = repeated_blocks(live)
    if rep is not None:
        root, n, a_blocks, inp = rep
        per_block = a_blocks // n
        raw = peak_bytes - a_blocks + n * inp + per_block
        pred = min(raw, peak_bytes)
        note = "" if raw < peak_bytes else " >= the peak: no saving (already checkpointed?)"
        out.append(
            WhatIf(
                change="activation checkpointing per block",
                predicted_peak_bytes=pred,
                saved_bytes=peak_bytes - pred,
                arithmetic=(
                    f"{_mib(peak_bytes)} peak - {_mib(a_blocks)} activations of {n} blocks "
                    f"(called at {root}) + {n} x {_mib(inp)} kept inputs + {_mib(per_block)} "
                    f"one block recomputed = {_mib(raw)}{note}"
                ),
                fits=_fits(pred, capacity_bytes),
            )
        )
    else:
        out.append(
            WhatIf(
                change="activation checkpointing per block",
                predicted_peak_bytes=None,
                saved_bytes=None,
                arithmetic="no repeated block call found among the activations' stacks "
                "(no stacks, or no module called more than once)",
            )
        )
    act = cats.get("ACTIVATION", 0)
    tmp = cats.get("AUTOGRAD_DETAIL", 0)
    if act + tmp:
        pred = peak_bytes - (act + tmp) // 2
        out.append(
            WhatIf(
                change="micro-batch halved (2x gradient accumulation)",
                predicted_peak_bytes=pred,
                saved_bytes=peak_bytes - pred,
                arithmetic=(
                    f"{_mib(peak_bytes)} - ({_mib(act)} activations + {_mib(tmp)} autograd "
                    f"temporaries) / 2 = {_mib(pred)}"
                ),
                fits=_fits(pred, capacity_bytes),
            )
        )
    unsharded = cats.get("PARAMETER_UNSHARDED", 0)
    if unsharded:
        if unit_gather_bytes:
            one = min(unit_gather_bytes, unsharded)
            pred = peak_bytes - (unsharded - one)
            out.append(
                WhatIf(
                    change="reshard_after_forward=True",
                    predicted_peak_bytes=pred,
                    saved_bytes=peak_bytes - pred,
                    arithmetic=(
                        f"{_mib(peak_bytes)} - ({_mib(unsharded)} gathered - {_mib(one)} of one "
                        f"unit) = {_mib(pred)}"
                    ),
                    fits=_fits(pred, capacity_bytes),
                )
            )
        else:
            out.append(
                WhatIf(
                    change="reshard_after_forward=True",
                    predicted_peak_bytes=None,
                    saved_bytes=None,
                    arithmetic="unknown: one unit's gathered size needs the allocator history",
                )
            )
    opt = cats.get("OPTIMIZER_STATE", 0)
    if opt:
        if unsharded:
            out.append(
                WhatIf(
                    change="optimizer state sharded",
                    predicted_peak_bytes=peak_bytes,
                    saved_bytes=0,
                    arithmetic="FSDP gathers parameters here, so its optimizer state is "
                    "already sharded",
                    fits=_fits(peak_bytes, capacity_bytes),
                )
            )
        elif world_size and world_size > 1:
            pred = peak_bytes - opt + opt // world_size
            out.append(
                WhatIf(
                    change=f"optimizer state sharded over {world_size} ranks",
                    predicted_peak_bytes=pred,
                    saved_bytes=peak_bytes - pred,
                    arithmetic=(
                        f"{_mib(peak_bytes)} - {_mib(opt)} x (1 - 1/{world_size}) = {_mib(pred)}"
                    ),
                    fits=_fits(pred, capacity_bytes),
                )
            )
        else:
            out.append(
                WhatIf(
                    change="optimizer state sharded",
                    predicted_peak_bytes=None,
                    saved_bytes=None,
                    arithmetic="unknown: the world size is not known (pass the traces or the "
                    "run directory)",
                )
            )
        pred = peak_bytes - opt
        out.append(
            WhatIf(
                change="optimizer state offloaded to the CPU",
                predicted_peak_bytes=pred,
                saved_bytes=opt,
                arithmetic=f"{_mib(peak_bytes)} - {_mib(opt)} optimizer state = {_mib(pred)}",
                fits=_fits(pred, capacity_bytes),
            )
        )
    params = cats.get("MODEL_STATE", 0) + cats.get("PARAMETER", 0)
    half = (unsharded + params + act) // 2
    if half:
        pred = peak_bytes - half
        out.append(
            WhatIf(
                change="bf16 parameters and compute (if fp32 now)",
                predicted_peak_bytes=pred,
                saved_bytes=half,
                arithmetic=(
                    f"{_mib(peak_bytes)} - ({_mib(unsharded)} gathered + {_mib(params)} "
                    f"parameters + {_mib(act)} activations) / 2 = {_mib(pred)} (at most: a "
                    "memory record has no dtypes)"
                ),
                fits=_fits(pred, capacity_bytes),
            )
        )
    return out
