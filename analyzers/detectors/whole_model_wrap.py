"""`whole-model-wrap`: one FSDP unit holds (nearly) all parameters.

Then one all-gather of the whole model precedes forward compute (nothing can overlap it) and
the peak unsharded parameter memory is the whole model. Per-block `fully_shard` keeps one or
two blocks unsharded at a time and lets each block's gather overlap the previous block's compute.
"""

from __future__ import annotations

from ..rank.fsdp_ledger import GATHER_FAMILY
from ..report import Finding
from .blocks import find_block_pattern, harness_block_pattern
from .context import MIB, DetectorContext
from .facts import (
    MODEL_SOURCE,
    block_set,
    captured,
    framework_of,
    gathers_can_overlap,
    run_facts,
    wrap_candidates,
)

# A unit holding >= 90% of the gathered parameter bytes is "the whole model". Per-block
# wrapping of any model with >= 2 blocks leaves the largest unit well below that: a block of an
# L-block model holds <= 1/L of the block parameters, and the root (embeddings, head) of common
# LLMs holds < 40% even with a large vocabulary. 90% leaves room for a few small side units
# (e.g. a separately wrapped embedding) next to an otherwise whole-model unit.
WHOLE_MODEL_SHARE = 0.9
# Prefetch depth 1 keeps the current and the next block unsharded: 2 blocks at the peak.
BLOCKS_UNSHARDED_AT_PEAK = 2


def _harness_block_fraction(harness: dict[str, object]) -> float | None:
    """Share of parameters in the blocks of zdiag's harness model (from its recorded shape)."""
    try:
        layers = int(harness["layers"])  # type: ignore[call-overload]
        dim = int(harness["dim"])  # type: ignore[call-overload]
        vocab = int(harness["vocab"])  # type: ignore[call-overload]
    except (KeyError, TypeError, ValueError):
        return None
    hidden = 64 * ((int(8 * dim / 3) + 63) // 64)
    block = 4 * dim * dim + 3 * dim * hidden + 2 * dim
    other = 2 * vocab * dim + dim
    return layers * block / (layers * block + other)


def detect(ctx: DetectorContext) -> list[Finding]:
    """The whole-model-wrap finding, or none."""
    ledgers = ctx.fsdp_ledgers()
    if not ledgers:
        return []
    lg = ledgers[0]
    fw = framework_of(ctx, lg.framework)
    if not fw.wraps_units:
        return []  # e.g. ZeRO fetches each module's parameters itself: there is no wrap to choose
    units = [u for u in lg.units() if u.param_bytes]
    total = sum(u.param_bytes or 0 for u in units)
    if not units or total <= 0:
        return []  # unit bytes unknown: no share to judge (never read as 0)
    biggest = max(units, key=lambda u: u.param_bytes or 0)
    share = (biggest.param_bytes or 0) / total
    if share < WHOLE_MODEL_SHARE:
        return []
    model = captured(ctx)
    if model is None and find_block_pattern(u.name for u in units) is not None:
        return []  # blocks are already units: a huge root is embeddings/head, not the model

    block = None
    module_class = None
    if model is None:
        block = harness_block_pattern(ctx.harness) or find_block_pattern(
            u.name for u in ctx.manifest_units()
        )
        module_class = None if block else ctx.module_class(lg.rank)
    inferred = block_set(
        block, module_class, "harness" if harness_block_pattern(ctx.harness) else "trace labels"
    )
    facts = run_facts(ctx, fw, inferred, are_units=False)
    blocks = facts.blocks
    if model is not None and facts.blocks_are_units:
        return []  # the description says each block already is a unit
    layers = blocks.count if blocks else None
    whole_bytes = biggest.param_bytes or 0
    if model is not None and blocks is not None and blocks.source == MODEL_SOURCE:
        cands = wrap_candidates(model)
        block_bytes = sum(c.total_bytes or 0 for c in cands)
        block_fraction: float | None = (
            min(1.0, block_bytes / model.description.param_bytes)
            if block_bytes and model.description.param_bytes
            else None
        )
        fraction_source = "block share from the captured model description"
    else:
        block_fraction = _harness_block_fraction(ctx.harness) if ctx.harness else None
        fraction_source = "block share from the harness model shape"
    reshard = facts.settings.get("reshard_after_forward", True) is not False
    gain_bytes: int | None = None
    method_bytes = ""
    if layers and reshard:
        frac = block_fraction if block_fraction is not None else 1.0
        per_block = whole_bytes * frac / layers
        new_peak = whole_bytes * (1 - frac) + BLOCKS_UNSHARDED_AT_PEAK * per_block
        gain_bytes = max(0, int(whole_bytes - new_peak))
        method_bytes = (
            f"peak unsharded parameters now = the whole unit ({whole_bytes / MIB:.2f} MiB); per "
            f"block with reshard_after_forward=True and prefetch depth 1 = root-only parameters + "
            f"{BLOCKS_UNSHARDED_AT_PEAK} blocks of {layers} "
            + (
                f"({fraction_source}: {frac:.0%})"
                if block_fraction is not None
                else "(assuming the blocks hold nearly all parameters)"
            )
        )
    gathers = [r for r in lg.records if r.unit == biggest.name and r.family == GATHER_FAMILY]
    n_steps = max(1, len(lg.steps) or len({r.step for r in gathers}))
    exposed_ms = sum(r.exposed_us for r in gathers) / 1e3 / n_steps
    # Per block, only the first block's gather (plus root-only parameters) stays exposed:
    # every later block's gather overlaps the previous block's compute.
    gain_ms = None
    method_ms = ""
    blocking = bool(layers) and not gathers_can_overlap(ctx, lg.device)
    if blocking:
        method_ms = (
            "step time not predicted: on CPU/gloo a gather blocks the training thread until it "
            "completes (FSDP2 overlaps it only with its private unshard async op, which this run "
            "does not set; FSDP1 never does), so per-block units hide none of the "
            f"{exposed_ms:.2f} ms/step of exposed gather time here, and they add blocking "
            "collectives whose fixed cost a one-unit run does not show; the gain is memory"
        )
    elif layers:
        frac = block_fraction if block_fraction is not None else 1.0
        still_exposed = (1 - frac) + frac / layers
        gain_ms = round(exposed_ms * (1 - still_exposed), 3)
        method_ms = (
            f"measured exposed gather time of the whole-model unit ({exposed_ms:.2f} ms/step) x the "
            f"share that per-block prefetch would hide (all but the root-only parameters and the "
            f"first of {layers} blocks: {1 - still_exposed:.0%})"
        )
    remedy = fw.wrap_blocks(facts)
    ranks = [
        other.rank
        for other in ledgers
        if any(
            (u.param_bytes or 0) >= WHOLE_MODEL_SHARE * total
            for u in other.units()
            if u.param_bytes
        )
    ]
    evidence = {
        "units": len(units),
        "largest_unit": biggest.name or "(root)",
        "largest_unit_param_bytes": whole_bytes,
        "largest_unit_share": round(share, 4),
        "threshold_share": WHOLE_MODEL_SHARE,
        "gathers_per_step": round(len(gathers) / n_steps, 2),
        "exposed_gather_ms_per_step": round(exposed_ms, 3),
        "peak_unsharded_param_bytes": whole_bytes,
        "repeated_block": blocks.describe() if blocks else None,
        "facts": blocks.source if blocks else "trace labels",
    }
    return [
        Finding(
            id="whole-model-wrap",
            severity="warning",
            title=(
                f"One FSDP unit ({biggest.name or 'the root'}) holds {share:.0%} of the parameters: "
                f"the whole model ({whole_bytes / MIB:.2f} MiB) is gathered at once"
            ),
            ranks=ranks,
            steps=list(lg.steps),
            units=[biggest.name],
            evidence=evidence,
            recommendation=(
                "Shard each repeated block ("
                + (blocks.describe() if blocks else "each transformer block")
                + ") "
                "as its own FSDP unit, then the root: only a block or two is unsharded at a time and "
                "each block's all-gather overlaps the previous block's compute."
                + (
                    " On this CPU/gloo run expect the step to get slower, not faster: each block "
                    "adds blocking collectives (gathered again in backward, reduced on its own) "
                    "and none of them overlaps here. The change pays in peak memory here, and in "
                    "step time on GPUs."
                    if blocking
                    else ""
                )
            ),
            code=remedy.code if remedy else None,
            expected_gain_ms=gain_ms,
            expected_gain_bytes=gain_bytes,
            gain_method="; ".join(
                m for m in (method_ms, f"memory: {method_bytes}" if method_bytes else "") if m
            ),
        )
    ]
