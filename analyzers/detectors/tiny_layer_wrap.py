"""`tiny-layer-wrap`: many small FSDP units inside each repeated block, collectives latency-bound.

Wrapping every Linear/norm splits each block's parameters over several all-gathers and
reduce-scatters. When those messages are below the size where the measured bandwidth flattens
(alpha x beta of the fitted latency-bandwidth model), most of each collective is fixed
per-collective overhead; one unit per block pays that overhead once per block and pass.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable

from ..frameworks import BlockSet
from ..rank.fsdp_ledger import GATHER_FAMILY, CollectiveRecord
from ..report import Finding
from .blocks import find_block_pattern
from .comm_model import AlphaBeta, fit_alpha_beta
from .context import DetectorContext
from .facts import (
    block_set,
    captured,
    framework_of,
    model_block_set,
    run_facts,
)

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


def _blocks(
    ctx: DetectorContext, names: list[str]
) -> tuple[BlockSet, Callable[[str], str | None]] | None:
    """The repeated blocks and a function giving the block a unit path lies in: from the
    captured model description (its wrap set, by the user's container paths), else from the
    `<list>.<N>` pattern of the unit names."""
    model = captured(ctx)
    if model is not None:
        blocks = model_block_set(model)
        if blocks is None:
            return None
        containers = blocks.containers

        def block_of(path: str) -> str | None:
            for c in containers:
                if path.startswith(c + ".") if c else path:
                    rest = path[len(c) + 1 :] if c else path
                    return f"{c}.{rest.split('.')[0]}" if c else rest.split(".")[0]
            return None

        return blocks, block_of
    pattern = find_block_pattern(names)
    if pattern is None:
        return None
    found = block_set(pattern)
    assert found is not None
    return found, pattern.block_of


def detect(ctx: DetectorContext) -> list[Finding]:
    """The tiny-layer-wrap finding, or none."""
    ledgers = ctx.fsdp_ledgers()
    if not ledgers:
        return []
    lg = ledgers[0]
    model = captured(ctx)
    # unit names in the ledger -> module paths (FSDP1 names its units by position)
    path_of = model.trace_unit_paths() if model is not None else {}
    names = [path_of.get(n, n) for n in lg.unit_order]
    found = _blocks(ctx, names)
    if found is None:
        return []
    blocks, block_of = found
    sub_units: dict[str, set[str]] = defaultdict(set)
    for name in names:
        inst = block_of(name)
        if inst is not None and name != inst:
            sub_units[inst].add(name)
    split = {b: units for b, units in sub_units.items() if len(units) >= MIN_UNITS_PER_BLOCK}
    if not split:
        return []
    split_units = set().union(*split.values())
    recs = [r for r in lg.records if r.bytes > 0]  # sizes from the trace or the description
    split_recs = [r for r in recs if path_of.get(r.unit, r.unit) in split_units]
    if not recs or len(split_recs) < MIN_SPLIT_COLLECTIVE_SHARE * len(recs):
        return []
    fit = fit_alpha_beta([r for r in recs if r.family == GATHER_FAMILY]) or fit_alpha_beta(recs)
    if fit is None:
        return []
    median_bytes = statistics.median(r.bytes for r in split_recs)
    if median_bytes >= LATENCY_BOUND_RATIO * fit.half_bandwidth_bytes:
        return []

    # Merging: per step, all collectives of one block, family and pass become one.
    n_steps = max(1, len(lg.steps) or len({r.step for r in split_recs}))
    groups = {
        (r.step, block_of(path_of.get(r.unit, r.unit)), r.family, r.phase) for r in split_recs
    }
    saved = len(split_recs) - len(groups)
    total_us = sum(r.dur_us for r in split_recs)
    exposed_us = sum(r.exposed_us for r in split_recs)
    exposed_share = min(1.0, exposed_us / total_us) if total_us > 0 else 0.0
    # The per-collective overhead is measured at the step: the step time outside compute and
    # outside moving the step's bytes at the fitted bandwidth, per FSDP collective of the step
    # (collective latency, FSDP's per-unit hooks, copies and the waits between them all scale
    # with the number of units). Without step times: each split collective's median time beyond
    # moving its bytes.
    call_overhead_us = statistics.median(
        max(0.0, r.dur_us - r.bytes / fit.beta_bytes_per_us) for r in split_recs
    )
    step_overhead_us = _step_overhead_us(ctx, lg.rank, set(lg.steps), lg.records, fit)
    overhead_us = step_overhead_us if step_overhead_us is not None else call_overhead_us
    overhead_share = min(1.0, len(split_recs) * call_overhead_us / total_us) if total_us else 0.0
    gain_ms = saved * overhead_us * exposed_share / 1e3 / n_steps
    if step_overhead_us is not None:
        method = (
            f"measured per-collective overhead x collectives removed x exposed share: the "
            f"median step spends {overhead_us / 1e3:.2f} ms per FSDP collective outside compute "
            f"and outside moving its bytes at the fitted bandwidth "
            f"({fit.beta_bytes_per_us:.0f} B/us, latency-bandwidth fit to the fastest call per "
            f"size); merging each block's units removes {saved / n_steps:.0f} collectives per "
            f"step; {exposed_share:.0%} of their time is exposed"
        )
    else:
        method = (
            f"measured per-collective overhead x collectives removed x exposed share: each split "
            f"collective took a median {overhead_us:.0f} us beyond moving its bytes at the fitted "
            f"bandwidth ({fit.beta_bytes_per_us:.0f} B/us); merging each block's units removes "
            f"{saved / n_steps:.0f} collectives per step; {exposed_share:.0%} of their time is "
            "exposed"
        )
    per_block = statistics.mean(len(u) for u in split.values())
    example = sorted(split_units)[:4]
    fw = framework_of(ctx, lg.framework)
    remedy = fw.wrap_blocks(run_facts(ctx, fw, blocks, are_units=False), example)
    return [
        Finding(
            id="tiny-layer-wrap",
            severity="warning",
            title=(
                f"Each {blocks.describe()} block is split into {per_block:.0f} FSDP units: "
                f"{len(split_recs) / n_steps:.0f} latency-bound collectives per step"
            ),
            ranks=[lgr.rank for lgr in ledgers],
            steps=list(lg.steps),
            units=sorted(split_units),
            evidence={
                "repeated_block": blocks.describe(),
                "facts": blocks.source,
                "units": len(names),
                "units_per_block": round(per_block, 2),
                "collectives_per_step": round(len(split_recs) / n_steps, 2),
                "median_message_bytes": int(median_bytes),
                "half_bandwidth_bytes": int(fit.half_bandwidth_bytes),
                "flat_bandwidth_bytes": int(LATENCY_BOUND_RATIO * fit.half_bandwidth_bytes),
                "median_message_bandwidth_share": round(
                    median_bytes / fit.beta_bytes_per_us / fit.time_us(median_bytes), 3
                ),
                "alpha_us": round(fit.alpha_us, 2),
                "per_collective_overhead_us": round(overhead_us, 2),
                "call_overhead_us": round(call_overhead_us, 2),
                "beta_bytes_per_us": round(fit.beta_bytes_per_us, 2),
                "per_collective_overhead_share": round(overhead_share, 3),
                "exposed_share": round(exposed_share, 3),
                "collectives_saved_per_step": round(saved / n_steps, 2),
            },
            recommendation=(
                f"Make each {blocks.describe()} block one FSDP unit (and the root) instead of wrapping its "
                f"submodules: {per_block:.0f}x fewer, larger collectives per block, each closer to "
                "full bandwidth."
            ),
            code=remedy.code if remedy else None,
            expected_gain_ms=round(gain_ms, 3),
            gain_method=method,
        )
    ]


def _step_overhead_us(
    ctx: DetectorContext,
    rank: int,
    steps: set[int],
    records: list[CollectiveRecord],
    fit: AlphaBeta,
) -> float | None:
    """Median step time minus median compute minus the step's collective bytes at the fitted
    bandwidth, per FSDP collective of the step (us); None without step times or when nothing
    is left over."""
    rows = [b for b in ctx.breakdowns.get(rank, []) if not steps or b.step in steps]
    n_steps = len(rows)
    if not rows or not records:
        return None
    duration_ms = statistics.median(b.duration_ms for b in rows)
    compute_ms = statistics.median(b.compute_ms for b in rows)
    transfer_ms = sum(max(r.bytes, 0) for r in records) / fit.beta_bytes_per_us / 1e3 / n_steps
    left_us = (duration_ms - compute_ms - transfer_ms) * 1e3
    per_step = len(records) / n_steps
    return left_us / per_step if left_us > 0 and per_step > 0 else None
