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
  run with `--ac block` (tests/unit/memory/test_snapshot_whatif.py) the prediction is an upper bound within
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
    """A block live at the peak (`snapshot_replay.Live`)."""

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
    peak = _Peak(peak_bytes, peak_category_bytes, capacity_bytes)
    out = [_checkpointing(live, peak)]
    micro = _micro_batch(peak)
    if micro is not None:
        out.append(micro)
    if peak.unsharded:
        out.append(_reshard(peak, unit_gather_bytes))
    if peak.cat("OPTIMIZER_STATE"):
        out += _optimizer(peak, world_size)
    bf16 = _bf16(peak)
    if bf16 is not None:
        out.append(bf16)
    return out


class _Peak:
    """The peak a prediction starts from: its bytes, its bytes by category, the capacity."""

    def __init__(self, bytes_: int, cats: dict[str, int], capacity: int | None) -> None:
        self.bytes = bytes_
        self.cats = cats
        self.capacity = capacity
        self.unsharded = cats.get("PARAMETER_UNSHARDED", 0)

    def cat(self, name: str) -> int:
        """The peak's bytes of one category (0 when none)."""
        return self.cats.get(name, 0)

    def predicted(
        self, change: str, pred: int, arithmetic: str, saved: int | None = None
    ) -> WhatIf:
        """A prediction of `pred` bytes at the peak (saved: the peak less it, unless given)."""
        return WhatIf(
            change=change,
            predicted_peak_bytes=pred,
            saved_bytes=self.bytes - pred if saved is None else saved,
            arithmetic=arithmetic,
            fits=_fits(pred, self.capacity),
        )


def _unknown(change: str, why: str) -> WhatIf:
    """A fix whose effect cannot be predicted from what was recorded."""
    return WhatIf(change=change, predicted_peak_bytes=None, saved_bytes=None, arithmetic=why)


def _checkpointing(live: Sequence[LiveBlock], peak: _Peak) -> WhatIf:
    """Activation checkpointing per block, from the repeated blocks at the peak."""
    change = "activation checkpointing per block"
    rep = repeated_blocks(live)
    if rep is None:
        return _unknown(
            change,
            "no repeated block call found among the activations' stacks "
            "(no stacks, or no module called more than once)",
        )
    root, n, a_blocks, inp = rep
    per_block = a_blocks // n
    raw = peak.bytes - a_blocks + n * inp + per_block
    note = "" if raw < peak.bytes else " >= the peak: no saving (already checkpointed?)"
    return peak.predicted(
        change,
        min(raw, peak.bytes),
        f"{_mib(peak.bytes)} peak - {_mib(a_blocks)} activations of {n} blocks "
        f"(called at {root}) + {n} x {_mib(inp)} kept inputs + {_mib(per_block)} "
        f"one block recomputed = {_mib(raw)}{note}",
    )


def _micro_batch(peak: _Peak) -> WhatIf | None:
    """The micro-batch halved: activations and autograd temporaries halve."""
    act, tmp = peak.cat("ACTIVATION"), peak.cat("AUTOGRAD_DETAIL")
    if not act + tmp:
        return None
    pred = peak.bytes - (act + tmp) // 2
    return peak.predicted(
        "micro-batch halved (2x gradient accumulation)",
        pred,
        f"{_mib(peak.bytes)} - ({_mib(act)} activations + {_mib(tmp)} autograd "
        f"temporaries) / 2 = {_mib(pred)}",
    )


RESHARD_AFTER_FORWARD = "reshard_after_forward=True"
"""The `change` of the what-if that reshards every unit after forward."""


def _reshard(peak: _Peak, unit_gather_bytes: int | None) -> WhatIf:
    """reshard_after_forward=True: only one unit stays gathered."""
    change = RESHARD_AFTER_FORWARD
    if not unit_gather_bytes:
        return _unknown(change, "unknown: one unit's gathered size needs the allocator history")
    one = min(unit_gather_bytes, peak.unsharded)
    pred = peak.bytes - (peak.unsharded - one)
    return peak.predicted(
        change,
        pred,
        f"{_mib(peak.bytes)} - ({_mib(peak.unsharded)} gathered - {_mib(one)} of one "
        f"unit) = {_mib(pred)}",
    )


def _optimizer(peak: _Peak, world_size: int | None) -> list[WhatIf]:
    """The optimizer state sharded over the ranks, and offloaded to the CPU."""
    opt = peak.cat("OPTIMIZER_STATE")
    if peak.unsharded:
        sharded = peak.predicted(
            "optimizer state sharded",
            peak.bytes,
            "FSDP gathers parameters here, so its optimizer state is already sharded",
        )
    elif world_size and world_size > 1:
        pred = peak.bytes - opt + opt // world_size
        sharded = peak.predicted(
            f"optimizer state sharded over {world_size} ranks",
            pred,
            f"{_mib(peak.bytes)} - {_mib(opt)} x (1 - 1/{world_size}) = {_mib(pred)}",
        )
    else:
        sharded = _unknown(
            "optimizer state sharded",
            "unknown: the world size is not known (pass the traces or the run directory)",
        )
    pred = peak.bytes - opt
    offloaded = peak.predicted(
        "optimizer state offloaded to the CPU",
        pred,
        f"{_mib(peak.bytes)} - {_mib(opt)} optimizer state = {_mib(pred)}",
        saved=opt,
    )
    return [sharded, offloaded]


def _bf16(peak: _Peak) -> WhatIf | None:
    """bf16 parameters and compute: parameters and activations halve (at most)."""
    params = peak.cat("MODEL_STATE") + peak.cat("PARAMETER")
    act = peak.cat("ACTIVATION")
    half = (peak.unsharded + params + act) // 2
    if not half:
        return None
    pred = peak.bytes - half
    return peak.predicted(
        "bf16 parameters and compute (if fp32 now)",
        pred,
        f"{_mib(peak.bytes)} - ({_mib(peak.unsharded)} gathered + {_mib(params)} "
        f"parameters + {_mib(act)} activations) / 2 = {_mib(pred)} (at most: a "
        "memory record has no dtypes)",
        saved=half,
    )
