"""`tiny-layer-wrap`: many small FSDP units inside each repeated block, collectives latency-bound.

Wrapping every Linear/norm splits each block's parameters over several all-gathers and
reduce-scatters. When those messages are below the size where the measured bandwidth flattens
(alpha x beta of the fitted latency-bandwidth model), most of each collective is fixed
per-collective overhead; one unit per block pays that overhead once per block and pass.

The latency judgement is fitted over every FSDP rank's executions of the split units' own
collectives (the messages judged, at the sizes they have: a line through every unit, the root's
and the head's included, bends with whatever those few executions met) and bootstrapped: a
judgement that fewer than DECIDE_SHARE of the resamples support is reported as undecided, in
one `info` finding, instead of a verdict the next run of the same script could flip.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..frameworks import BlockSet
from ..frameworks.base import attribute_path
from ..rank.fsdp_ledger import GATHER_FAMILY, CollectiveRecord, RankLedger
from ..report import Finding
from ..whatif.run_whatif import Change
from .blocks import find_block_pattern
from .comm_model import RESAMPLES, AlphaBeta, SizeJudgement, judge_below_flat
from .context import DetectorContext
from .facts import block_set, model_block_set
from .replayed_gain import gain_text, replayed
from .rule import Rule, Threshold

# (the reasoning behind each value: RULE's thresholds, at the end of the module)
MIN_UNITS_PER_BLOCK = 2
FLAT_BANDWIDTH_SHARE = 0.8
LATENCY_BOUND_RATIO = FLAT_BANDWIDTH_SHARE / (1 - FLAT_BANDWIDTH_SHARE)  # x alpha x beta
MIN_SPLIT_COLLECTIVE_SHARE = 0.5
DECIDE_SHARE = 0.9
MIN_SIZES_TO_CLEAR = 3


def _blocks(
    ctx: DetectorContext, names: list[str]
) -> tuple[BlockSet, Callable[[str], str | None]] | None:
    """The repeated blocks and a function giving the block a unit path lies in: from the
    captured model description (its wrap set, by the user's container paths), else from the
    `<list>.<N>` pattern of the unit names."""
    model = ctx.sheet.model
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


def _fit_records(
    ctx: DetectorContext, path_of: dict[str, str], split_units: set[str]
) -> list[CollectiveRecord]:
    """The executions the latency judgement is fitted to, pooled over every FSDP rank: the
    split units' own gathers, else all their collectives when those hold more sizes. Other
    units (the root, a head) run a few times per step at sizes of their own: their fastest
    execution is a poor envelope point, and a line through it judges messages it is not."""
    split = [
        r
        for lg in ctx.fsdp_ledgers()
        for r in lg.records
        if r.bytes > 0 and path_of.get(r.unit, r.unit) in split_units
    ]
    gathers = [r for r in split if r.family == GATHER_FAMILY]
    if len({r.bytes for r in gathers}) >= 2 or len({r.bytes for r in split}) < 2:
        return gathers or split
    return split


@dataclass(frozen=True)
class _Split:
    """Blocks split into several units on the first FSDP rank, with the collectives they issue
    and the latency judgement of their median message."""

    ledger: RankLedger
    names: list[str]  # the ledger's unit names as module paths
    blocks: BlockSet
    block_of: Callable[[str], str | None]
    split: dict[str, set[str]]  # block -> its units
    path_of: dict[str, str]
    records: list[CollectiveRecord]  # the split units' collectives (known sizes)
    judgement: SizeJudgement

    @property
    def units(self) -> set[str]:
        return set().union(*self.split.values())

    @property
    def fit(self) -> AlphaBeta:
        return self.judgement.fit

    @property
    def median_bytes(self) -> float:
        return self.judgement.message_bytes

    @property
    def decided(self) -> bool:
        """Whether the resamples support "latency-bound" firmly (else: undecided)."""
        share = self.judgement.below_share
        return share is not None and share >= DECIDE_SHARE


def _split_blocks(ctx: DetectorContext) -> _Split | None:
    """Gating: blocks split into >= MIN_UNITS_PER_BLOCK units that carry >= MIN_SPLIT_
    COLLECTIVE_SHARE of the collectives, whose median message is not firmly bandwidth-bound
    (latency-bound in <= 1 - DECIDE_SHARE of the resamples, on at least MIN_SIZES_TO_CLEAR
    message sizes: a line through two sizes cannot clear a split wrap, only leave it
    undecided)."""
    ledgers = ctx.fsdp_ledgers()
    if not ledgers:
        return None
    lg = ledgers[0]
    model = ctx.sheet.model
    # unit names in the ledger -> module paths (FSDP1 names its units by position)
    path_of = model.trace_unit_paths() if model is not None else {}
    names = [path_of.get(n, n) for n in lg.unit_order]
    found = _blocks(ctx, names)
    if found is None:
        return None
    blocks, block_of = found
    sub_units: dict[str, set[str]] = defaultdict(set)
    for name in names:
        inst = block_of(name)
        if inst is not None and name != inst:
            sub_units[inst].add(name)
    split = {b: units for b, units in sub_units.items() if len(units) >= MIN_UNITS_PER_BLOCK}
    if not split:
        return None
    split_units = set().union(*split.values())
    recs = [r for r in lg.records if r.bytes > 0]  # sizes from the trace or the description
    split_recs = [r for r in recs if path_of.get(r.unit, r.unit) in split_units]
    if not recs or len(split_recs) < MIN_SPLIT_COLLECTIVE_SHARE * len(recs):
        return None
    median_bytes = statistics.median(r.bytes for r in split_recs)
    judgement = judge_below_flat(
        _fit_records(ctx, path_of, split_units), median_bytes, LATENCY_BOUND_RATIO
    )
    if judgement is None:
        return None
    share = judgement.below_share
    if (
        share is not None
        and share <= 1 - DECIDE_SHARE
        and judgement.fit.sizes >= MIN_SIZES_TO_CLEAR
    ):
        return None  # firmly bandwidth-bound, on enough message sizes to trust the intercept
    return _Split(lg, names, blocks, block_of, split, path_of, split_recs, judgement)


@dataclass(frozen=True)
class _Gain:
    """What merging each block's units saves per step, and how it was measured."""

    ms: float
    method: str
    saved: int  # collectives removed over the window
    n_steps: int
    exposed_share: float
    overhead_us: float
    call_overhead_us: float
    overhead_share: float


def _gain(ctx: DetectorContext, sp: _Split) -> _Gain:
    """Measured per-collective overhead x collectives removed x exposed share. Merging: per
    step, all collectives of one block, family and pass become one."""
    lg, split_recs, fit = sp.ledger, sp.records, sp.fit
    n_steps = max(1, len(lg.steps) or len({r.step for r in split_recs}))
    groups = {
        (r.step, sp.block_of(sp.path_of.get(r.unit, r.unit)), r.family, r.phase) for r in split_recs
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
    ms = saved * overhead_us * exposed_share / 1e3 / n_steps
    return _Gain(
        ms, method, saved, n_steps, exposed_share, overhead_us, call_overhead_us, overhead_share
    )


def _evidence(sp: _Split, g: _Gain, per_block: float) -> dict[str, object]:
    fit, n_steps, j = sp.fit, g.n_steps, sp.judgement
    return {
        "judgement": "latency-bound" if sp.decided else "undecided",
        "latency_bound_confidence": (
            round(j.below_share, 3) if j.below_share is not None else None
        ),
        "threshold_decide_share": DECIDE_SHARE,
        "threshold_min_sizes_to_clear": MIN_SIZES_TO_CLEAR,
        "repeated_block": sp.blocks.describe(),
        "facts": sp.blocks.source,
        "units": len(sp.names),
        "units_per_block": round(per_block, 2),
        "collectives_per_step": round(len(sp.records) / n_steps, 2),
        "median_message_bytes": int(sp.median_bytes),
        "half_bandwidth_bytes": int(fit.half_bandwidth_bytes),
        "flat_bandwidth_bytes": int(LATENCY_BOUND_RATIO * fit.half_bandwidth_bytes),
        "median_message_bandwidth_share": round(
            sp.median_bytes / fit.beta_bytes_per_us / fit.time_us(sp.median_bytes), 3
        ),
        "alpha_us": round(fit.alpha_us, 2),
        "per_collective_overhead_us": round(g.overhead_us, 2),
        "call_overhead_us": round(g.call_overhead_us, 2),
        "beta_bytes_per_us": round(fit.beta_bytes_per_us, 2),
        "per_collective_overhead_share": round(g.overhead_share, 3),
        "exposed_share": round(g.exposed_share, 3),
        "collectives_saved_per_step": round(g.saved / n_steps, 2),
        "flat_bandwidth_bytes_range": [int(j.flat_low_bytes), int(j.flat_high_bytes)],
        "fit_executions": j.executions,
        "fit_sizes": fit.sizes,
    }


def _wrap_prefix(sp: _Split) -> str | None:
    """The modules whose children the fix makes units, as `zdiag whatif --wrap` takes them
    (comma-separated), from the split blocks' paths; None when a block path has no parent."""
    parents = set()
    for block in sp.split:
        if "." not in block:
            return None
        parents.add(block.rsplit(".", 1)[0])
    return ",".join(sorted(parents)) or None


def _replayed_gain(ctx: DetectorContext, sp: _Split, g: _Gain) -> _Gain:
    """`g` with the replayed gain of the fix (each block one unit, `zdiag whatif --wrap`)
    where the step models allow, else `g` as measured."""
    prefix = _wrap_prefix(sp)
    result = replayed(ctx, Change(wrap=prefix)) if prefix else None
    if result is None:
        return g
    return replace(g, ms=max(0.0, result.gain_ms), method=gain_text(result))


def detect(ctx: DetectorContext) -> list[Finding]:
    """The tiny-layer-wrap finding, or none."""
    sp = _split_blocks(ctx)
    if sp is None:
        return []
    g = _replayed_gain(ctx, sp, _gain(ctx, sp))
    per_block = statistics.mean(len(u) for u in sp.split.values())
    split_units = sp.units
    example = [attribute_path(u) for u in sorted(split_units)[:4]]  # as the code spells them
    fw = ctx.sheet.framework
    remedy = fw.wrap_blocks(ctx.sheet.run_facts(fw, sp.blocks, are_units=False), example)
    what = sp.blocks.describe()
    title, recommendation = _words(sp, what, per_block, len(sp.records) / g.n_steps)
    return [
        Finding(
            id="tiny-layer-wrap",
            severity="warning" if sp.decided else "info",
            title=title,
            ranks=[lgr.rank for lgr in ctx.fsdp_ledgers()],
            steps=list(sp.ledger.steps),
            units=sorted(split_units),
            evidence=_evidence(sp, g, per_block),
            recommendation=recommendation,
            code=remedy.code if remedy else None,
            expected_gain_ms=round(g.ms, 3),
            gain_method=g.method,
        )
    ]


def _words(sp: _Split, what: str, per_block: float, per_step: float) -> tuple[str, str]:
    """(title, recommendation): the verdict when the resamples support it, else what the
    timings leave open (one finding either way)."""
    fix = (
        f"Make each {what} block one FSDP unit (and the root) instead of wrapping its "
        f"submodules: {per_block:.0f}x fewer, larger collectives per block"
    )
    if sp.decided:
        return (
            f"Each {what} block is split into {per_block:.0f} FSDP units: "
            f"{per_step:.0f} latency-bound collectives per step",
            f"{fix}, each closer to full bandwidth.",
        )
    j = sp.judgement
    why = (
        "the collectives come in one message size, which cannot separate the per-collective "
        "latency from the bandwidth."
        if j.below_share is None
        else (
            f"fitted through {j.fit.sizes} message sizes, the per-collective latency is the "
            "intercept of a line that a busy host moves between runs of the same script: "
            f"{j.below_share:.0%} of the resamples call their median message of "
            f"{_kb(sp.median_bytes)} latency-bound in this run. Re-profile with more "
            "distinct unit sizes, or compare a run wrapped per block."
        )
        if j.fit.sizes < MIN_SIZES_TO_CLEAR and j.below_share <= 1 - DECIDE_SHARE
        else (
            f"the size where their bandwidth flattens lies between {_kb(j.flat_low_bytes)} and "
            f"{_kb(j.flat_high_bytes)} (90% of {RESAMPLES} resamples of the fastest execution "
            f"per size), around their median message of {_kb(sp.median_bytes)}; "
            f"{j.below_share:.0%} of the resamples call it latency-bound. Profiling more steps "
            "narrows it."
        )
    )
    return (
        f"Each {what} block is split into {per_block:.0f} FSDP units ({per_step:.0f} "
        "collectives per step): too little timing evidence to call them latency-bound",
        f"{fix}. Whether their per-collective overhead is what costs time the timings do not "
        f"decide: {why}",
    )


def _kb(nbytes: float) -> str:
    return f"{nbytes / 1024:.0f} KiB" if nbytes < 1024**2 else f"{nbytes / 1024**2:.1f} MiB"


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


RULE = Rule(
    id="tiny-layer-wrap",
    summary="repeated blocks split into many small FSDP units: latency-bound collectives",
    detect=detect,
    what=(
        "Each repeated block (the description's wrap set; else `<list>.N` unit names) is split "
        "into >= 2 units, those carry >= half the collectives, and the median message is below "
        "where the fitted bandwidth curve flattens (80% of peak, `4 x alpha x beta`: over 20% "
        "of each collective is fixed overhead). That size is fitted to the split units' own "
        "collectives over every FSDP rank and bootstrapped: below it in >= 90% of the "
        "resamples is a warning; in <= 10% the rule stays quiet; in between (or with one "
        "message size) one `info` finding says the timings cannot decide. FSDP1 units are "
        "mapped to their module paths through the description."
    ),
    why=(
        "Wrapping every Linear/norm splits each block's parameters over several all-gathers "
        "and reduce-scatters; below the size where bandwidth flattens most of each collective "
        "is fixed per-collective overhead, which one unit per block pays once per block and "
        "pass."
    ),
    example=(
        "Each model.encoder.stages[N] block is split into 4 FSDP units: 96 latency-bound "
        "collectives per step (an FSDP1 `ModuleWrapPolicy({nn.Linear})`)."
    ),
    fix="One unit per block (the framework's wrap code, naming what is wrapped today).",
    gain=(
        "Measured per-collective overhead x collectives removed per step x measured exposed "
        "share. The overhead is measured at the step: median step time minus median compute "
        "minus the step's collective bytes at the fitted bandwidth, per FSDP collective of the "
        "step (collective latency, FSDP's per-unit hooks, copies and the waits between them all "
        "scale with the number of units); without step times, each split collective's median "
        "time beyond its bytes at the fitted bandwidth. The first version used the fit's alpha "
        "(the fastest call of each size) and predicted 7 ms where merging saved ~90 ms. On the "
        "user zoo's 10 leaf-wrap cases (2 ranks, gloo, the shared 2-core box; measured = "
        "leaf-wrap minus healthy median step time, one run each, not interleaved) the "
        "prediction is within a factor of 2 of the measured change in 7 of 10 (misses: "
        "`tabular_fsdp1` measured -8 ms, `trunk_fsdp2` 65 predicted vs 23, `recsys_fsdp2` 108 "
        "vs 10); the fix-verification benchmark (median of interleaved runs) is the real check."
    ),
    scope="FSDP2 and FSDP1 runs whose unit names or model description show repeated blocks",
    fsdp_only=True,
    thresholds=(
        Threshold(
            "MIN_UNITS_PER_BLOCK",
            MIN_UNITS_PER_BLOCK,
            "A block split into this many units or more is finer than the block: the block "
            "itself is the natural unit (its parameters are needed together, by one forward "
            "call).",
        ),
        Threshold(
            "FLAT_BANDWIDTH_SHARE",
            FLAT_BANDWIDTH_SHARE,
            "Latency-bound: a message of s bytes reaches s / (alpha + s / beta) of the peak "
            "bandwidth beta; 'flattened' is this share of peak, reached at s = 4 x alpha x beta "
            "(the evidence's flat_bandwidth_bytes). Below it, over 20% of each collective is "
            "fixed overhead, and merging the k units of a block removes (k - 1) / k of it.",
        ),
        Threshold(
            "MIN_SPLIT_COLLECTIVE_SHARE",
            MIN_SPLIT_COLLECTIVE_SHARE,
            "Split blocks must carry this share of the collectives (not one odd side module).",
        ),
        Threshold(
            "DECIDE_SHARE",
            DECIDE_SHARE,
            "The fit rests on the fastest execution per size, which a few slow executions "
            "move: the median message is called latency-bound only when this share of "
            f"{RESAMPLES} bootstrap resamples puts it below the flat size, and bandwidth-bound "
            "(quiet) only when 1 - this share or fewer do. Between the two the finding says "
            "the evidence cannot decide, rather than a verdict the next run could flip "
            "(runs of one per-Linear Llama script gave latency terms of 0 to 105 us from "
            "rank 0's fit over every unit size; over ten runs the split units' own sizes on both "
            "ranks gave 82-262 us, latency-bound in 98-100% of the resamples).",
            evidence="threshold_decide_share",
        ),
        Threshold(
            "MIN_SIZES_TO_CLEAR",
            MIN_SIZES_TO_CLEAR,
            "A latency term fitted through two message sizes is their line's intercept, which "
            "a loaded host moves from 0 to hundreds of microseconds between runs of one script "
            "(the user zoo's tabular_fsdp1 leaf wrap: 0.88 of the resamples latency-bound in "
            "one run, 0.0 in the next, 228 us with the old fit). Such a fit can make a split "
            "wrap a warning, never clear it: with fewer sizes than this a 'bandwidth-bound' "
            "answer is reported as undecided.",
            evidence="threshold_min_sizes_to_clear",
        ),
    ),
    markers=("all_gather",),
)
