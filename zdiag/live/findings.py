"""The live monitor's findings: pure functions of the ranks' recent histories.

Each returns a `Finding` under the id `zdiag analyze` uses (``straggler``, ``memory-creep``,
``comm-bound``) or None. Thresholds are the named constants below; each finding reports the one
it used in its evidence.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence

from zdiag.analyzers.report import Finding
from zdiag.live.history import WINDOW_STEPS, RankState

STRAGGLER_RATIO = 1.25  # rank's recent median compute (else step) time vs. the job's median
STRAGGLER_MIN_EXCESS_MS = 2.0  # ... and at least this much slower in absolute terms
STRAGGLER_MIN_STEPS = 3
COMM_BOUND_RATIO = 1.0  # median comm_ms >= this x median compute_ms: overlap cannot hide it
MEMORY_CREEP_WARMUP_STEPS = 5
"""Steps 0..4 of a rank are left out: the first steps allocate the optimizer state, gradients and
the allocator's (or the process's) working set, a rise that stops by itself."""
MEMORY_CREEP_MIN_STEPS = 8  # samples after the warm-up
MEMORY_CREEP_WINDOW = 4 * WINDOW_STEPS  # recent samples the rule looks at
MEMORY_CREEP_MIN_BYTES = 16 * 1024 * 1024  # rise of the floor over the window
MEMORY_CREEP_MIN_FRACTION = 0.02  # ... and relative to the window's first floor
PROCESS_MEMORY = "process"
"""A rank whose memory figure is its process's RSS (CPU training without a memory reader) is not
judged: RSS also holds what the allocators cache, and a healthy 2-rank CPU harness run's RSS
floor rose 50-90 MiB over its first ~40 steps before levelling off, as rising as a leak."""
MEMORY_CREEP_PARTS = 4
"""The window is cut in this many parts; a leak raises the floor (minimum) of every part over
the one before. A plateau with noise, or allocations that come and go within steps (a sawtooth),
do not."""


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def stragglers(states: Iterable[RankState]) -> Finding | None:
    """Ranks whose recent compute time (step time when no split is sent) is well above the job's.

    In synchronous data parallel every rank's step time converges to the slowest one's (the others
    wait inside collectives), so the compute split is the better signal when the collectors have it.
    """
    states = list(states)
    key = "compute_ms" if all(s.recent("compute_ms") for s in states) else "step_time_ms"
    recents = {s.rank: s.recent(key) for s in states}
    medians = {r: statistics.median(v) for r, v in recents.items() if len(v) >= STRAGGLER_MIN_STEPS}
    if len(medians) < 2:
        return None
    job_median = statistics.median(medians.values())
    slow = sorted(
        (r for r, m in medians.items() if m > STRAGGLER_RATIO * job_median)
        if job_median > 0
        else [],
        key=lambda r: -medians[r],
    )
    slow = [r for r in slow if medians[r] - job_median >= STRAGGLER_MIN_EXCESS_MS]
    if not slow:
        return None
    worst = slow[0]
    ratio = medians[worst] / job_median
    hosts = sorted({s.host for s in states if s.rank in slow})
    return Finding(
        id="straggler",
        severity="critical" if ratio >= 2 else "warning",
        title=f"{len(slow)} straggler rank(s): rank {worst} is {ratio:.2f}x the job's median {key}",
        ranks=slow,
        evidence={
            "metric": key,
            "job_median_ms": round(job_median, 3),
            "rank_median_ms": {str(r): round(medians[r], 3) for r in slow[:16]},
            "hosts": hosts[:16],
            "threshold_ratio": STRAGGLER_RATIO,
            "window_steps": WINDOW_STEPS,
        },
        recommendation=(
            "Every collective waits for the slowest rank: check the straggler's host "
            "(throttling, other processes, a slower link) and its input (uneven batch or "
            "sequence lengths); profile a window with `zdiag run` and compare ranks with "
            "`zdiag analyze`."
        ),
        expected_gain_ms=round(medians[worst] - job_median, 3),
        gain_method="the straggler's median minus the job's median, per step",
    )


def memory_creep(states: Iterable[RankState]) -> Finding | None:
    """Ranks whose allocated memory floor rises through the recent window, part after part."""
    creeping: dict[int, float] = {}
    for s in states:
        per_step = floor_growth_per_step(s)
        if per_step is not None:
            creeping[s.rank] = per_step
    if not creeping:
        return None
    ranks = sorted(creeping, key=lambda r: -creeping[r])
    worst = creeping[ranks[0]]
    return Finding(
        id="memory-creep",
        severity="warning",
        title=f"allocated memory keeps growing on {len(ranks)} rank(s) "
        f"(up to {worst / 2**20:.1f} MiB/step)",
        ranks=ranks,
        evidence={
            "bytes_per_step": {str(r): round(creeping[r]) for r in ranks[:16]},
            "min_growth_bytes": MEMORY_CREEP_MIN_BYTES,
            "min_growth_fraction": MEMORY_CREEP_MIN_FRACTION,
            "window_parts": MEMORY_CREEP_PARTS,
            "warmup_steps": MEMORY_CREEP_WARMUP_STEPS,
        },
        recommendation=(
            "Something keeps tensors alive across steps: a loss or metric kept with its graph "
            "(store `loss.item()` or `loss.detach()`), a growing cache or list of outputs; take a "
            "memory snapshot with `zdiag run` before it runs out of memory."
        ),
        gain_method="",
    )


def floor_growth_per_step(state: RankState) -> float | None:
    """Bytes per step the allocated-memory floor rose by, or None when it does not creep.

    After the warm-up steps, the last `MEMORY_CREEP_WINDOW` samples are cut in
    `MEMORY_CREEP_PARTS` parts; memory creeps when each part's minimum is above the one before and
    the last part's minimum is `MEMORY_CREEP_MIN_BYTES` and `MEMORY_CREEP_MIN_FRACTION` above the
    first's. The rate is that rise over the steps between the first and last parts' starts.
    Not judged on process RSS (`PROCESS_MEMORY`).
    """
    if state.last.get("mem_source") == PROCESS_MEMORY:
        return None
    samples = [
        (st.step, float(st.mem_allocated_bytes))
        for st in state.steps
        if st.mem_allocated_bytes is not None and st.step >= MEMORY_CREEP_WARMUP_STEPS
    ][-MEMORY_CREEP_WINDOW:]
    if len(samples) < MEMORY_CREEP_MIN_STEPS:
        return None
    size = len(samples) / MEMORY_CREEP_PARTS
    parts = [samples[round(i * size) : round((i + 1) * size)] for i in range(MEMORY_CREEP_PARTS)]
    floors = [min(v for _, v in part) for part in parts]
    growth = floors[-1] - floors[0]
    steps = parts[-1][0][0] - parts[0][0][0]
    if not (math.isfinite(growth) and steps > 0):  # absurd (finite) values: no rate
        return None
    if (
        all(b > a for a, b in itertools.pairwise(floors))
        and growth >= MEMORY_CREEP_MIN_BYTES
        and growth >= MEMORY_CREEP_MIN_FRACTION * max(floors[0], 1.0)
    ):
        return growth / steps
    return None


def comm_bound(states: Iterable[RankState]) -> Finding | None:
    """Ranks whose communication takes at least as long as their compute (overlap cannot hide it)."""
    bound: dict[int, tuple[float, float, float]] = {}
    for s in states:
        pairs = [
            (float(st.comm_ms), float(st.compute_ms))
            for st in s.tail()
            if st.comm_ms is not None and st.compute_ms is not None
        ]
        if len(pairs) < STRAGGLER_MIN_STEPS:
            continue
        comm = statistics.median(p[0] for p in pairs)
        compute = statistics.median(p[1] for p in pairs)
        exposed = _median(s.recent("exposed_comm_ms"))
        if comm > 0 and comm >= COMM_BOUND_RATIO * compute:
            bound[s.rank] = (comm, compute, exposed or 0.0)
    if not bound:
        return None
    ranks = sorted(bound)
    comm, compute, exposed = (statistics.median(v[i] for v in bound.values()) for i in range(3))
    return Finding(
        id="comm-bound",
        severity="warning",
        title=f"communication ({comm:.1f} ms) outlasts compute ({compute:.1f} ms) on "
        f"{len(ranks)} rank(s): overlap cannot hide it",
        ranks=ranks,
        evidence={
            "median_comm_ms": round(comm, 3),
            "median_compute_ms": round(compute, 3),
            "median_exposed_comm_ms": round(exposed, 3),
            "threshold_ratio": COMM_BOUND_RATIO,
            "window_steps": WINDOW_STEPS,
        },
        recommendation=(
            "Move fewer bytes per step: a larger per-rank batch (or gradient accumulation), "
            "hybrid sharding (`fully_shard(..., mesh=2-D mesh)` / ZeRO++ hpZ) so all-gathers stay "
            "inside a node, or bf16 communication (`MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
            "reduce_dtype=torch.bfloat16)`)."
        ),
        expected_gain_ms=round(max(0.0, exposed), 3) or None,
        gain_method="upper bound: the median exposed communication per step",
    )
