"""`comm-bound`: steps where communication alone is longer than compute.

Overlap can hide communication only up to the compute it runs under; when comm > compute the
step is comm-bound whatever the prefetch settings. What helps then: fewer bytes (bf16 gathers),
more compute per byte (a bigger batch per rank), or cheaper links (HSDP on multi-node jobs whose
FSDP still shards across nodes).

The expected gain is replayed where a remedy it names can be: bf16 parameter gathers (not on a
CPU-only run, whose math would change too) and the HSDP shape (multi-node runs). Each is
replayed alone and on top of the prefetch `missing-overlap` replays; `settle` (run again by the
reconcile step, which knows the report's other findings) takes the best remedy no other finding
proposes, beyond prefetch when `missing-overlap` is reported. Otherwise the gain is the upper
bound: the comm time in excess of compute.

On a run with a tensor-parallel dimension, the step verdicts count the TP collectives too: those
are not FSDP traffic (no FSDP setting changes them), so each step is judged again on the FSDP
collectives alone (the ledger's), with the same verdict rule (rank/verdict.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import numpy as np

from ..rank import intervals
from ..rank.fsdp_ledger import RankLedger
from ..rank.verdict import COMM_BOUND_STEP_SHARE, decide
from ..report import Finding, StepBreakdown
from ..run.core_use import busiest
from ..whatif.run_whatif import Change, WhatIfResult
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


def _remedies(ctx: DetectorContext, bf16: bool) -> list[tuple[str, str, Change]]:
    """The remedies the replay can run on this run: (name, the finding that proposes the same
    change on its own, the change)."""
    out = []
    if bf16 and not ctx.sheet.cpu_only:
        out.append(("bf16 parameter gathers", "fp32-collectives", Change(bf16_params=True)))
    hsdp = hsdp_change(ctx)
    if hsdp is not None:
        out.append(("HSDP", "flat-sharding-multinode", hsdp))
    return out


def _leg(before: WhatIfResult | None, after: WhatIfResult) -> dict[str, object]:
    """One replayed comparison, as evidence: the command, what it is compared with, the times."""
    return {
        "command": after.change.label(),
        "against": before.change.label() if before is not None else "",
        "before_ms": round(before.predicted_ms if before is not None else after.measured_ms, 3),
        "after_ms": round(after.predicted_ms, 3),
    }


def replayed_remedies(ctx: DetectorContext, bf16: bool) -> list[dict[str, object]]:
    """Each remedy the replay can run (`_remedies`), replayed alone against the measured step
    and, where `missing-overlap`'s prefetch change replays, on top of it against it alone
    (what the remedy saves beyond what prefetch recovers): the evidence `settle` chooses from."""
    remedies = _remedies(ctx, bf16)
    if not remedies:
        return []  # (no prefetch replay for nothing: the common single-node CPU run)
    prefetch = prefetch_change(ctx)
    base = replayed(ctx, prefetch)
    out = []
    for name, finding, remedy in remedies:
        alone = replayed(ctx, remedy)
        if alone is None or not alone.ranks:
            continue
        entry: dict[str, object] = {
            "remedy": name,
            "finding": finding,
            "ranks": len(alone.ranks),
            "alone": _leg(None, alone),
        }
        if base is not None and base.ranks:
            both = replayed(
                ctx,
                dataclasses.replace(
                    remedy, prefetch=prefetch.prefetch, unshard_async_op=prefetch.unshard_async_op
                ),
            )
            if both is not None and both.ranks:
                entry["beyond_prefetch"] = _leg(base, both)
        out.append(entry)
    return out


def _gain_of(leg: object) -> float:
    """The saving of one replayed comparison (`_leg`), in ms per step."""
    assert isinstance(leg, dict)
    return float(leg["before_ms"]) - float(leg["after_ms"])


def settle(f: Finding, present: Collection[str]) -> None:
    """Set a comm-bound finding's gain from its replayed remedies, given the findings in the
    report (`present`): a remedy another finding proposes keeps its gain there (one claim per
    millisecond); of the others, the best, replayed on top of prefetch where `missing-overlap`
    is in the report. Without replayed remedies the gain stays the upper bound."""
    remedies = [r for r in f.evidence.get("replayed_remedies", []) if isinstance(r, dict)]
    if not remedies:
        return
    excess = float(f.evidence.get("comm_excess_ms_per_step", 0.0))
    bigger_batch = (
        "a bigger batch per rank is not replayed: the comm excess, "
        f"{excess:.2f} ms per step, bounds what it can save (docs/whatif.md)"
    )
    free = [r for r in remedies if r["finding"] not in present]
    claimed = [r for r in remedies if r["finding"] in present]
    f.evidence.pop("replayed_beyond_prefetch", None)
    if not free:
        f.expected_gain_ms = None
        f.gain_method = (
            "none of its own: "
            + ", ".join(
                f"`{r['finding']}` gives the replayed gain of {r['remedy']}" for r in claimed
            )
            + "; "
            + bigger_batch
        )
        return
    beyond = "missing-overlap" in present and all("beyond_prefetch" in r for r in free)
    leg_name = "beyond_prefetch" if beyond else "alone"
    best = max(free, key=lambda r: _gain_of(r[leg_name]))
    leg = best[leg_name]
    assert isinstance(leg, dict)
    gain = _gain_of(leg)
    against = f"{leg['against']} alone" if beyond else "the measured step"
    f.expected_gain_ms = round(max(0.0, gain), 3)
    f.gain_method = (
        f"replayed: {best['remedy']} (zdiag whatif {leg['command']}) against {against}, "
        f"{leg['before_ms']:.1f} -> {leg['after_ms']:.1f} ms, median over {best['ranks']} "
        "rank(s)"
        + (" (no gain)" if gain <= 0 else "")
        + "; "
        + "".join(f"`{r['finding']}` gives the gain of {r['remedy']}; " for r in claimed)
        + bigger_batch
    )
    if beyond:
        f.evidence["replayed_beyond_prefetch"] = True


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
    remedies = replayed_remedies(ctx, bf16 is not None)
    full = busiest(ctx.host_cores, ranks)
    cores_text = (
        f" On this CPU run the host's cores are full ({full.sentence()}): gloo's collectives "
        "run on those cores and wait for them, so part of this communication time is contention "
        "for the cores, not the links."
        if ctx.sheet.cpu_only and full is not None and full.full
        else ""
    )
    finding = Finding(
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
            **(
                {"host_cores_busy": [round(full.busy, 2), full.cores]}
                if cores_text and full
                else {}
            ),
            **({"replayed_remedies": remedies} if remedies else {}),
        },
        recommendation=(NO_OVERLAP_FIX + " What would: " + "; ".join(options) + "." + cores_text),
        code=bf16.code if bf16 is not None else None,
        expected_gain_ms=round(excess, 3),
        gain_method=UPPER_BOUND,
    )
    settle(finding, ())
    return [finding]


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
        "FSDP still shards across nodes (never to a run that already replicates across them). "
        "On a CPU run whose step logs show the host's cores full, it says gloo's collectives "
        "wait for those cores (no remedy proposed: fewer DataLoader workers slowed a "
        "data-bound run)."
    ),
    gain=(
        "Replayed where a remedy it names can be (bf16 parameter gathers off CPU-only runs, the "
        "HSDP shape on multi-node runs): the best remedy that no other finding in the report "
        "proposes (`fp32-collectives` and `flat-sharding-multinode` keep theirs), against the "
        "measured step, or on top of `missing-overlap`'s prefetch against that prefetch alone "
        "when `missing-overlap` is reported. Otherwise an upper bound: the communication time "
        "in excess of compute per step."
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
