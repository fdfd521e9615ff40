"""`comm-bound`: steps where communication alone is longer than compute.

Overlap can hide communication only up to the compute it runs under; when comm > compute the
step is comm-bound whatever the prefetch settings. What helps then: fewer bytes (bf16 gathers),
more compute per byte (a bigger batch per rank), or cheaper links (HSDP on multi-node jobs whose
FSDP still shards across nodes).

On a run with a tensor-parallel dimension, the step verdicts count the TP collectives too: those
are not FSDP traffic (no FSDP setting changes them), so each step is judged again on the FSDP
collectives alone (the ledger's), with the same verdict rule (rank/verdict.py).
"""

from __future__ import annotations

import numpy as np

from ..rank import intervals
from ..rank.fsdp_ledger import RankLedger
from ..rank.verdict import COMM_BOUND_STEP_SHARE, decide
from ..report import Finding, StepBreakdown
from .context import DetectorContext
from .flat_sharding import shards_across_nodes
from .fp32_collectives import bf16_remedy, is_fp32
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
            },
            recommendation=(NO_OVERLAP_FIX + " What would: " + "; ".join(options) + "."),
            code=bf16.code if bf16 is not None else None,
            expected_gain_ms=round(max(0.0, comm - compute) / n, 3),
            gain_method=(
                "upper bound: the comm time in excess of compute per step, which only fewer "
                "bytes or more compute per step can remove"
            ),
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
    gain="Upper bound: the communication time in excess of compute per step.",
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
