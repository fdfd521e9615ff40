"""`optimizer-state-dominant`: the optimizer's state is the biggest share of the peak.

AdamW keeps two fp32 moments per parameter (8 bytes per parameter, twice fp32 parameters):
unsharded, it is often the largest single category. When it is at least OPTIMIZER_SHARE of the
peak, sharding it (ZeRO-1/FSDP: 1/W per rank) or offloading it to the CPU is the biggest memory
lever, ahead of activation work. The gain is the snapshot's what-if: sharding when the world size
is known and the state is not already sharded, else offloading.
"""

from __future__ import annotations

from ..report import Finding, Severity
from .context import DetectorContext
from .memory_common import MIB, rank_peaks
from .rule import Rule, Threshold

# (the reasoning behind each value: RULE's thresholds, at the end of the module)
OPTIMIZER_SHARE = 0.4
WARNING_GAIN_SHARE = 0.25


def detect(ctx: DetectorContext) -> list[Finding]:
    """The optimizer-state-dominant finding (one, for the rank where it weighs most), or none."""
    hits = []
    for p in rank_peaks(ctx):
        opt = p.category_bytes.get("OPTIMIZER_STATE", 0)
        if p.peak_bytes and opt >= OPTIMIZER_SHARE * p.peak_bytes:
            hits.append((opt / p.peak_bytes, p, opt))
    if not hits:
        return []
    share, worst, opt = max(hits, key=lambda h: h[0])
    assert worst.peak_bytes is not None
    sharded = worst.what_if("optimizer state sharded over")
    offload = worst.what_if("optimizer state offloaded")
    chosen = sharded if sharded is not None and sharded.saved_bytes else offload
    gain = chosen.saved_bytes if chosen is not None else opt
    method = (
        chosen.arithmetic
        if chosen is not None
        else f"offloading removes the {opt / MIB:.1f} MiB of optimizer state from the device"
    )
    severity: Severity = "info"
    if worst.over_capacity and worst.capacity_bytes is not None and gain is not None:
        fits = worst.peak_bytes - gain <= worst.capacity_bytes
        severity = "critical" if fits else "warning"
    elif worst.over_capacity or (gain or 0) >= WARNING_GAIN_SHARE * worst.peak_bytes:
        severity = "warning"
    return [
        Finding(
            id="optimizer-state-dominant",
            severity=severity,
            title=(
                f"Optimizer state is {opt / MIB:.1f} MiB of the {worst.peak_bytes / MIB:.1f} MiB "
                f"peak ({share:.0%})"
            ),
            ranks=sorted(p.rank for _, p, _ in hits),
            evidence={
                "source": worst.source,
                "optimizer_state_bytes": opt,
                "peak_bytes": worst.peak_bytes,
                "share": round(share, 3),
                "threshold_share": OPTIMIZER_SHARE,
                "capacity_bytes": worst.capacity_bytes,
                "oom": worst.oom,
            },
            recommendation=(
                "Shard the optimizer state across the data-parallel ranks (FSDP's fully_shard, "
                "or ZeRO stage 1+) or offload it to the CPU."
            ),
            code=(
                "from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard\n"
                "fully_shard(model)  # parameters, gradients and optimizer state sharded;\n"
                "# or, when it still does not fit: fully_shard(model, "
                "offload_policy=CPUOffloadPolicy())"
            ),
            expected_gain_bytes=gain,
            gain_method=method,
        )
    ]


RULE = Rule(
    id="optimizer-state-dominant",
    summary="optimizer state is the largest share of the peak memory",
    detect=detect,
    what=(
        "The optimizer's state is at least 40% of a rank's peak memory (reported for the rank "
        "where it weighs most). Critical when the run is over capacity and the saving would "
        "make it fit; a warning when over capacity or the saving is >= a quarter of the peak; "
        "else info."
    ),
    why=(
        "AdamW keeps two fp32 moments per parameter (8 bytes per parameter, twice fp32 "
        "parameters): unsharded, it is often the largest single category, and sharding or "
        "offloading it is then the biggest memory lever, ahead of activation work."
    ),
    example="Optimizer state is 4096.0 MiB of the 7800.0 MiB peak (53%) (DDP with AdamW).",
    fix=(
        "Shard the optimizer state across the data-parallel ranks (FSDP's fully_shard, or ZeRO "
        "stage 1+) or offload it to the CPU."
    ),
    gain=(
        "The snapshot's what-if: sharding over the world size when known and not already "
        "sharded, else offloading."
    ),
    scope="runs with memory categories (CUDA snapshots with stacks, memory timelines)",
    thresholds=(
        Threshold(
            "OPTIMIZER_SHARE",
            OPTIMIZER_SHARE,
            "Optimizer state's share of the peak from which it is called dominant.",
            evidence="threshold_share",
        ),
        Threshold(
            "WARNING_GAIN_SHARE",
            WARNING_GAIN_SHARE,
            "A gain of this share of the peak is worth a warning even when the run fits.",
        ),
    ),
)
