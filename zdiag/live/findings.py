"""The live monitor's findings: pure functions of the ranks' recent histories.

Each returns a `Finding` (``straggler`` and ``comm-bound``, the ids `zdiag analyze` uses, and the
monitor's own ``memory-creep``) or None, and reports the thresholds it used in its evidence. The straggler and
comm-bound rules use the analyzers' thresholds (imported, never copied); where the live records
cannot carry what the analyzers judge, the rule differs as follows.

``straggler`` (`zdiag.analyzers.run.crossrank`). The analyzers name a rank that arrives last at
the matched collectives, beyond chance, and make the others wait. The live records carry no
arrival times, so the monitor judges what a rank sends: its own work per step, the compute split
(the step minus its waits: a late rank computes longer, its peers wait), else the step time. A
rank is a straggler when, over the last `WINDOW_STEPS` steps (at least
`STRAGGLER_PERSISTENT_MIN_STEPS`), its median is at least ``1 + UNEVEN_WORK_SHARE`` times the
other ranks' median (the analyzers' "uneven work" share), and the excess, what every other rank
waits for it per step (the analyzers' gain), is at least ``max(STRAGGLER_MIN_GAIN_MS,
STRAGGLER_MIN_GAIN_SHARE x the median step)``; when every rank trains on the CPUs of one host
(each sends ``mem_source: process`` from one host name) at least
``STRAGGLER_SHARED_HOST_MIN_GAIN_SHARE`` of the step, as in the analyzers. The finding is
critical when the worst straggler's excess is at least ``STRAGGLER_CRITICAL_GAIN_SHARE`` of the
median step (never on one shared CPU host; the others wait for the slowest rank only, so the
excesses are not added up). No chance test: a median over ten steps, not a count
of last arrivals, is what the live records allow.

``comm-bound`` (`zdiag.analyzers.rank.verdict`, `zdiag.analyzers.detectors.comm_bound`); `info`
when every rank trains on one host's CPUs (`one_cpu_host`): there a collective's time includes
the peers' wait for a core, which no change of communication would remove. Every
step with the whole split gets the analyzers' step verdict (`verdict.decide`, when its record is
folded in: `history.step_verdict`; the live idle is the step beyond compute and exposed comm); the job is comm-bound when at least
``COMM_BOUND_STEP_SHARE`` of the window's steps, all ranks together, are. The analyzers judge only
runs with FSDP/ZeRO traffic and the device's split; the live split is the host's (the collectors'
`comm_split`: waits and collectives in flight), and the framework is unknown, so any job's
communication counts. A rank is judged once it sent `COMM_BOUND_MIN_STEPS` steps with the split.

``memory-creep`` has no rule of `zdiag analyze` to follow (a profiled window of a few steps
cannot show a floor rising); its thresholds are the constants below.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Iterable, Sequence

from zdiag.analyzers.rank.verdict import (
    COMM_BOUND_COMM_TO_COMPUTE,
    COMM_BOUND_STEP_SHARE,
    HOST_BOUND_IDLE_FRACTION,
    MIN_EXPOSED_FRACTION,
)
from zdiag.analyzers.report import Finding
from zdiag.analyzers.run.stragglers import (
    STRAGGLER_CRITICAL_GAIN_SHARE,
    STRAGGLER_MIN_GAIN_MS,
    STRAGGLER_MIN_GAIN_SHARE,
    STRAGGLER_PERSISTENT_MIN_STEPS,
    STRAGGLER_SHARED_HOST_MIN_GAIN_SHARE,
    UNEVEN_WORK_SHARE,
)
from zdiag.live.history import WINDOW_STEPS, RankState

COMM_BOUND_MIN_STEPS = 3
"""Steps with the whole split a rank needs before its steps count (the analyzers judge a finished
window; live, one rank's first step alone decides nothing)."""
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
floor rose 50-90 MiB over its first ~40 steps before levelling off, as rising as a leak.
Ranks that all send it from one host are the analyzers' "shared CPU host" for the straggler rule."""
MEMORY_CREEP_PARTS = 4
"""The window is cut in this many parts; a leak raises the floor (minimum) of every part over
the one before. A plateau with noise, or allocations that come and go within steps (a sawtooth),
do not."""


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _median_without(ordered: Sequence[float], i: int) -> float:
    """The median of sorted `ordered` without its element `i` (needs two elements or more)."""
    m = len(ordered) - 1

    def at(p: int) -> float:
        return ordered[p if p < i else p + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def one_cpu_host(states: Sequence[RankState]) -> bool:
    """Whether every rank trains on the CPUs of one host: each sends its process RSS (no device
    allocator, no memory reader) under one host name (the analyzers' shared CPU host)."""
    return len({s.host for s in states}) == 1 and all(
        s.last.get("mem_source") == PROCESS_MEMORY for s in states
    )


def stragglers(states: Iterable[RankState]) -> Finding | None:
    """Ranks whose own work per step (compute, else step time) makes the others wait, on the
    analyzers' thresholds (the rule, and where it differs from theirs: the module docstring).

    In synchronous data parallel every rank's step time converges to the slowest one's (the others
    wait inside collectives), so the compute split is the better signal when the collectors have it.
    """
    states = list(states)
    compute_ms = {s.rank: s.recent("compute_ms") for s in states}
    key = "compute_ms" if all(compute_ms.values()) else "step_time_ms"
    recents = compute_ms if key == "compute_ms" else {s.rank: s.recent(key) for s in states}
    medians = {
        r: float(statistics.median(v))
        for r, v in recents.items()
        if len(v) >= STRAGGLER_PERSISTENT_MIN_STEPS
    }
    if len(medians) < 2:
        return None
    ordered = sorted(medians.values())
    others = {
        r: _median_without(ordered, bisect.bisect_left(ordered, m)) for r, m in medians.items()
    }
    slow = [
        r for r, m in medians.items() if others[r] > 0 and m >= (1 + UNEVEN_WORK_SHARE) * others[r]
    ]
    if not slow:  # the usual case: the step times and hosts below are not needed
        return None
    step_ms = (
        recents.values() if key == "step_time_ms" else (s.recent("step_time_ms") for s in states)
    )
    median_step = float(_median([v for vs in step_ms for v in vs]) or 0.0)
    shared_host = one_cpu_host(states)
    min_gain = max(STRAGGLER_MIN_GAIN_MS, STRAGGLER_MIN_GAIN_SHARE * median_step)
    if shared_host:
        min_gain = max(min_gain, STRAGGLER_SHARED_HOST_MIN_GAIN_SHARE * median_step)
    slow = sorted(
        (r for r in slow if medians[r] - others[r] >= min_gain),
        key=lambda r: (others[r] - medians[r], r),
    )
    if not slow:
        return None
    worst, slow_set = slow[0], set(slow)
    gain = medians[worst] - others[worst]
    critical = (
        not shared_host and median_step > 0 and gain >= STRAGGLER_CRITICAL_GAIN_SHARE * median_step
    )
    return Finding(
        id="straggler",
        severity="critical" if critical else "warning",
        title=f"{len(slow)} straggler rank(s): rank {worst}'s {key} is "
        f"{medians[worst] / others[worst]:.2f}x the other ranks' median",
        ranks=slow,
        evidence={
            "metric": key,
            "median_step_ms": round(median_step, 3),
            "rank_median_ms": {str(r): round(medians[r], 3) for r in slow[:16]},
            "others_median_ms": {str(r): round(others[r], 3) for r in slow[:16]},
            "hosts": sorted({s.host for s in states if s.rank in slow_set})[:16],
            "shared_cpu_host": shared_host,
            "min_excess_share": UNEVEN_WORK_SHARE,
            "min_gain_ms_per_step": round(min_gain, 4),
            "critical_gain_share": STRAGGLER_CRITICAL_GAIN_SHARE,
            "window_steps": WINDOW_STEPS,
        },
        recommendation=(
            "Every collective waits for the slowest rank: check the straggler's host "
            "(throttling, other processes, a slower link) and its input (uneven batch or "
            "sequence lengths); profile a window with `zdiag run` and compare ranks with "
            "`zdiag analyze`."
        ),
        expected_gain_ms=round(gain, 3),
        gain_method="the worst straggler's median minus the other ranks' median, per step",
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
    """Most recent steps, all ranks together, comm-bound by the analyzers' step verdict: their
    communication outlasts compute, and enough of it is exposed (overlap cannot hide it)."""
    states = list(states)
    verdicts = {s.rank: v for s in states if len(v := s.verdicts()) >= COMM_BOUND_MIN_STEPS}
    n = sum(len(v) for v in verdicts.values())
    bound = sum(v.count("comm-bound") for v in verdicts.values())
    if not n or bound / n < COMM_BOUND_STEP_SHARE:
        return None
    ranks = sorted(r for r, v in verdicts.items() if "comm-bound" in v)
    judged = [s for s in states if s.rank in ranks]
    shared_host = one_cpu_host(states)
    comm, compute, exposed = (
        statistics.median(_median(s.recent(k)) or 0.0 for s in judged)
        for k in ("comm_ms", "compute_ms", "exposed_comm_ms")
    )
    return Finding(
        id="comm-bound",
        # ranks sharing one host's CPUs (more ranks than cores, as in a CPU test job) wait in
        # each collective for their peers to get a core: that wait is not traffic
        severity="info" if shared_host else "warning",
        title=f"{bound} of {n} recent steps are comm-bound: communication ({comm:.1f} ms) "
        f"outlasts compute ({compute:.1f} ms) on {len(ranks)} rank(s), overlap cannot hide it",
        ranks=ranks,
        evidence={
            "comm_bound_steps": bound,
            "steps": n,
            "median_comm_ms": round(comm, 3),
            "median_compute_ms": round(compute, 3),
            "median_exposed_comm_ms": round(exposed, 3),
            "comm_bound_comm_to_compute": COMM_BOUND_COMM_TO_COMPUTE,
            "min_exposed_fraction": MIN_EXPOSED_FRACTION,
            "host_bound_idle_fraction": HOST_BOUND_IDLE_FRACTION,
            "threshold_step_share": COMM_BOUND_STEP_SHARE,
            "shared_cpu_host": shared_host,
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
