"""`host-bound` and `exposed-comm`: most steps carry a bad verdict that no other finding explains.

The step verdicts (analyzers/rank/verdict.py) say what limited each step; a run whose steps are
mostly host-bound or exposed-comm must not end without a finding that says why and what to do.

- `host-bound` (>= HOST_BOUND_STEP_SHARE of all ranks' steps): the device idles waiting for the
  host. The idle time per step is split by cause from what the map measured: data loading (the
  DataLoader `next()` ranges), host syncs (the syncs' own host time, optimizer's included),
  pipeline waits (a pipeline stage's rank waiting for its neighbours' tensors, or for them to
  take its own) and, for the rest, launch and Python overhead (kernels too small or too many to
  keep the device busy). The recommendation follows the largest part; when the pipeline waits are the largest, the idle is
  the pipeline's bubble and no host-bound finding is made (`pipeline-bubble` says it).
- `exposed-comm` (>= EXPOSED_COMM_STEP_SHARE of the steps): communication is exposed although
  compute could hide it. Fires only when neither `straggler`, `missing-overlap` nor `comm-bound`
  explains that time (the reconcile step drops it otherwise).

`comm-bound` steps have their own detector (comm_bound.py).
"""

from __future__ import annotations

from ..frameworks import Framework
from ..report import Finding
from ..run.core_use import busiest
from ..whatif.run_whatif import Change
from .context import DetectorContext
from .replayed_gain import gain_text, replayed
from .rule import Rule, Threshold
from .unshard_async_op import lacks_unshard_async_op, with_unshard_async_op

# (the reasoning behind each value: the rules' thresholds, at the end of the module)
HOST_BOUND_STEP_SHARE = 0.5
EXPOSED_COMM_STEP_SHARE = 0.5


def _steps_with(ctx: DetectorContext, verdict: str) -> tuple[int, int, list[int], set[int]]:
    n = hit = 0
    ranks: list[int] = []
    steps: set[int] = set()
    for rank, bds in sorted(ctx.breakdowns.items()):
        bad = [b for b in bds if b.verdict == verdict]
        n += len(bds)
        hit += len(bad)
        if bad:
            ranks.append(rank)
            steps.update(b.step for b in bad)
    return n, hit, ranks, steps


def _idler(ctx: DetectorContext) -> str:
    """What idles in a host-bound step: the device, or on a CPU-only run (no device) the
    host's training thread."""
    return "the host's training thread" if ctx.sheet.cpu_only else "the device"


def detect_host_bound(ctx: DetectorContext) -> list[Finding]:
    """The host-bound finding, or none."""
    n, hit, ranks, steps = _steps_with(ctx, "host-bound")
    if not n or hit / n < HOST_BOUND_STEP_SHARE:
        return []
    idle = sum(b.idle_ms for bds in ctx.breakdowns.values() for b in bds) / n
    step_ms = sum(b.duration_ms for bds in ctx.breakdowns.values() for b in bds) / n
    per_rank_steps = {r: max(1, len(b)) for r, b in ctx.breakdowns.items()}
    data = syncs = pipe = 0.0
    for r, k in per_rank_steps.items():
        f = ctx.facts.get(r)
        if f is None:
            continue
        data += f.data_loading_ms / k
        syncs += f.host_sync_sites.blocked_ms / k
        pipe += sum(t.neighbour_wait_ms for t in f.pipeline) / max(1, len(f.pipeline))
    m = max(1, len(per_rank_steps))
    data, syncs = min(idle, data / m), syncs / m
    syncs = min(syncs, idle - data)
    pipe = min(pipe / m, idle - data - syncs)
    launch = max(0.0, idle - data - syncs - pipe)
    parts = {
        "data loading": data,
        "host syncs": syncs,
        "launch, Python and other host work": launch,
    }
    top = max(parts, key=lambda k: parts[k])
    if pipe > 0 and pipe >= parts[top]:  # waits for neighbours: the bubble, pipeline-bubble's
        return []
    if pipe > 0:
        parts = {"pipeline waits": pipe, **parts}
    advice = {
        "data loading": (
            "the input pipeline: more DataLoader workers (num_workers), pin_memory=True, "
            "prefetch_factor, faster storage or pre-processed data"
        ),
        "host syncs": (
            "the host syncs (`.item()`, `float(t)`, synchronize): read values every N steps, "
            "keep checks on the device (see `host-sync` when the model's code has them)"
        ),
        "launch, Python and other host work": (
            "fewer, larger kernels: torch.compile of each block, CUDA graphs, a larger "
            "micro-batch per rank, fused optimizers (`foreach=True` / `fused=True`)"
        ),
    }[top]
    full = busiest(ctx.host_cores, ranks)
    full = full if full is not None and full.full else None
    if full is not None and top == "data loading":
        advice = (
            "the input pipeline: the host's cores are full, so more DataLoader workers would "
            "compete with the ranks for them; cheaper or pre-computed transforms, faster "
            "storage, or more cores per rank"
        )
    cores_text = (
        ""
        if full is None
        else f" The host's CPU cores are full ({full.sentence()}): the ranks, their threads "
        "and their worker processes compete for them, so host work runs slower than it would "
        "alone."
    )
    split = ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items())
    return [
        Finding(
            id="host-bound",
            severity="critical" if idle >= 0.5 * step_ms else "warning",
            title=(
                f"{hit} of {n} steps are host-bound: {_idler(ctx)} idles {idle:.1f} ms of "
                f"{step_ms:.1f} ms per step ({split})"
            ),
            ranks=ranks,
            steps=sorted(steps),
            evidence={
                "host_bound_steps": hit,
                "steps": n,
                "idle_ms_per_step": round(idle, 3),
                "step_ms": round(step_ms, 3),
                "data_loading_ms_per_step": round(data, 3),
                "host_sync_ms_per_step": round(syncs, 3),
                "launch_overhead_ms_per_step": round(launch, 3),
                "pipeline_wait_ms_per_step": round(pipe, 3),
                "threshold_step_share": HOST_BOUND_STEP_SHARE,
                **({} if full is None else {"host_cores_busy": [round(full.busy, 2), full.cores]}),
            },
            recommendation=(
                f"The largest part of the idle time is {top} ({parts[top]:.2f} ms per step): "
                f"look at {advice}.{cores_text}"
            ),
            expected_gain_ms=round(parts[top], 3),
            gain_method=(
                "the largest cause's share of the device idle time per step; data loading from "
                "the DataLoader ranges, host syncs from their own host time, launch overhead "
                "as the rest of the idle time"
            ),
        )
    ]


def detect_exposed_comm(ctx: DetectorContext) -> list[Finding]:
    """The exposed-comm finding, or none."""
    n, hit, ranks, steps = _steps_with(ctx, "exposed-comm")
    if not n or hit / n < EXPOSED_COMM_STEP_SHARE:
        return []
    bds = [b for v in ctx.breakdowns.values() for b in v]
    exposed = sum(b.exposed_comm_ms for b in bds) / n
    comm = sum(b.comm_ms for b in bds) / n
    compute = sum(b.compute_ms for b in bds) / n
    fw = ctx.sheet.known_framework
    blocking = _blocking_on_cpu(ctx, fw)
    recommendation, code, has_remedy = _exposed_comm_advice(ctx, fw, blocking)
    gain = min(exposed, max(0.0, compute - (comm - exposed)))
    # nothing to gain here: the gathers block on CPU, or the run already has every setting
    nothing_to_do = blocking or not has_remedy
    # a sharding framework's remedy is prefetching (with FSDP2's async unshard on a CPU run
    # that lacks it): its gain is the replay of that change, the figure missing-overlap gives
    lacks_async = lacks_unshard_async_op(ctx.sheet, fw)
    replay = (
        replayed(ctx, Change(prefetch=1, unshard_async_op=lacks_async))
        if fw is not None and fw.name in SHARDING_FRAMEWORKS and has_remedy
        and (lacks_async or not blocking)
        else None
    )  # fmt: skip
    return [
        Finding(
            id="exposed-comm",
            severity="info" if nothing_to_do else "warning",
            title=(
                f"{hit} of {n} steps have exposed communication: {exposed:.1f} ms per step of "
                f"{comm:.1f} ms communication is not hidden behind {compute:.1f} ms compute"
            ),
            ranks=ranks,
            steps=sorted(steps),
            evidence={
                "exposed_comm_steps": hit,
                "steps": n,
                "exposed_comm_ms_per_step": round(exposed, 3),
                "comm_ms_per_step": round(comm, 3),
                "compute_ms_per_step": round(compute, 3),
                "threshold_step_share": EXPOSED_COMM_STEP_SHARE,
                "overlap_gain_ms_per_step": round(gain, 3),
            },
            recommendation=recommendation,
            code=code,
            expected_gain_ms=(
                round(max(0.0, replay.gain_ms), 3)
                if replay is not None
                else 0.0
                if nothing_to_do
                else round(gain, 3)
            ),
            gain_method=gain_text(replay)
            if replay is not None
            else (
                "the exposed communication per step, up to the compute not already overlapping "
                "communication (what perfect overlap could hide)"
                + (
                    "; 0 on this CPU-only run, where FSDP2's gathers block the training thread "
                    "until its unshard runs as an async op, and what that op hides beside compute "
                    "on the same cores is not predicted without the traces' step models "
                    "(overlap_gain_ms_per_step is the figure on GPUs)"
                    if lacks_async
                    else "; 0 on this CPU-only run, where the framework's collectives block the "
                    "training thread (overlap_gain_ms_per_step is the figure on GPUs)"
                    if blocking
                    else "; 0: the run already has every overlap setting zdiag would propose"
                    if not has_remedy
                    else ""
                )
            ),
        )
    ]


GENERIC_OVERLAP_ADVICE = (
    "Compute could hide this communication: issue the collectives earlier and asynchronously "
    "(DDP: smaller `bucket_cap_mb` so gradient buckets start during backward; FSDP: explicit "
    "prefetch; DeepSpeed: `overlap_comm`; your own collectives: `async_op=True` and wait just "
    "before the result is needed)."
)
SHARDING_FRAMEWORKS = ("fsdp1", "fsdp2", "deepspeed")


def _blocking_on_cpu(ctx: DetectorContext, fw: Framework | None) -> bool:
    """Whether the run's parameter gathers block the training thread as it runs: a CPU-only
    FSDP/ZeRO run without FSDP2's unshard async op (no side stream on CPU; as missing-overlap and
    whole-model-wrap judge it). An FSDP2 one is told to set that op (what it would hide there,
    beside compute on the same cores, is not predicted)."""
    return (
        ctx.sheet.cpu_only
        and fw is not None
        and fw.name in SHARDING_FRAMEWORKS
        and not ctx.sheet.gathers_can_overlap()
    )


CPU_OVERLAP_NOTE = (
    " On CPU/gloo (this run) collectives run on the host's threads and compete with compute for "
    "its cores: expect less overlap there than on GPUs."
)
CPU_ASYNC_OP_NOTE = (
    " On CPU/gloo (this run) FSDP2's gathers block the training thread until its unshard runs "
    "as an async op (`model._set_unshard_async_op(True)` on the root, a private API): gloo's worker thread then runs them, competing with compute for the host's "
    "cores; on GPUs the all-gather stream does it and that setting is not needed."
)


def _exposed_comm_advice(
    ctx: DetectorContext, fw: Framework | None, blocking: bool
) -> tuple[str, str | None, bool]:
    """What to change, in the run's framework `fw` when it is known (only settings the run does
    not already have), else for every framework; the CPU caveat on CPU-only runs (`blocking`: its
    gathers cannot overlap there at all). The flag: whether there is a change to propose."""
    text, code, has_remedy = GENERIC_OVERLAP_ADVICE, None, True
    if fw is not None:
        remedy = with_unshard_async_op(ctx.sheet, fw, fw.overlap(ctx.sheet.run_facts(fw)))
        if remedy is None:
            has_remedy = False
            text = (
                f"The run already sets every {fw.title} overlap option zdiag would propose: the "
                "communication stays exposed for another reason (message sizes, the interconnect, "
                "or collectives the framework issues only when their result is needed)."
            )
        else:
            text, code = f"Compute could hide this communication. {remedy.text}", remedy.code
    if lacks_unshard_async_op(ctx.sheet, fw):
        text += CPU_ASYNC_OP_NOTE
    elif fw is not None and blocking:
        text += (
            f" On CPU/gloo (this run) {fw.title}'s gathers block the training thread whatever "
            "these settings (FSDP2 overlaps there only with its unshard as an async op, "
            "`model._set_unshard_async_op(True)`, a private API): they pay off on GPUs."
        )
    elif ctx.sheet.cpu_only:
        text += CPU_OVERLAP_NOTE
    return text, code, has_remedy


_MOST_STEPS = (
    "Most steps over all ranks, not one outlier, carry the verdict (the verdict's own "
    "thresholds are in Report.thresholds: analyzers/rank/verdict.py)."
)

HOST_BOUND_RULE = Rule(
    id="host-bound",
    summary="the device idles waiting for the host in most steps",
    detect=detect_host_bound,
    what=(
        "At least half of all ranks' steps carry the `host-bound` verdict: the device idles "
        "waiting for the host for a large share of the step."
    ),
    why=(
        "A device waiting for its host does no work: data loading, host syncs or launch and "
        "Python overhead set the step time, and no communication or memory setting changes it."
    ),
    example=(
        "3 of 3 steps are host-bound: the device idles 61.0 ms of 80.2 ms per step (data "
        "loading 55.10 ms, host syncs 0.40 ms, launch, Python and other host work 5.50 ms)."
    ),
    fix=(
        "The largest part of the idle time: data loading (DataLoader workers, pin_memory), "
        "host syncs, or launch/Python overhead (torch.compile, CUDA graphs, larger "
        "micro-batches, fused optimizers). Where the run's step logs show the host's CPU cores "
        "full (analyzers/run/core_use.py), it says so and does not propose more DataLoader "
        "workers."
    ),
    gain=(
        "The largest cause's share of the idle per step: data loading from the "
        "`enumerate(DataLoader)` ranges, host syncs from their own host time, the rest of the "
        "idle (less any pipeline waits) as launch, Python and other host work. No finding "
        "when the pipeline waits are the largest part (the pipeline's bubble)."
    ),
    scope="any run with step markers (the per-step verdicts)",
    thresholds=(
        Threshold(
            "HOST_BOUND_STEP_SHARE",
            HOST_BOUND_STEP_SHARE,
            _MOST_STEPS,
            evidence="threshold_step_share",
        ),
    ),
)

EXPOSED_COMM_RULE = Rule(
    id="exposed-comm",
    summary="communication that compute could hide stays exposed in most steps",
    detect=detect_exposed_comm,
    what=(
        "At least half of the steps carry the `exposed-comm` verdict (communication exposed "
        "although compute could hide it) and no `straggler`, `missing-overlap`, `comm-bound` "
        "or wrap finding explains that time (the reconcile step drops it then)."
    ),
    why=(
        "A run whose steps are mostly exposed-comm must not end without a finding that says "
        "why and what to do, whatever its framework (DDP buckets, the user's own collectives)."
    ),
    example=(
        "3 of 3 steps have exposed communication: 30.0 ms per step of 40.0 ms communication is "
        "not hidden behind 60.0 ms compute (DDP with one large gradient bucket)."
    ),
    fix=(
        "The overlap settings of the run's framework it does not already have (FSDP2 "
        "prefetch, FSDP1 `forward_prefetch`/`BACKWARD_PRE`, DeepSpeed `overlap_comm` and "
        "prefetch bucket, DDP buckets; all of them when the framework is unknown); `info` with "
        "0 ms when the run already has all of them, and on CPU-only FSDP runs whose gathers "
        "cannot overlap (FSDP1; FSDP2 without its unshard async op), saying why; those FSDP2 "
        "runs are told to set that op (a private API), never that they have every setting."
    ),
    gain=(
        "For FSDP2, FSDP1 and ZeRO-3, whose remedy is prefetching: the what-if replay of that "
        "change, the figure missing-overlap gives (`zdiag whatif RUN --prefetch 1`, plus "
        "`--unshard-async-op` on a CPU FSDP2 run without it; docs/whatif.md); 0 where the "
        "gathers block the CPU training thread whatever the settings. Otherwise the exposed "
        "communication per step up to the compute not already overlapping communication "
        "(`overlap_gain_ms_per_step`, what perfect overlap could hide)."
    ),
    scope="any run with step markers (the per-step verdicts)",
    thresholds=(
        Threshold(
            "EXPOSED_COMM_STEP_SHARE",
            EXPOSED_COMM_STEP_SHARE,
            _MOST_STEPS,
            evidence="threshold_step_share",
        ),
    ),
)
