"""Synthetic but realistic Reports for renderer tests, previews and docs (never used by analysis).

`sample_report()` is an 8-rank, 20-step FSDP2 run with one slow rank, exposed communication,
a few findings, FSDP units, a step timeline and a memory timeline. `hostile=True` puts markup in
every name read from traces (kernels, annotations, units, findings) to test escaping.
`empty_report()` is a Report with nothing in it.
"""

from __future__ import annotations

import random

from zdiag.analyzers.report import (
    CollectiveKindStats,
    Finding,
    FsdpUnit,
    MemoryTimeline,
    RankReport,
    Report,
    StepBreakdown,
    StepTimeline,
    StragglerStat,
    TimelineSpan,
)

# Markup that must never reach the page as markup (see tests/integration/ui/test_html_browser.py).
HOSTILE = (
    "<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\">"
    "</script><!--"
)

_MIB = 1024 * 1024


def empty_report() -> Report:
    """A Report with no ranks, findings or timelines (every renderer must cope)."""
    return Report(zdiag_version="0.0.0-test")


def _verdict(compute: float, comm: float, exposed: float, idle: float, dur: float) -> str:
    if idle > 0.3 * dur:
        return "host-bound"
    if comm > compute:
        return "comm-bound"
    if exposed > 0.15 * dur:
        return "exposed-comm"
    return "compute-bound"


def sample_report(
    ranks: int = 8,
    steps: int = 20,
    *,
    hostile: bool = False,
    units: int = 6,
    seed: int = 7,
    timeline_spans: int = 40,
) -> Report:
    """A deterministic synthetic Report of `ranks` x `steps` (see the module docstring)."""
    rng = random.Random(seed)
    tag = HOSTILE if hostile else ""
    slow_rank = min(3, ranks - 1)
    rank_summaries = _rank_reports(rng, ranks, steps, tag, slow_rank)
    fsdp_units = _fsdp_units(ranks, steps, units, tag)
    collectives = _collectives(ranks, steps)
    findings = _findings(ranks, steps, units, tag, slow_rank)
    stragglers = _stragglers(ranks, steps, slow_rank)
    timelines = _timelines(ranks, steps, tag, timeline_spans)
    memory = _memory(ranks, tag)
    return Report(
        zdiag_version="0.0.0-test",
        inputs=[f"/runs/sample/rank-{r}{tag}.json.gz" for r in range(ranks)],
        ranks=rank_summaries,
        findings=findings,
        fsdp_units=fsdp_units,
        collectives=collectives,
        stragglers=stragglers,
        timelines=timelines,
        memory=memory,
        thresholds={"exposed_comm_fraction": 0.15, "idle_fraction": 0.3},
        warnings=[f"rank 0: 2 steps had no ProfilerStep annotation{tag}"],
        run={"world_size": ranks, "framework": "fsdp2", "torch": "2.6.0", "model": f"llama{tag}"},
    )


def _rank_reports(
    rng: random.Random, ranks: int, steps: int, tag: str, slow_rank: int
) -> list[RankReport]:
    """Per rank, its step table (the only part drawn from `rng`)."""
    rank_summaries = []
    for r in range(ranks):
        start = 0.0
        rows = []
        for s in range(steps):
            compute = 80.0 + rng.uniform(-4, 4) + (25.0 if r == slow_rank else 0.0)
            comm = 30.0 + rng.uniform(-3, 3) + (10.0 if s % 7 == 3 else 0.0)
            overlapped = comm * (0.45 if r != slow_rank else 0.6)
            exposed = comm - overlapped
            idle = 4.0 + rng.uniform(0, 2) + (60.0 if s == 0 else 0.0)
            memcpy = 1.5
            dur = compute + exposed + idle + memcpy
            verdict = _verdict(compute, comm, exposed, idle, dur)
            rows.append(
                StepBreakdown(
                    step=s,
                    start_ms=round(start, 3),
                    duration_ms=round(dur, 3),
                    compute_ms=round(compute, 3),
                    comm_ms=round(comm, 3),
                    overlapped_ms=round(overlapped, 3),
                    exposed_comm_ms=round(exposed, 3),
                    memcpy_ms=memcpy,
                    idle_ms=round(idle, 3),
                    host_launch_ms=round(idle * 0.5, 3),
                    kernel_count=420 + s,
                    verdict=verdict,
                    verdict_reason=f"exposed {exposed:.1f} ms = {exposed / dur:.0%} of step "
                    "(threshold 15%)",
                )
            )
            start += dur + 0.5
        rank_summaries.append(
            RankReport(
                rank=r,
                source=f"rank-{r}{tag}.json.gz",
                device="cuda",
                host=f"node{r // 8}",
                lanes=["stream 7", "stream 20"],
                trace_start_us=1_700_000_000_000.0 + r * 137.0,
                steps=rows,
                warnings=["2 steps had no ProfilerStep annotation"] if r == 0 else [],
            )
        )
    return rank_summaries


def _fsdp_units(ranks: int, steps: int, units: int, tag: str) -> list[FsdpUnit]:
    """The FSDP unit ledger: the root and `units - 1` layers on every rank."""
    unit_names = [""] + [f"layers.{i}{tag}" for i in range(max(units - 1, 0))]
    fsdp_units = [
        FsdpUnit(
            name=name,
            rank=r,
            param_bytes=(64 if name == "" else 48) * _MIB,
            all_gather_count=2 * steps,
            all_gather_bytes=(64 if name == "" else 48) * _MIB * 2 * steps // ranks,
            all_gather_ms=3.1 * steps,
            reduce_count=steps,
            reduce_bytes=(64 if name == "" else 48) * _MIB * steps // ranks,
            reduce_ms=2.2 * steps,
            exposed_wait_ms=(9.0 if i == 1 else 1.2 + 0.3 * i) * steps / 10 + 0.1 * r,
            gather_lead_ms=-0.4 if i == 1 else 2.5,
        )
        for r in range(ranks)
        for i, name in enumerate(unit_names)
    ]
    return fsdp_units


def _collectives(ranks: int, steps: int) -> list[CollectiveKindStats]:
    """All-gathers and reduce-scatters per rank."""
    collectives = [
        CollectiveKindStats(
            rank=r,
            kind=kind,
            count=n * steps,
            total_bytes=n * steps * 48 * _MIB,
            total_ms=ms * steps,
            exposed_ms=ms * steps * 0.5,
            dtypes=["bfloat16"],
        )
        for r in range(ranks)
        for kind, n, ms in (("all_gather", 12, 18.0), ("reduce_scatter", 6, 12.0))
    ]
    return collectives


def _findings(ranks: int, steps: int, units: int, tag: str, slow_rank: int) -> list[Finding]:
    """One critical, one warning and one info finding."""
    findings = [
        Finding(
            id="missing-overlap",
            severity="critical",
            title=f"All-gathers of layers.0{tag} are issued only when compute needs them",
            ranks=list(range(ranks)),
            steps=list(range(1, steps)),
            units=[f"layers.0{tag}"] if units > 1 else [],
            evidence={"exposed_comm_ms_per_step": 16.4, "gather_lead_ms": -0.4, "kernel": tag},
            recommendation="Prefetch the next layer's parameters during the current layer's forward.",
            code="for i in range(len(model.layers) - 1):\n"
            "    model.layers[i].set_modules_to_forward_prefetch([model.layers[i + 1]])",
            expected_gain_ms=12.5,
            gain_method="exposed all-gather time that fits under the previous layer's compute",
        ),
        Finding(
            id="straggler",
            severity="warning",
            title=f"Rank {slow_rank} is last at 92% of collectives",
            ranks=[slow_rank],
            evidence={"last_arrivals": 92, "mean_skew_ms": 24.8},
            recommendation="Check the slow rank's host for contention or a slower GPU.",
            expected_gain_ms=20.0,
            gain_method="skew removed from every collective",
        ),
        Finding(
            id="first-step-warmup",
            severity="info",
            title="Step 0 includes warm-up (allocator, NCCL init)",
            steps=[0],
            evidence={"idle_ms": 64.0},
            recommendation="Exclude the first step from measurements (profiler schedule warmup=1).",
        ),
    ]
    return findings


def _stragglers(ranks: int, steps: int, slow_rank: int) -> list[StragglerStat]:
    """The straggler table: `slow_rank` is last at most collectives."""
    stragglers = [
        StragglerStat(
            rank=r,
            matched_collectives=18 * steps,
            last_arrivals=(331 if r == slow_rank else 4),
            wait_caused_ms=(490.0 if r == slow_rank else 3.0),
            mean_skew_ms=(24.8 if r == slow_rank else 0.3),
        )
        for r in range(ranks)
    ]
    return stragglers


def _timelines(ranks: int, steps: int, tag: str, timeline_spans: int) -> list[StepTimeline]:
    """One step of up to 4 ranks as spans."""
    timelines = []
    chosen = min(5, steps - 1)
    for r in range(min(ranks, 4)) if steps else ():
        spans: list[TimelineSpan] = []
        t = 0.0
        for k in range(timeline_spans):
            dur = 1.5 + (k % 5) * 0.4
            spans.append(TimelineSpan("compute", f"sm90_xmma_gemm_bf16{tag}_{k % 3}", t, dur))
            if k % 4 == 0:
                spans.append(
                    TimelineSpan("comm:all_gather", f"ncclDevKernel_AllGather{tag}", t + 0.5, 2.6)
                )
            if k % 8 == 2:
                spans.append(
                    TimelineSpan("comm:reduce_scatter", "ncclDevKernel_ReduceScatter", t, 3.0)
                )
            if k % 10 == 0:
                spans.append(
                    TimelineSpan("fsdp", f"FSDP::pre_forward (layers.{k // 10}{tag})", t, 9)
                )
            if k % 13 == 5:
                spans.append(TimelineSpan("memcpy", "Memcpy HtoD (Pageable -> Device)", t, 0.4))
            t += dur + 0.3
        timelines.append(StepTimeline(rank=r, step=chosen, spans=spans, truncated=r == 0))
    return timelines


def _memory(ranks: int, tag: str) -> list[MemoryTimeline]:
    """Memory timelines of up to 2 ranks."""
    memory = []
    for r in range(min(ranks, 2)):
        times = [i * 2.0 for i in range(120)]
        act = [int((i % 60) * 0.6 * 1024 * _MIB / 60) for i in range(120)]
        memory.append(
            MemoryTimeline(
                rank=r,
                source="memory_timeline",
                times_ms=times,
                bytes_by_category={
                    "PARAMETER": [512 * _MIB] * 120,
                    "GRADIENT": [(256 * _MIB if i % 60 > 30 else 0) for i in range(120)],
                    f"ACTIVATION{tag}": act,
                },
                peak_bytes=512 * _MIB + 256 * _MIB + max(act),
                peak_category_bytes={"ACTIVATION": max(act)},
                capacity_bytes=2048 * _MIB,
            )
        )
    return memory
