"""`tiny-layer-wrap`: many small FSDP units inside each repeated block, collectives latency-bound.

Wrapping every Linear/norm splits each block's parameters over several all-gathers and
reduce-scatters. When those messages are below the size where the measured bandwidth flattens
(alpha x beta of the fitted latency-bandwidth model), most of each collective is fixed
per-collective overhead; one unit per block pays that overhead once per block and pass.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from zdiag.analyzers.detectors.blocks import find_block_pattern
from zdiag.analyzers.detectors.comm_model import fit_alpha_beta
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.detectors.facts import block_set, framework_of, run_facts
from zdiag.analyzers.fsdp_ledger import GATHER_FAMILY
from zdiag.analyzers.report import Finding

# A block split into >= 2 units is finer than the block: the block itself is the natural unit
# (its parameters are needed together, by one forward call).
MIN_UNITS_PER_BLOCK = 2
# Latency-bound: the median message is below where the measured bandwidth flattens. A message of
# s bytes reaches s / (alpha + s / beta) of the peak bandwidth beta; "flattened" = 80% of peak,
# reached at s = 4 x alpha x beta. Below it, over 20% of each collective is fixed overhead, and
# merging the k units of a block removes (k - 1) / k of that overhead: a saving worth a change.
FLAT_BANDWIDTH_SHARE = 0.8
LATENCY_BOUND_RATIO = FLAT_BANDWIDTH_SHARE / (1 - FLAT_BANDWIDTH_SHARE)  # x alpha x beta
# Split blocks must carry a real share of the traffic (not one odd side module).
MIN_SPLIT_COLLECTIVE_SHARE = 0.5


def detect(ctx: DetectorContext) -> list[Finding]:
    """The tiny-layer-wrap finding, or none."""
    ledgers = ctx.fsdp_ledgers()
    if not ledgers:
        return []
    lg = ledgers[0]
    names = lg.unit_order
    block = find_block_pattern(names)
    if block is None:
        return []
    sub_units: dict[str, set[str]] = defaultdict(set)
    for name in names:
        inst = block.block_of(name)
        if inst is not None and name != inst:
            sub_units[inst].add(name)
    split = {b: units for b, units in sub_units.items() if len(units) >= MIN_UNITS_PER_BLOCK}
    if not split:
        return []
    split_units = set().union(*split.values())
    recs = [r for r in lg.records if r.bytes > 0]
    split_recs = [r for r in recs if r.unit in split_units]
    if not recs or len(split_recs) < MIN_SPLIT_COLLECTIVE_SHARE * len(recs):
        return []
    model = fit_alpha_beta([r for r in recs if r.family == GATHER_FAMILY]) or fit_alpha_beta(recs)
    if model is None:
        return []
    median_bytes = statistics.median(r.bytes for r in split_recs)
    if median_bytes >= LATENCY_BOUND_RATIO * model.half_bandwidth_bytes:
        return []

    # Merging: per step, all collectives of one block, family and pass become one.
    n_steps = max(1, len(lg.steps) or len({r.step for r in split_recs}))
    groups = {(r.step, block.block_of(r.unit), r.family, r.phase) for r in split_recs}
    saved = len(split_recs) - len(groups)
    total_us = sum(r.dur_us for r in split_recs)
    exposed_us = sum(r.exposed_us for r in split_recs)
    exposed_share = exposed_us / total_us if total_us > 0 else 0.0
    overhead_share = min(1.0, len(split_recs) * model.alpha_us / total_us) if total_us else 0.0
    gain_ms = saved * model.alpha_us * exposed_share / 1e3 / n_steps
    per_block = statistics.mean(len(u) for u in split.values())
    example = sorted(split_units)[:4]
    fw = framework_of(ctx, lg.framework)
    remedy = fw.wrap_blocks(run_facts(ctx, fw, block_set(block), are_units=False), example)
    return [
        Finding(
            id="tiny-layer-wrap",
            severity="warning",
            title=(
                f"Each {block.pattern} is split into {per_block:.0f} FSDP units: "
                f"{len(split_recs) / n_steps:.0f} latency-bound collectives per step"
            ),
            ranks=[lgr.rank for lgr in ledgers],
            steps=list(lg.steps),
            units=sorted(split_units),
            evidence={
                "repeated_block": f"{block.pattern} x{block.count}",
                "units": len(names),
                "units_per_block": round(per_block, 2),
                "collectives_per_step": round(len(split_recs) / n_steps, 2),
                "median_message_bytes": int(median_bytes),
                "half_bandwidth_bytes": int(model.half_bandwidth_bytes),
                "flat_bandwidth_bytes": int(LATENCY_BOUND_RATIO * model.half_bandwidth_bytes),
                "median_message_bandwidth_share": round(
                    median_bytes / model.beta_bytes_per_us / model.time_us(median_bytes), 3
                ),
                "alpha_us": round(model.alpha_us, 2),
                "beta_bytes_per_us": round(model.beta_bytes_per_us, 2),
                "per_collective_overhead_share": round(overhead_share, 3),
                "exposed_share": round(exposed_share, 3),
                "collectives_saved_per_step": round(saved / n_steps, 2),
            },
            recommendation=(
                f"Make each {block.pattern} one FSDP unit (and the root) instead of wrapping its "
                f"submodules: {per_block:.0f}x fewer, larger collectives per block, each closer to "
                "full bandwidth."
            ),
            code=remedy.code if remedy else None,
            expected_gain_ms=round(gain_ms, 3),
            gain_method=(
                "latency-bandwidth model fitted to the fastest measured collective per message "
                f"size (alpha {model.alpha_us:.0f} us, beta {model.beta_bytes_per_us:.0f} B/us); "
                f"merging removes {saved / n_steps:.0f} collectives per step, each saving alpha, "
                f"scaled by the measured exposed share ({exposed_share:.0%})"
            ),
        )
    ]
