"""`whole-model-wrap`: one FSDP unit holds (nearly) all parameters.

Then one all-gather of the whole model precedes forward compute (nothing can overlap it) and
the peak unsharded parameter memory is the whole model. Per-block `fully_shard` keeps one or
two blocks unsharded at a time and lets each block's gather overlap the previous block's compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..frameworks import BlockSet, RunFacts
from ..inputs.model_facts import ModelFacts
from ..rank.fsdp_ledger import GATHER_FAMILY, RankLedger
from ..report import Finding, FsdpUnit
from ..whatif.run_whatif import Change
from .blocks import find_block_pattern, harness_block_pattern
from .context import MIB, DetectorContext
from .facts import MODEL_SOURCE, block_set, wrap_candidates
from .replayed_gain import gain_text, replayed
from .rule import Rule, Threshold

# (the reasoning behind each value: RULE's thresholds, at the end of the module)
WHOLE_MODEL_SHARE = 0.9
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


@dataclass(frozen=True)
class _WholeUnit:
    """The unit holding (nearly) all gathered parameter bytes, on the first FSDP rank."""

    ledger: RankLedger
    unit: FsdpUnit
    units: int  # units with known bytes
    total_bytes: int
    share: float


def _whole_unit(ctx: DetectorContext) -> _WholeUnit | None:
    """Gating: the first FSDP rank's largest unit when it holds >= WHOLE_MODEL_SHARE of the
    gathered bytes, in a framework that wraps units, and the blocks are not units already."""
    ledgers = ctx.fsdp_ledgers()
    if not ledgers or not ctx.sheet.framework.wraps_units:
        return None  # e.g. ZeRO fetches each module's parameters itself: no wrap to choose
    lg = ledgers[0]
    units = [u for u in lg.units() if u.param_bytes]
    total = sum(u.param_bytes or 0 for u in units)
    if not units or total <= 0:
        return None  # unit bytes unknown: no share to judge (never read as 0)
    biggest = max(units, key=lambda u: u.param_bytes or 0)
    share = (biggest.param_bytes or 0) / total
    if share < WHOLE_MODEL_SHARE:
        return None
    if ctx.sheet.model is None and find_block_pattern(u.name for u in units) is not None:
        return None  # blocks are already units: a huge root is embeddings/head, not the model
    return _WholeUnit(lg, biggest, len(units), total, share)


def _facts(ctx: DetectorContext, lg: RankLedger) -> RunFacts:
    """The run's facts with the blocks to wrap: the description's, else inferred from the
    harness, the manifest's unit names or the most repeated module class."""
    block = None
    module_class = None
    if ctx.sheet.model is None:
        harness = dict(ctx.sheet.harness)
        block = harness_block_pattern(harness) or find_block_pattern(
            u.name for u in ctx.manifest_units()
        )
        module_class = None if block else ctx.module_class(lg.rank)
    source = "harness" if harness_block_pattern(dict(ctx.sheet.harness)) else "trace labels"
    return ctx.sheet.run_facts(blocks=block_set(block, module_class, source), are_units=False)


@dataclass(frozen=True)
class _BlockShare:
    """What the blocks hold, as shares of the model's parameter bytes: all of them (`fraction`),
    and the BLOCKS_UNSHARDED_AT_PEAK largest (`peak`: None when the per-block sizes are not
    known, the blocks then counted as equal); `source` says where it came from."""

    fraction: float | None
    source: str
    peak: float | None = None


def _block_sizes(model: ModelFacts) -> list[int]:
    """Each block's parameter bytes, largest first, from the description: a block's own tree node
    where the description keeps it, else its set's per-child extremes (the largest block at the
    max, the others at the min: exact for sets of two); [] when a set's sizes are unknown, and
    when the tree counts this rank's shards (FSDP1 with use_orig_params: its modules hold views
    of the local shard, split unevenly, so the model's bytes fall short of the flat parameters')."""
    desc = model.description
    if desc.fsdp1 and sum(i.flat_param_bytes for i in desc.fsdp1) != desc.param_bytes:
        return []
    nodes = {m.path: m.total_bytes for m in desc.modules}
    sizes: list[int] = []
    for cand in wrap_candidates(model):
        for rs in desc.repeated:
            if rs.path not in cand.containers or rs.child_class != cand.child_class:
                continue
            prefix = f"{rs.path}." if rs.path else ""
            own = [nodes[p] for p in (prefix + n for n in rs.child_names) if p in nodes]
            if len(own) == rs.count:
                sizes += own
            elif rs.bytes_per_child_max is not None and rs.bytes_per_child_min is not None:
                sizes += [rs.bytes_per_child_max] + [rs.bytes_per_child_min] * (rs.count - 1)
            else:
                return []
    return sorted(sizes, reverse=True)


def _block_share(
    model: ModelFacts | None, blocks: BlockSet | None, harness: dict[str, object]
) -> _BlockShare:
    """The blocks' share of the parameters: the description's wrap set (with its per-block
    sizes), else the harness's model shape (equal blocks), else unknown."""
    if model is not None and blocks is not None and blocks.source == MODEL_SOURCE:
        total = model.description.param_bytes
        block_bytes = sum(c.total_bytes or 0 for c in wrap_candidates(model))
        fraction = min(1.0, block_bytes / total) if block_bytes and total else None
        sizes = _block_sizes(model)
        peak = (
            min(1.0, sum(sizes[:BLOCKS_UNSHARDED_AT_PEAK]) / total)
            if sizes and total and fraction is not None
            else None
        )
        return _BlockShare(fraction, "block sizes from the captured model description", peak)
    fraction = _harness_block_fraction(harness) if harness else None
    return _BlockShare(fraction, "block share from the harness model shape")


def _memory_gain(
    whole_bytes: int, layers: int | None, reshard: bool, share: _BlockShare
) -> tuple[int | None, str]:
    """(bytes saved at the peak, how): the whole unit against root-only parameters plus the
    BLOCKS_UNSHARDED_AT_PEAK largest blocks (equal blocks when their sizes are unknown), under
    reshard-after-forward, as the remedy's per-block units do (FSDP's default); `reshard`
    False (the run keeps its units gathered after forward) is said in the method."""
    if not layers:
        return None, ""
    frac = share.fraction if share.fraction is not None else 1.0
    if share.peak is not None:
        at_peak = whole_bytes * share.peak
        blocks = (
            f"the {BLOCKS_UNSHARDED_AT_PEAK} largest of {layers} blocks ({share.source}: the "
            f"blocks hold {frac:.0%} of the parameters, the {BLOCKS_UNSHARDED_AT_PEAK} largest "
            f"{share.peak:.0%}, {at_peak / MIB:.2f} MiB)"
        )
    else:
        at_peak = BLOCKS_UNSHARDED_AT_PEAK * whole_bytes * frac / layers
        blocks = f"{BLOCKS_UNSHARDED_AT_PEAK} blocks of {layers} " + (
            f"({share.source}: {frac:.0%})"
            if share.fraction is not None
            else "(assuming the blocks hold nearly all parameters)"
        )
    new_peak = whole_bytes * (1 - frac) + at_peak
    method = (
        f"peak unsharded parameters now = the whole unit ({whole_bytes / MIB:.2f} MiB); per "
        f"block with reshard_after_forward=True and prefetch depth 1 = root-only parameters + "
        + blocks
    )
    if not reshard:
        method += (
            "; the run sets reshard_after_forward=False, and the code's blocks reshard (FSDP's "
            "default): with False kept on them, every block stays gathered until backward and "
            "nothing is saved"
        )
    return max(0, int(whole_bytes - new_peak)), method


def _time_gain(
    exposed_ms: float, layers: int | None, blocking: bool, block_fraction: float | None
) -> tuple[float | None, str]:
    """(ms per step, how): per block only the first block's gather (plus root-only
    parameters) stays exposed, every later one overlaps the previous block's compute; none
    where gathers block the training thread (CPU/gloo)."""
    if blocking:
        return None, (
            "step time not predicted: on CPU/gloo a gather blocks the training thread until it "
            "completes (FSDP2 overlaps it only with its private unshard async op, which this run "
            "does not set; FSDP1 never does), so per-block units hide none of the "
            f"{exposed_ms:.2f} ms/step of exposed gather time here, and they add blocking "
            "collectives whose fixed cost a one-unit run does not show; the gain is memory"
        )
    if not layers:
        return None, ""
    frac = block_fraction if block_fraction is not None else 1.0
    still_exposed = (1 - frac) + frac / layers
    return round(exposed_ms * (1 - still_exposed), 3), (
        f"measured exposed gather time of the whole-model unit ({exposed_ms:.2f} ms/step) x the "
        f"share that per-block prefetch would hide (all but the root-only parameters and the "
        f"first of {layers} blocks: {1 - still_exposed:.0%})"
    )


def _replayed_time_gain(
    ctx: DetectorContext, blocks: BlockSet | None
) -> tuple[float | None, str] | None:
    """(ms per step, how) from the replay of the per-block wrap (the unit split into the
    captured model's blocks: analyzers/whatif/finer_wrap.py); None without the captured blocks
    or a modelled step. Negative: the step gets slower (CPU/gloo, where every call blocks).
    A replay that cannot count the new units' hooks (a one-unit run does not show them) gives
    a lower bound on the step: a cost is then stated as "at least", with no figure (on the user
    zoo the costs measured were 2.4 to 24x the bound), and a gain as "at most"."""
    if blocks is None or blocks.source != MODEL_SOURCE or not all(blocks.containers):
        return None
    result = replayed(ctx, Change(wrap=",".join(blocks.containers)))
    if result is None:
        return None
    gain = round(result.gain_ms, 3)
    if not result.lower_bound:
        return gain, gain_text(result)
    if gain < 0:
        return None, (
            f"step time: at least {-gain:.2f} ms per step slower, not predicted: "
            + gain_text(result)
            + "; the blocks' backward re-gathers and extra calls block here, and their hooks "
            "and per-call latency are not counted (a one-unit run does not show them)"
        )
    return gain, gain_text(result) + "; at most: the new units' hooks are not counted"


def _recommendation(blocks: BlockSet | None, blocking: bool) -> str:
    return (
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
    )


def detect(ctx: DetectorContext) -> list[Finding]:
    """The whole-model-wrap finding, or none."""
    whole = _whole_unit(ctx)
    if whole is None:
        return []
    lg, biggest = whole.ledger, whole.unit
    facts = _facts(ctx, lg)
    blocks = facts.blocks
    if ctx.sheet.model is not None and facts.blocks_are_units:
        return []  # the description says each block already is a unit
    layers = blocks.count if blocks else None
    whole_bytes = biggest.param_bytes or 0
    share = _block_share(ctx.sheet.model, blocks, dict(ctx.sheet.harness))
    reshard = facts.settings.get("reshard_after_forward", True) is not False
    gain_bytes, method_bytes = _memory_gain(whole_bytes, layers, reshard, share)
    gathers = [r for r in lg.records if r.unit == biggest.name and r.family == GATHER_FAMILY]
    n_steps = max(1, len(lg.steps) or len({r.step for r in gathers}))
    exposed_ms = sum(r.exposed_us for r in gathers) / 1e3 / n_steps
    blocking = bool(layers) and not ctx.sheet.gathers_can_overlap(lg.device)
    gain_ms, method_ms = _replayed_time_gain(ctx, blocks) or _time_gain(
        exposed_ms, layers, blocking, share.fraction
    )
    remedy = ctx.sheet.framework.wrap_blocks(facts)
    ranks = [
        other.rank
        for other in ctx.fsdp_ledgers()
        if any(
            (u.param_bytes or 0) >= WHOLE_MODEL_SHARE * whole.total_bytes
            for u in other.units()
            if u.param_bytes
        )
    ]
    evidence = {
        "units": whole.units,
        "largest_unit": biggest.name or "(root)",
        "largest_unit_param_bytes": whole_bytes,
        "largest_unit_share": round(whole.share, 4),
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
                f"One FSDP unit ({biggest.name or 'the root'}) holds {whole.share:.0%} of the "
                f"parameters: the whole model ({whole_bytes / MIB:.2f} MiB) is gathered at once"
            ),
            ranks=ranks,
            steps=list(lg.steps),
            units=[biggest.name],
            evidence=evidence,
            recommendation=_recommendation(blocks, blocking),
            code=remedy.code if remedy else None,
            expected_gain_ms=gain_ms,
            expected_gain_bytes=gain_bytes,
            gain_method="; ".join(
                m for m in (method_ms, f"memory: {method_bytes}" if method_bytes else "") if m
            ),
        )
    ]


RULE = Rule(
    id="whole-model-wrap",
    summary="one FSDP unit holds (nearly) all parameters",
    detect=detect,
    what=(
        "One FSDP unit holds >= 90% of the gathered parameter bytes (sizes from the trace, "
        "else the model description; unknown bytes: silent) and the repeated blocks are not "
        "units of their own (from the description; without one, no `<list>.N` unit name: a "
        "huge embedding root beside wrapped blocks is not a whole-model wrap). Never for "
        "DeepSpeed ZeRO (no wrap to choose)."
    ),
    why=(
        "One all-gather of the whole model precedes forward compute (nothing can overlap it), "
        "and the peak unsharded parameter memory is the whole model. Per-block units keep one "
        "or two blocks unsharded at a time and let each block's gather overlap the previous "
        "block's compute."
    ),
    example=(
        "One FSDP unit (the root) holds 100% of the parameters: the whole model (48.13 MiB) is "
        "gathered at once (`fully_shard(model)` alone)."
    ),
    fix=(
        "Each repeated block its own unit, then the root, in the run's framework: the "
        "description's wrap set (FSDP2 `fully_shard` loop over the user's containers, FSDP1 "
        "`ModuleWrapPolicy({Class, ...})`); without a description the container found from "
        "unit names / manifest / harness, or an `isinstance` loop over the outermost repeated "
        "module class of a `with_stack` trace, never a leaf layer."
    ),
    gain=(
        "Bytes: whole unit minus (root-only parameters + the 2 largest blocks) under "
        "reshard-after-forward, the block sizes from the description (else equal blocks, their "
        "share from the harness's shape, else ~all). ms: with the captured blocks, replayed "
        "(`zdiag whatif --wrap <containers>`: the unit split into one unit per block, each "
        "gathered in forward and again in backward and reduced on its own). A one-unit run "
        "does not show a unit's hooks, so the replayed step is a lower bound: a gain is 'at "
        "most', and where every call blocks (CPU/gloo without FSDP2's unshard async op, FSDP1 "
        "on CPU) the cost is stated as 'at least N ms' with no figure (measured on the user zoo: "
        "2.4 to 24x the bound). Without the captured blocks, the unit's measured exposed gather "
        "time x the share per-block prefetch would hide (all but the root-only parameters and "
        "the first block), and none where gathers cannot overlap."
    ),
    scope="FSDP2 and FSDP1 runs (not ZeRO, which has no wrap to choose)",
    fsdp_only=True,
    thresholds=(
        Threshold(
            "WHOLE_MODEL_SHARE",
            WHOLE_MODEL_SHARE,
            "A unit holding this share of the gathered parameter bytes is the whole model. "
            "Per-block wrapping of any model with >= 2 blocks leaves the largest unit well "
            "below it: a block of an L-block model holds <= 1/L of the block parameters, and "
            "the root (embeddings, head) of common LLMs holds < 40% even with a large "
            "vocabulary; 90% leaves room for a few small side units next to an otherwise "
            "whole-model unit.",
            evidence="threshold_share",
        ),
        Threshold(
            "BLOCKS_UNSHARDED_AT_PEAK",
            BLOCKS_UNSHARDED_AT_PEAK,
            "Prefetch depth 1 keeps the current and the next block unsharded: 2 blocks at the "
            "peak of a per-block wrap (the memory gain's arithmetic).",
        ),
    ),
    markers=("all_gather",),
)
