"""`comm-bound`: steps where communication alone is longer than compute.

Overlap can hide communication only up to the compute it runs under; when comm > compute the
step is comm-bound whatever the prefetch settings. What helps then: fewer bytes (bf16 gathers),
more compute per byte (a bigger batch per rank), or cheaper links (HSDP on multi-node jobs).
"""

from __future__ import annotations

from ..report import Finding
from .context import DetectorContext
from .fp32_collectives import bf16_remedy, is_fp32
from .rule import Rule, Threshold

NO_OVERLAP_FIX = (
    "No prefetch or overlap setting can fix this: communication is longer than the compute it "
    "could hide under."
)
"""The recommendation's first sentence; the reconcile step rewrites it when `missing-overlap`
claims part of the same time (detectors/reconcile.py)."""

# (the reasoning behind the value: RULE's thresholds, at the end of the module)
COMM_BOUND_STEP_SHARE = 0.5


def detect(ctx: DetectorContext) -> list[Finding]:
    """The comm-bound finding, or none (only for runs with FSDP/ZeRO traffic)."""
    ledgers = ctx.fsdp_ledgers()
    if not ledgers:
        return []
    fsdp_ranks = {lg.rank for lg in ledgers}
    ranks: list[int] = []
    steps: set[int] = set()
    comm = compute = 0.0
    n = bound = 0
    for rank, bds in sorted(ctx.breakdowns.items()):
        if rank not in fsdp_ranks:
            continue
        hit = [b for b in bds if b.verdict == "comm-bound"]
        n += len(bds)
        bound += len(hit)
        if hit:
            ranks.append(rank)
            steps.update(b.step for b in hit)
        comm += sum(b.comm_ms for b in bds)
        compute += sum(b.compute_ms for b in bds)
    if not n or bound / n < COMM_BOUND_STEP_SHARE:
        return []
    fp32 = any(is_fp32(r.dtype) for lg in ledgers for r in lg.gathers)
    nnodes = ctx.sheet.nnodes or 1
    options = []
    bf16 = bf16_remedy(ctx) if fp32 else None
    if bf16 is not None:
        options.append(bf16.text)
    options.append("a bigger batch per rank (more compute per gathered byte)")
    if nnodes > 1:
        options.append("HSDP (shard within a node, replicate across nodes)")
    return [
        Finding(
            id="comm-bound",
            severity="warning",
            title=(
                f"{bound} of {n} steps are comm-bound: communication "
                f"({comm / n:.1f} ms/step) exceeds compute ({compute / n:.1f} ms/step)"
            ),
            ranks=ranks,
            steps=sorted(steps),
            evidence={
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
        "alone is longer than compute."
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
        "when the gathers are fp32), a bigger batch per rank, HSDP on multi-node jobs."
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
