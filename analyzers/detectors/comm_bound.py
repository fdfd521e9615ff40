"""`comm-bound`: steps where communication alone is longer than compute.

Overlap can hide communication only up to the compute it runs under; when comm > compute the
step is comm-bound whatever the prefetch settings. What helps then: fewer bytes (bf16 gathers),
more compute per byte (a bigger batch per rank), or cheaper links (HSDP on multi-node jobs whose
FSDP still shards across nodes).

The expected gain is replayed where a remedy it names can be: bf16 parameter gathers (not on a
CPU-only run, whose math would change too) and the HSDP shape (multi-node runs), each on top of
the prefetch `missing-overlap` replays, so the gain is what the remedy saves beyond what
prefetch recovers. Otherwise it is the upper bound: the comm time in excess of compute.

On a run with a tensor-parallel dimension, the step verdicts count the TP collectives too: those
are not FSDP traffic (no FSDP setting changes them), so each step is judged again on the FSDP
collectives alone (the ledger's), with the same verdict rule (rank/verdict.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..rank import intervals
from ..rank.fsdp_ledger import RankLedger
from ..rank.verdict import COMM_BOUND_STEP_SHARE, decide
from ..report import Finding, StepBreakdown
from ..whatif.run_whatif import Change
from .context import DetectorContext
from .flat_sharding import hsdp_change, shards_across_nodes
from .fp32_collectives import bf16_remedy, is_fp32
from .replayed_gain import prefetch_change, replayed
from .rule import Rule, Threshold

NO_OVERLAP_FIX = (
    "No prefetch or overlap setting can fix this: communication is longer than the compute it "
    "could hide under."
)
"""The recommendation's first sentence; the reconcile step rewrites it when `missing-overlap`
claims part of the same time (detectors/reconcile.py)."""

# (the reasoning behind the value: RULE's thresholds, at the end of the module; it lives with
# the step verdicts so the live monitor reads it without loading the detectors)


def fsdp_only_steps(lg: RankLedger, bds: list[StepBreakdown]) -> list[StepBreakdown]:
    """The rank's steps with communication = its FSDP collectives alone (their union; exposed:
    their exposed time) and the verdict decided again on those numbers."""
    out = []
    for b in bds:
        recs = [r for r in lg.records if r.step == b.step]
        starts = np.array([r.start_us for r in recs], dtype=np.float64)
        ends = np.array([r.end_us for r in recs], dtype=np.float64)
        comm = intervals.total(intervals.union(starts, ends)) / 1e3
        exposed = min(comm, sum(r.exposed_us for r in recs) / 1e3)
        verdict, reason = decide(b.duration_ms, b.compute_ms, comm, exposed, b.idle_ms)
        out.append(
            StepBreakdown(
                step=b.step,
                duration_ms=b.duration_ms,
                compute_ms=b.compute_ms,
                comm_ms=comm,
                overlapped_ms=comm - exposed,
                exposed_comm_ms=exposed,
                idle_ms=b.idle_ms,
                verdict=verdict,
                verdict_reason=reason,
            )
        )
    return out


UPPER_BOUND = (
    "upper bound: the comm time in excess of compute per step, which only fewer bytes or more "
    "compute per step can remove"
)


def _remedies(ctx: DetectorContext, bf16: bool) -> list[tuple[str, Change]]:
    """The remedies the replay can run on this run, each as (its name, its change)."""
    out = []
    if bf16 and not ctx.sheet.cpu_only:
        out.append(("bf16 parameter gathers", Change(bf16_params=True)))
    hsdp = hsdp_change(ctx)
    if hsdp is not None:
        out.append(("HSDP", hsdp))
    return out


def replayed_gain(ctx: DetectorContext, bf16: bool) -> tuple[float, str] | None:
    """(ms per step, how) of the best remedy the replay can run (`_remedies`), each replayed on
    top of `missing-overlap`'s prefetch change against that change alone (what the remedy saves
    beyond what prefetch recovers; against the measured step where prefetch recovers nothing).
    None when no remedy can be replayed on this run."""
    base_change = prefetch_change(ctx)
    base = replayed(ctx, base_change)
    if base is None or not base.ranks or base.gain_ms <= 0:
        base_change, base = Change(), None  # prefetch recovers nothing: the measured step
    best: tuple[float, str] | None = None
    for name, remedy in _remedies(ctx, bf16):
        both = replayed(
            ctx,
            dataclasses.replace(
                remedy,
                prefetch=base_change.prefetch,
                unshard_async_op=base_change.unshard_async_op,
            ),
        )
        if both is None or not both.ranks:
            continue
        before = base.predicted_ms if base is not None else both.measured_ms
        gain = before - both.predicted_ms
        how = (
            f"replayed: {name} (zdiag whatif {both.change.label()}) against "
            + (f"{base_change.label()} alone" if base is not None else "the measured step")
            + f", {before:.1f} -> {both.predicted_ms:.1f} ms, median over {len(both.ranks)} "
            f"rank(s); {both.platform.reason}"
        )
        if best is None or gain > best[0]:
            best = (gain, how)
    return best


def detect(ctx: DetectorContext) -> list[Finding]:
    """The comm-bound finding, or none (only for runs with FSDP/ZeRO traffic; on a run with a
    tensor-parallel dimension, judged on the FSDP collectives alone)."""
    ledgers = ctx.fsdp_ledgers()
    if not ledgers:
        return []
    fsdp_only = ctx.tensor_parallel
    by_rank = {lg.rank: lg for lg in ledgers}
    fsdp_ranks = set(by_rank)
    ranks: list[int] = []
    steps: set[int] = set()
    comm = compute = hit_comm = hit_compute = 0.0
    n = bound = 0
    for rank, bds in sorted(ctx.breakdowns.items()):
        if rank not in fsdp_ranks:
            continue
        if fsdp_only:
            bds = fsdp_only_steps(by_rank[rank], bds)
        hit = [b for b in bds if b.verdict == "comm-bound"]
        n += len(bds)
        bound += len(hit)
        if hit:
            ranks.append(rank)
            steps.update(b.step for b in hit)
        comm += sum(b.comm_ms for b in bds)
        compute += sum(b.compute_ms for b in bds)
        hit_comm += sum(b.comm_ms for b in hit)
        hit_compute += sum(b.compute_ms for b in hit)
    if not n or bound / n < COMM_BOUND_STEP_SHARE:
        return []
    fp32 = any(is_fp32(r.dtype) for lg in ledgers for r in lg.gathers)
    what = "FSDP communication" if fsdp_only else "communication"
    options = []
    bf16 = bf16_remedy(ctx) if fp32 else None
    if bf16 is not None:
        options.append(bf16.text)
    options.append("a bigger batch per rank (more compute per gathered byte)")
    if shards_across_nodes(ctx):  # never proposed to a run that already replicates
        options.append("HSDP (shard within a node, replicate across nodes)")
    excess = max(0.0, comm - compute) / n
    replay = replayed_gain(ctx, bf16 is not None)
    if replay is None:
        gain, method = excess, UPPER_BOUND
    else:
        gain = max(0.0, replay[0])
        method = (
            replay[1]
            + (" (no gain)" if replay[0] <= 0 else "")
            + f"; a bigger batch per rank is not replayed: the comm excess, {excess:.2f} ms "
            "per step, bounds what it can save (docs/whatif.md)"
        )
    return [
        Finding(
            id="comm-bound",
            severity="warning",
            title=(  # the comm-bound steps' own means: the other steps' can invert them
                f"{bound} of {n} steps are comm-bound: {what} "
                f"({hit_comm / bound:.1f} ms/step) exceeds compute ({hit_compute / bound:.1f} "
                "ms/step)" + (" in those steps" if bound < n else "")
            ),
            ranks=ranks,
            steps=sorted(steps),
            evidence={
                **({"tensor_parallel_left_out": True} if fsdp_only else {}),
                "comm_bound_steps": bound,
                "steps": n,
                "comm_ms_per_step": round(comm / n, 3),
                "compute_ms_per_step": round(compute / n, 3),
                "threshold_step_share": COMM_BOUND_STEP_SHARE,
                "comm_excess_ms_per_step": round(excess, 3),
                **({"replayed_beyond_prefetch": True} if replay is not None else {}),
            },
            recommendation=(NO_OVERLAP_FIX + " What would: " + "; ".join(options) + "."),
            code=bf16.code if bf16 is not None else None,
            expected_gain_ms=round(gain, 3),
            gain_method=method,
        )
    ]


RULE = Rule(
    id="comm-bound",
    summary="communication alone is longer than compute in most steps",
    detect=detect,
    what=(
        "At least half of the FSDP ranks' steps carry the `comm-bound` verdict: communication "
        "alone is longer than compute. On a run with a tensor-parallel dimension each step is "
        "judged again on its FSDP collectives alone (TP collectives are no FSDP traffic)."
    ),
    why=(
        "Overlap hides communication only up to the compute it runs under; past that the step "
        "is comm-bound whatever the prefetch settings. What helps: fewer bytes, more compute "
        "per byte, cheaper links."
    ),
    example=(
        "3 of 3 steps are comm-bound: communication (52.0 ms/step) exceeds compute (18.3 ms/step)."
    ),
    fix=(
        "Says no overlap fixes it; fewer bytes (bf16, with the same code as `fp32-collectives` "
        "when the gathers are fp32), a bigger batch per rank, HSDP on multi-node jobs whose "
        "FSDP still shards across nodes (never to a run that already replicates across them)."
    ),
    gain=(
        "Replayed where a remedy it names can be (bf16 parameter gathers off CPU-only runs, the "
        "HSDP shape on multi-node runs): the best remedy on top of `missing-overlap`'s prefetch, "
        "against that prefetch alone. Otherwise an upper bound: the communication time in "
        "excess of compute per step."
    ),
    scope="FSDP/ZeRO runs (the ranks with FSDP traffic)",
    fsdp_only=True,
    thresholds=(
        Threshold(
            "COMM_BOUND_STEP_SHARE",
            COMM_BOUND_STEP_SHARE,
            "Most steps must be comm-bound (per the step verdicts), not one outlier.",
            evidence="threshold_step_share",
        ),
    ),
    markers=(),
)
