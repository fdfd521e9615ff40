"""`missing-overlap`: all-gathers serialized with compute, judged by what the schedule could hide.

The measured side: the exposed all-gather time (not covered by compute) on the rank's timeline.
The schedule side: the what-if replay (analyzers/whatif/) of the measured steps with prefetch
depth 1, in which each gather is issued no later than when the unit before its consumer
starts, queues on its comm lane and stays exposed only for what does not fit under that
unit's work; on a CPU run whose gathers cannot overlap, with the unshard async op the FSDP2
remedy adds (`zdiag whatif RUN --prefetch 1 --unshard-async-op` gives the same figure).
Gathers already prefetched gain nothing. The finding fires when that replayed gain is worth chasing (at least
MIN_GAIN_SHARE of the median step): a run whose gathers are already prefetched (every correct
FSDP1 run with forward_prefetch / BACKWARD_PRE) has nothing to gain, however much of its
gather time is exposed, and stays quiet.

Device behaviour: on GPUs, FSDP's all-gather stream overlaps a prefetched gather with the
current unit's kernels. On CPU/gloo, FSDP1's and FSDP2's default all-gathers block the only
thread: nothing overlaps whatever the prefetch settings, unless the unshard is issued as an
async op (FSDP2 `_set_unshard_async_op(True)` on the root, a private API), when gloo's worker
thread runs the prefetched gather while the main thread computes. The recommendation says so on
CPU-only runs. On CPU FSDP1, where prefetching gains nothing, the finding fires only when the
trace shows the backward pass's default prefetch switched off. Time that another rank's late
arrival makes this rank wait is not this finding's: the reconcile step (detectors/__init__.py)
gives it to `straggler`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..frameworks import Framework, Remedy, RunFacts
from ..rank.fsdp_ledger import CollectiveRecord, RankLedger
from ..report import Finding, Severity, StepBreakdown
from ..whatif.run_whatif import WhatIfResult
from .blocks import find_block_pattern
from .context import DetectorContext
from .facts import block_set, blocks_are_units
from .prefetch_lists import name_self_prefetch
from .replayed_gain import gain_text, prefetch_change, replayed
from .rule import Rule, Threshold
from .unshard_async_op import ASYNC_OP_LINE, with_unshard_async_op

# (the reasoning behind each value: RULE's thresholds, at the end of the module)
MIN_GAIN_SHARE = 0.02
MIN_GAIN_MS = 0.1
EXPOSED_SHARE = 0.5
CRITICAL_SHARE = 0.8
CRITICAL_GAIN_SHARE = 0.10
HOST_SYNCS_PER_UNIT = 1.0
HOST_BOUND_STEP_SHARE = 0.5


def _serialized(gathers: list[CollectiveRecord]) -> tuple[int, int]:
    """(gathers issued only when needed, gathers that could have been prefetched)."""
    by_pass: dict[tuple[int, str], list[CollectiveRecord]] = defaultdict(list)
    for r in gathers:
        if r.lead_us is not None:
            by_pass[(r.step, r.phase)].append(r)
    late = total = 0
    for recs in by_pass.values():
        for r in sorted(recs, key=lambda r: r.issued_us)[1:]:
            total += 1
            late += (r.lead_us or 0.0) <= 0.0
    return late, total


def _backward_prefetch_off(gathers: list[CollectiveRecord]) -> bool:
    """Whether the backward pass gathers without prefetching: it has gathers and none is issued
    under a prefetch label (FSDP1's default BACKWARD_PRE, and BACKWARD_POST, prefetch under
    `_pre_backward_prefetch` / `_post_backward_prefetch`)."""
    backward = [r for r in gathers if r.phase == "backward"]
    return bool(backward) and not any(r.prefetched for r in backward)


CPU_NOTES = {
    "fsdp1": (
        " On CPU/gloo (this run) FSDP1's gathers block the only thread whatever the prefetch "
        "settings: they pay off on GPUs, where the all-gather stream runs the prefetched gather."
    ),
    "deepspeed": (
        " On CPU/gloo (this run) ZeRO-3 issues its gathers as async ops that gloo's worker "
        "thread runs, so a prefetched gather overlaps compute, competing with it for the host's "
        "cores; on GPUs its own stream runs them."
    ),
}


def _cpu_note(ctx: DetectorContext, framework: str | None, code: str | None) -> str:
    """What overlaps on this CPU/gloo run, in its framework (FSDP2: whether the unshard async op
    is set, or where the code sets it)."""
    if framework != "fsdp2":
        return CPU_NOTES.get(framework or "", "")
    if ctx.sheet.gathers_can_overlap():
        return (
            " On CPU/gloo (this run) the unshard async op the run sets lets gloo's worker thread "
            "run a prefetched gather while the training thread computes, competing with it for "
            "the host's cores; on GPUs the all-gather stream does it."
        )
    where = "the code's last line" if code and ASYNC_OP_LINE in code else "a private API"
    return (
        " On CPU/gloo (this run) a prefetch setting alone overlaps nothing: FSDP2's default "
        "all-gather blocks the only thread. Gathers overlap compute there only when the unshard "
        f"runs as an async op (`model._set_unshard_async_op(True)` on the root, {where}), when "
        "gloo's worker thread runs the prefetched gather. On GPUs the all-gather stream does it "
        "and that setting is not needed."
    )


def overlap_facts(ctx: DetectorContext, unit_order: Sequence[str], fw: Framework) -> RunFacts:
    """The RunFacts for an overlap remedy, whose prefetch lists name FSDP units only: over the
    repeated units the unit names show when the description's blocks lie inside them (a mixer
    unit holding expert blocks); else the description's blocks (when they are not units yet,
    the framework's code wraps them first: frameworks/fsdp2.py `overlap`; FSDP1's wrap policy
    names the blocks)."""
    pattern = find_block_pattern(unit_order)
    are_units = blocks_are_units(pattern, unit_order)
    facts = ctx.sheet.run_facts(fw, block_set(pattern), are_units)
    if are_units and facts.blocks_are_units is False:
        facts = replace(facts, blocks=block_set(pattern), blocks_are_units=True)
    return facts


def _remedy(ctx: DetectorContext, lg: RankLedger, fw: Framework) -> Remedy | None:
    """The framework's overlap settings over the run's units (`overlap_facts`)."""
    return with_unshard_async_op(ctx.sheet, fw, fw.overlap(overlap_facts(ctx, lg.unit_order, fw)))


@dataclass(frozen=True)
class _Measured:
    """The first FSDP rank's gathers, judged: exposure, lateness and the replayed gain."""

    ledger: RankLedger
    gathers: list[CollectiveRecord]
    gather_us: float
    exposed_us: float
    late: int  # gathers issued only when needed
    could: int  # gathers that could have been prefetched
    n_steps: int
    gain_ms: float  # replayed, per step
    replay: WhatIfResult
    min_gain_ms: float
    median_step: float | None
    steps: list[StepBreakdown]

    @property
    def exposed_share(self) -> float:
        return self.exposed_us / self.gather_us if self.gather_us > 0 else 0.0

    @property
    def has_leads(self) -> bool:
        return self.could > 0

    @property
    def serialized_share(self) -> float:
        return self.late / self.could if self.could else 0.0


def _measure(ctx: DetectorContext) -> _Measured | None:
    """Gating: >= EXPOSED_SHARE of the gather time exposed, lateness measured (or a framework
    whose labels name no consumer), and a replayed gain of at least the minimum."""
    ledgers = ctx.fsdp_ledgers()
    if not ledgers or not ledgers[0].gathers:
        return None
    lg = ledgers[0]
    gathers = lg.gathers
    gather_us = sum(r.dur_us for r in gathers)
    exposed_us = sum(r.exposed_us for r in gathers)
    exposed_share = exposed_us / gather_us if gather_us > 0 else 0.0
    late, could = _serialized(gathers)
    if exposed_share < EXPOSED_SHARE or (not could and ctx.sheet.framework.labels_name_consumer):
        return None
    n_steps = max(1, len(lg.steps) or len({r.step for r in gathers}))
    # prefetch depth 1 where gathers can overlap: on a CPU run that cannot, with the unshard
    # async op the FSDP2 remedy adds (FSDP1's blocking gathers: what a GPU would hide)
    result = replayed(ctx, prefetch_change(ctx))
    if result is None:
        return None
    gain_ms = max(0.0, result.gain_ms)
    bds = ctx.breakdowns.get(lg.rank, [])
    durations = sorted(b.duration_ms for b in bds if b.duration_ms > 0)
    median_step = durations[len(durations) // 2] if durations else None
    min_gain = max(MIN_GAIN_MS, MIN_GAIN_SHARE * median_step if median_step else 0.0)
    if gain_ms < min_gain:
        return None
    return _Measured(
        lg, gathers, gather_us, exposed_us, late, could, n_steps, gain_ms, result, min_gain,
        median_step, bds,
    )  # fmt: skip


def _recommendation(
    ctx: DetectorContext, m: _Measured, remedy: Remedy | None, units: list[str]
) -> tuple[str, float, int]:
    """(recommendation, host syncs per step, host-bound steps): the remedy's text (or why the
    run has nothing to set), then the causes that keep gathers late (host syncs per unit,
    host-bound steps) and what overlaps on a CPU/gloo run."""
    fw = ctx.sheet.framework
    recommendation = (
        remedy.text
        if remedy
        else (
            f"The run already sets every {fw.title} prefetch option zdiag would propose: the "
            "gathers stay exposed for another reason (see the causes below and the step verdicts)."
        )
    )
    syncs_per_step = ctx.host_syncs(m.ledger.rank) / m.n_steps
    if units and syncs_per_step >= HOST_SYNCS_PER_UNIT * len(units):
        recommendation += (
            f" The host blocks {syncs_per_step:.0f} times per step (.item() / synchronize, "
            f"{syncs_per_step / len(units):.1f} per unit): remove those syncs from the step "
            "(log losses every N steps, check NaNs on device) so the host can issue the next "
            "gather ahead of time."
        )
    if ctx.sheet.cpu_only:
        recommendation += _cpu_note(ctx, m.ledger.framework, remedy.code if remedy else None)
    bds = m.steps
    host_bound_steps = sum(1 for b in bds if b.verdict == "host-bound")
    if bds and host_bound_steps / len(bds) >= HOST_BOUND_STEP_SHARE:
        recommendation += (
            f" {host_bound_steps} of {len(bds)} steps are host-bound ("
            + (
                "the host's training thread idles between its ops"
                if ctx.sheet.cpu_only
                else "the device idles waiting for launches"
            )
            + "): fewer, larger kernels (torch.compile of each block, CUDA graphs) let "
            "the host issue gathers early."
        )
    return recommendation, syncs_per_step, host_bound_steps


def _severity(m: _Measured, blocking: bool, gain_ms: float) -> Severity:
    """info where the gathers block the CPU; critical when essentially nothing overlaps and
    the gain is a large part of the step; else a warning."""
    if blocking:
        return "info"
    if (
        m.exposed_share >= CRITICAL_SHARE
        and m.serialized_share >= CRITICAL_SHARE
        and m.median_step
        and gain_ms >= CRITICAL_GAIN_SHARE * m.median_step
    ):
        return "critical"
    return "warning"


def _evidence(
    m: _Measured, syncs_per_step: float, host_bound_steps: int, blocking: bool
) -> dict[str, object]:
    lg, n_steps = m.ledger, m.n_steps
    return {
        "framework": lg.framework,
        "gathers": len(m.gathers),
        "gathers_issued_when_needed": m.late,
        "gathers_prefetchable": m.could,
        "serialized_share": round(m.serialized_share, 3),
        "min_gain_ms_per_step": round(m.min_gain_ms, 3),
        "all_gather_ms_per_step": round(m.gather_us / 1e3 / n_steps, 3),
        "exposed_all_gather_ms_per_step": round(m.exposed_us / 1e3 / n_steps, 3),
        "exposed_share": round(m.exposed_share, 3),
        "threshold_exposed_share": EXPOSED_SHARE,
        "reduce_ms_per_step": round(sum(r.dur_us for r in lg.reduces) / 1e3 / n_steps, 3),
        "exposed_reduce_ms_per_step": round(
            sum(r.exposed_us for r in lg.reduces) / 1e3 / n_steps, 3
        ),
        "host_syncs_per_step": round(syncs_per_step, 2),
        "host_bound_steps": host_bound_steps,
        "replayed_gain_ms_per_step": round(m.gain_ms, 3),
        "cpu_blocking_gathers": blocking,
    }


def _gain_method(m: _Measured, blocking: bool) -> str:
    return (
        gain_text(m.replay)
        + ("" if m.has_leads else " (gathers not under a prefetch label count as late)")
        + (
            f". On this CPU/gloo run FSDP1's gathers block the only thread whatever the "
            f"prefetch settings: 0 ms here; {m.gain_ms:.2f} ms per step where gathers overlap "
            "(on GPUs, where the all-gather stream runs the prefetched gather)"
            if blocking
            else ""
        )
    )


def detect(ctx: DetectorContext) -> list[Finding]:
    """The missing-overlap finding, or none."""
    m = _measure(ctx)
    if m is None:
        return []
    lg = m.ledger
    units = [u for u in lg.unit_order if u]
    remedy = name_self_prefetch(ctx.sheet.model, _remedy(ctx, lg, ctx.sheet.framework))
    if remedy is None and not m.has_leads:
        # every prefetch setting is on and nothing measured which gathers came late (ZeRO-3
        # labels no prefetch): the replay's "not under a prefetch label" guess has no ground
        return []
    recommendation, syncs_per_step, host_bound_steps = _recommendation(ctx, m, remedy, units)
    # FSDP1 on CPU/gloo: every gather blocks the only thread, prefetch or not; the replayed
    # gain is what the same schedule would hide on GPUs, not on this machine
    blocking = ctx.sheet.cpu_only and lg.framework == "fsdp1"
    if blocking and (remedy is None or not _backward_prefetch_off(m.gathers)):
        # nothing to gain on this machine and no default switched off: forward_prefetch, an
        # opt-in whose gain only a GPU shows, is not proposed on a CPU run (exposed-comm explains)
        return []
    gain_ms = 0.0 if blocking else m.gain_ms
    return [
        Finding(
            id="missing-overlap",
            severity=_severity(m, blocking, gain_ms),
            title=(
                f"All-gathers serialized with compute: {m.late} of {m.could} issued only when "
                f"needed, {m.exposed_share:.0%} of all-gather time exposed"
                if m.has_leads
                else f"{m.exposed_share:.0%} of all-gather time exposed: gathers not overlapped"
            ),
            ranks=[lgr.rank for lgr in ctx.fsdp_ledgers()],
            steps=list(lg.steps),
            units=units,
            evidence=_evidence(m, syncs_per_step, host_bound_steps, blocking),
            recommendation=recommendation,
            code=remedy.code if remedy else None,
            expected_gain_ms=round(gain_ms, 3),
            gain_method=_gain_method(m, blocking),
        )
    ]


RULE = Rule(
    id="missing-overlap",
    summary="all-gathers serialized with compute that prefetch would hide",
    detect=detect,
    what=(
        "All-gathers issued only when needed, serialized with compute: the replayed gain is "
        ">= 2% of the median step (and 0.1 ms) and >= 50% of all-gather time is exposed. "
        "Gathers already issued ahead (lead > 0) or under a prefetch label (FSDP1 "
        "`forward_prefetch`/`BACKWARD_PRE`) count for nothing, so a correct run is quiet "
        "however exposed its gathers are. Critical when >= 80% of the prefetchable gathers are "
        "late, >= 80% of gather time is exposed and the gain is >= 10% of the step; `info` "
        "with 0 ms on CPU-only FSDP1 runs, and only when the trace shows the backward pass's "
        "default prefetch switched off; silent when the run already has every prefetch setting "
        "and nothing measured which gathers came late (FSDP1 and ZeRO-3 name no consumer, and "
        "ZeRO-3 labels no prefetch). On CPU-only FSDP1 runs the gathers block the only thread "
        "whatever the prefetch, so `forward_prefetch`, an opt-in, is not proposed there (the "
        "GPU figure is in `replayed_gain_ms_per_step`)."
    ),
    why=(
        "A gather issued when its unit is needed stalls compute for its whole duration; "
        "issued one unit ahead it runs under the previous unit's compute. On CPU/gloo FSDP2 "
        "overlaps only with its unshard as an async op (private) plus explicit prefetch lists, "
        "and FSDP1's gathers block the only thread whatever the prefetch."
    ),
    example=(
        "All-gathers serialized with compute: 18 of 18 issued only when needed, 97% of "
        "all-gather time exposed (FSDP2 without `set_modules_to_forward_prefetch`)."
    ),
    fix=(
        "Explicit forward/backward prefetch on the exact blocks (removing per-block host syncs "
        "when found, fewer/larger kernels when most steps are host-bound); FSDP1 "
        "`forward_prefetch`/`BACKWARD_PRE`/`limit_all_gathers`; DeepSpeed "
        "`overlap_comm`/`stage3_prefetch_bucket_size`; on CPU-only FSDP2 runs without it, the "
        "unshard async op set last. Never a setting the run already has: FSDP2 prefetch "
        "settings are read from the units that have a neighbour to prefetch (a chain's last "
        "block has nothing to prefetch forward, its first nothing backward), and the root's "
        "forward prefetch of the first unit apart (a run that chains its blocks but not the "
        "root gets only that line, naming the first unit the trace gathers); a ZeRO-3 prefetch "
        "bucket of 0 counts as prefetching off. ZeRO-3 issues its gathers as async ops (gloo's "
        "worker thread runs them), so its CPU runs are judged able to overlap."
    ),
    gain=(
        "The what-if replay of the measured steps with prefetch depth 1 (`zdiag whatif RUN "
        "--prefetch 1`, plus `--unshard-async-op` on a CPU run whose gathers cannot overlap): "
        "each gather issued when the unit before its consumer starts, queued on its comm lane, "
        "exposed only for what does not fit under that unit's work (docs/whatif.md)."
    ),
    scope="FSDP2, FSDP1 and DeepSpeed ZeRO-3 runs (their parameter gathers)",
    fsdp_only=True,
    thresholds=(
        Threshold(
            "MIN_GAIN_SHARE",
            MIN_GAIN_SHARE,
            "The replayed gain must be at least this share of the median step: below it the "
            "change is not worth making (the straggler rule's bar). The evidence's "
            "min_gain_ms_per_step is max(MIN_GAIN_MS, this x the median step).",
        ),
        Threshold("MIN_GAIN_MS", MIN_GAIN_MS, "...and at least this many ms per step."),
        Threshold(
            "EXPOSED_SHARE",
            EXPOSED_SHARE,
            "At least this share of the all-gather time is exposed: prefetch only helps what "
            "is exposed (on GPUs, a late host issue the device still overlaps is no problem).",
            evidence="threshold_exposed_share",
        ),
        Threshold(
            "CRITICAL_SHARE",
            CRITICAL_SHARE,
            "Critical (not just a warning) when this share of the prefetchable gathers is late "
            "and of the all-gather time exposed: essentially no overlap anywhere in the step.",
        ),
        Threshold(
            "CRITICAL_GAIN_SHARE",
            CRITICAL_GAIN_SHARE,
            "...and only when the gain is at least this share of the step (severity follows "
            "the gain).",
        ),
        Threshold(
            "HOST_SYNCS_PER_UNIT",
            HOST_SYNCS_PER_UNIT,
            "Host syncs (`.item()`, synchronize) at least this often per unit and step keep the "
            "host from running ahead to issue the next gather: the recommendation says to "
            "remove them.",
        ),
        Threshold(
            "HOST_BOUND_STEP_SHARE",
            HOST_BOUND_STEP_SHARE,
            "Launch-bound: this share of the steps carries the host-bound verdict; the "
            "recommendation adds fewer, larger kernels.",
        ),
    ),
    markers=("all_gather",),
)
