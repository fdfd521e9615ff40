"""`exposed-replicate-allreduce`: HSDP's cross-replica gradient all-reduces sit exposed.

HSDP (FSDP2 on a ("replicate", "shard") mesh) reduces each unit's gradients twice in backward:
a reduce-scatter inside the shard group, then an all-reduce of the shard across the replicate
group (across nodes, in the usual layout). The last units' all-reduces run after the last
backward compute, with nothing left to hide under: the step waits for them. Two things shrink
that wait without touching the model: all-reducing once per optimizer step when the run
accumulates gradients over micro-batches (`set_requires_all_reduce(False)` on the earlier ones),
and reducing in bf16 (half the bytes).

Which reductions are the all-reduces: the process group that ran each (its members, a group of
the mesh's replicate dimension), else the kernels' kinds (`reduce_scatter` vs `all_reduce` on
NCCL). On gloo both run as all-reduces: without the group (a run recorded before zdiag recorded
gloo's threads) nothing is said.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from ..frameworks import Remedy, fsdp2
from ..rank.fsdp_ledger import CollectiveRecord, RankLedger
from ..report import Finding
from ..whatif.change_checks import CPU_BF16_REDUCE
from ..whatif.run_whatif import Change
from .comm_model import fit_alpha_beta
from .context import DetectorContext
from .replayed_gain import gain_text, replayed
from .rule import Rule, Threshold

# (the reasoning behind each value: RULE's thresholds, at the end of the module)
EXPOSED_STEP_SHARE = 0.05
MIN_REMOVED_SHARE = 0.1


@dataclass(frozen=True)
class ReplicateReduces:
    """One rank's HSDP gradient reductions, split by dimension."""

    all_reduces: list[CollectiveRecord]  # across the replicate group
    reduce_scatters: list[CollectiveRecord]  # inside the shard group
    micro_batches: int  # reduce-scatters per unit per step (backward passes per step)
    all_reduces_per_pass: float  # all-reduces per unit per step / micro_batches


def _dimension(
    recs: list[CollectiveRecord], role_of: Callable[[CollectiveRecord], str | None]
) -> tuple[list[CollectiveRecord], list[CollectiveRecord]] | None:
    """(all-reduces, reduce-scatters) of one unit's reductions in one step: by the group that
    ran each (its mesh role), else by the kernels' kinds; None when neither tells."""
    roles = [role_of(r) for r in recs]
    if all(role in ("replicate", "shard") for role in roles):
        return (
            [r for r, role in zip(recs, roles, strict=True) if role == "replicate"],
            [r for r, role in zip(recs, roles, strict=True) if role == "shard"],
        )
    if any(r.kind == "reduce_scatter" for r in recs):
        return [r for r in recs if r.kind == "all_reduce"], [
            r for r in recs if r.kind != "all_reduce"
        ]
    return None  # gloo runs both as all-reduces: the group decides, and it is not known


def split_reduces(
    lg: RankLedger, role_of: Callable[[CollectiveRecord], str | None]
) -> ReplicateReduces | None:
    """The rank's reductions as (replicate all-reduces, shard reduce-scatters); None when they
    cannot be told apart or there is no all-reduce."""
    by_unit: dict[tuple[int, str], list[CollectiveRecord]] = defaultdict(list)
    for r in lg.reduces:
        by_unit[(r.step, r.unit)].append(r)
    ars: list[CollectiveRecord] = []
    rss: list[CollectiveRecord] = []
    per_unit: list[tuple[int, int]] = []
    for recs in by_unit.values():
        split = _dimension(recs, role_of)
        if split is None:
            return None
        ars += split[0]
        rss += split[1]
        per_unit.append((len(split[1]), len(split[0])))
    if not ars:
        return None
    micro = int(statistics.median(n for n, _ in per_unit))
    per_pass = statistics.median(a for _, a in per_unit) / max(1, micro)
    return ReplicateReduces(ars, rss, max(1, micro), per_pass)


def is_hsdp(ctx: DetectorContext) -> bool:
    """Whether FSDP replicates across a mesh dimension: the captured units' setting, the
    captured mesh's roles, else the traces' "mesh_replicate" groups."""
    if ctx.sheet.settings.get("fsdp2", {}).get("hsdp"):
        return True
    mesh = ctx.sheet.mesh
    if mesh is not None:
        return bool(mesh.dims_with_role("replicate"))
    return "replicate" in ctx.group_roles.values()


def _remedy(ctx: DetectorContext, split: ReplicateReduces) -> tuple[Remedy, float, str] | None:
    """(remedy, share of the exposed all-reduce time it removes, how), or None when the run
    already does what would help."""
    k = split.micro_batches
    if k > 1 and split.all_reduces_per_pass >= 1:
        return (
            fsdp2.all_reduce_last_micro_batch(k),
            (k - 1) / k,
            f"{k - 1} of the {k} all-reduces per unit and step skipped",
        )
    remedy = fsdp2.bf16_reduce(ctx.sheet.run_facts())
    if remedy is None:
        return None
    sized = [r for r in split.all_reduces if r.bytes > 0]
    fit = fit_alpha_beta(sized) if sized else None
    if fit is None or fit.sizes < 2:
        return remedy, 0.5, "half the bytes: at most half the time (message sizes not recorded)"
    now = sum(fit.time_us(r.bytes) for r in sized)
    half = sum(fit.time_us(r.bytes / 2) for r in sized)
    return (
        remedy,
        max(0.0, 1 - half / now),
        f"half the bytes, timed with the all-reduces' own latency-bandwidth fit (alpha "
        f"{fit.alpha_us:.0f} us, {fit.beta_bytes_per_us:.0f} bytes/us)",
    )


def detect(ctx: DetectorContext) -> list[Finding]:
    """The exposed-replicate-allreduce finding, or none (FSDP2 HSDP runs only)."""
    ledgers = [lg for lg in ctx.fsdp_ledgers() if lg.framework == "fsdp2"]
    if not ledgers or not is_hsdp(ctx):
        return []
    lg = ledgers[0]
    roles = ctx.group_roles

    def role_of(r: CollectiveRecord) -> str | None:
        members = ctx.members_of(lg.rank, r)
        return roles.get(members) if members is not None else None

    split = split_reduces(lg, role_of)
    n_steps = max(1, len(lg.steps))
    if split is None or lg.window_us <= 0:
        return []
    exposed_us = sum(r.exposed_us for r in split.all_reduces)
    share = exposed_us / lg.window_us
    if share < EXPOSED_STEP_SHARE:
        return []
    found = _remedy(ctx, split)
    if found is None:
        return []
    remedy, removed, how = found
    if removed < MIN_REMOVED_SHARE:
        return []  # latency-bound all-reduces: half the bytes would not shorten them
    exposed_ms = exposed_us / 1e3 / n_steps
    gain_ms: float | None = round(exposed_ms * removed, 3)
    method = (
        f"measured exposed all-reduce time per step ({exposed_ms:.2f} ms) x the share "
        f"removed ({removed:.0%}: {how})"
    )
    once = split.micro_batches > 1 and split.all_reduces_per_pass >= 1
    result = replayed(ctx, Change(all_reduce_once=True) if once else Change(bf16_reduce=True))
    if result is not None:
        gain_ms, method = round(result.gain_ms, 3), gain_text(result)
    elif not once and ctx.sheet.cpu_only:
        gain_ms, method = None, f"not predicted: {CPU_BF16_REDUCE}"
    last = [max((r for r in split.all_reduces if r.step == s), key=lambda r: r.start_us)
            for s in sorted({r.step for r in split.all_reduces})]  # fmt: skip
    return [
        Finding(
            id="exposed-replicate-allreduce",
            severity="warning",
            title=(
                f"HSDP's cross-replica gradient all-reduces are exposed: {exposed_ms:.2f} ms per "
                f"step ({share:.0%} of the step) waits for them"
            ),
            ranks=[x.rank for x in ledgers],
            steps=list(lg.steps),
            evidence={
                "all_reduces_per_step": round(len(split.all_reduces) / n_steps, 2),
                "micro_batches_per_step": split.micro_batches,
                "exposed_all_reduce_ms_per_step": round(exposed_ms, 3),
                "last_all_reduce_exposed_ms_per_step": round(
                    sum(r.exposed_us for r in last) / 1e3 / n_steps, 3
                ),
                "exposed_share_of_step": round(share, 4),
                "threshold_step_share": EXPOSED_STEP_SHARE,
                "removed_share": round(removed, 4),
                "threshold_removed_share": MIN_REMOVED_SHARE,
            },
            recommendation=f"{remedy.text[0].upper()}{remedy.text[1:]}.",
            code=remedy.code,
            expected_gain_ms=gain_ms,
            gain_method=method,
        )
    ]


RULE = Rule(
    id="exposed-replicate-allreduce",
    summary="HSDP's cross-replica gradient all-reduces sit exposed at the end of backward",
    detect=detect,
    what=(
        "An FSDP2 HSDP run whose cross-replica gradient all-reduces (the second reduction of "
        "each unit, after the shard group's reduce-scatter) are exposed for at least 5% of the "
        "step, and a change the run does not already have would shrink them."
    ),
    why=(
        "The last units' all-reduces run after the last backward compute: nothing hides them, "
        "and across nodes they are the slowest collectives of the step."
    ),
    example=(
        "HSDP's cross-replica gradient all-reduces are exposed: 12.40 ms per step (9% of the "
        "step) waits for them."
    ),
    fix=(
        "With several micro-batches per optimizer step, each all-reduced: "
        "`model.set_requires_all_reduce(is_last_micro_batch)`; else reduce in bf16 "
        "(`MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)` on the run's own mesh)."
    ),
    gain=(
        "Replayed: for k micro-batches, the step with each unit's replicate all-reduces in its "
        "last micro-batch only (`zdiag whatif --all-reduce-once`); for bf16, with every "
        "gradient reduce moving half its bytes (`zdiag whatif --reduce-dtype bf16`). Without a "
        "step model: the measured exposed all-reduce time x (k-1)/k, or x the share the "
        "all-reduces' own latency-bandwidth fit gives at half the bytes. No bf16 figure on a "
        "CPU-only run: gloo sums bf16 on the host, and a GPT-2 on a (2, 2) mesh ran slower with "
        "it."
    ),
    scope="FSDP2 HSDP runs (a replicate dimension in the captured mesh or the traces' groups)",
    fsdp_only=True,
    thresholds=(
        Threshold(
            "EXPOSED_STEP_SHARE",
            EXPOSED_STEP_SHARE,
            "Below 5% of the step the all-reduces' wait is noise next to the step's own "
            "variation (the step verdicts' MIN_EXPOSED_FRACTION).",
            evidence="threshold_step_share",
        ),
        Threshold(
            "MIN_REMOVED_SHARE",
            MIN_REMOVED_SHARE,
            "A change that would remove less than a tenth of the exposed time (bf16 on "
            "latency-bound all-reduces: the fit says the time is per-call overhead) is not "
            "worth a finding.",
            evidence="threshold_removed_share",
        ),
    ),
    markers=("all_reduce",),
)
