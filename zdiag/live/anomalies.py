"""The live anomaly rules: what goes wrong late in a long job, judged from the step records.

Pure functions of the ranks' recent histories (`history.RankState`), like `findings`:

- **Persistence of a straggler** (`straggler_persistence`): over the last `PERSISTENCE_STEPS`
  steps every rank sent, the rank whose own work (compute, else step time) exceeds the other
  ranks' median of that step by the straggler rule's minimum gain is that step's culprit. The
  straggler the window rule named is **chronic** when it is the culprit of at least
  `CHRONIC_SHARE` of those steps, else **transient**; `culprit_stability` is that share. The live
  records carry no arrival times at collectives: a rank's own work per step is what they allow
  (`findings` says the same of the straggler rule).
- **slow-step**: a rank's last step took at least `SLOW_STEP_FACTOR` times its own median over
  the `WINDOW_STEPS` steps before it (at least `SLOW_STEP_MIN_HISTORY` of them), and the excess
  is at least the straggler rule's `STRAGGLER_MIN_GAIN_MS` (a one-step spike: a checkpoint, a
  data stall, a page-cache flush).
- **step-time-creep**: the job's step time (the slowest rank's, per step) rises through the last
  `CREEP_WINDOW` steps after the first `CREEP_WARMUP_STEPS`: cut in `CREEP_PARTS` parts, each
  part's median above the one before by at least `CREEP_MIN_PART_RISE` and by more than the
  step-to-step noise (half the interquartile range) of either part, and the last part's at
  least `CREEP_MIN_SHARE` above the first's (the memory-creep rule's shape, on time; a single
  jump, or a drift inside the noise of a busy host, is not a creep).
- **stall**: a rank sent nothing for longer than the monitor's stale limit (`state.STALE_AFTER_S`,
  or `STALE_STEPS` of its own step times) while other ranks still report, and its hang
  watchdog has not fired: a stall below the hang timeout.

The straggler thresholds are the analyzers' (`zdiag.analyzers.run.stragglers`); the others have no
rule in `zdiag analyze` (a profiled window of a few steps cannot show them) and are named here.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from zdiag.analyzers.compare.spread import half_iqr
from zdiag.analyzers.report import Finding
from zdiag.analyzers.run.stragglers import STRAGGLER_MIN_GAIN_MS, STRAGGLER_PERSISTENT_MIN_STEPS
from zdiag.live.history import WINDOW_STEPS, RankState

PERSISTENCE_STEPS = 2 * WINDOW_STEPS
"""Recent steps the chronic/transient judgement looks at."""
CHRONIC_SHARE = 0.6
"""A straggler that is the culprit of at least this share of those steps is chronic."""
SLOW_STEP_FACTOR = 2.0
SLOW_STEP_MIN_HISTORY = 5
CREEP_WARMUP_STEPS = 5
CREEP_WINDOW = 4 * WINDOW_STEPS
CREEP_MIN_STEPS = 12
CREEP_PARTS = 4
CREEP_MIN_SHARE = 0.15
CREEP_MIN_PART_RISE = CREEP_MIN_SHARE / (2 * (CREEP_PARTS - 1))
"""Each part's median must be this much above the one before (2.5%): a creep rises all along,
a step change (a rank slowed at one step) rises once and is the straggler rule's."""


def _by_step(states: Sequence[RankState], key: str) -> dict[int, dict[int, float]]:
    """{step: {rank: value}} over the ranks' kept samples (values present only)."""
    out: dict[int, dict[int, float]] = {}
    for s in states:
        for sample in s.steps:
            value = getattr(sample, key)
            if value is not None:
                out.setdefault(sample.step, {})[s.rank] = float(value)
    return out


def straggler_persistence(
    states: Sequence[RankState], rank: int, metric: str, min_gain_ms: float
) -> dict[str, object]:
    """Whether `rank` is a chronic or a transient straggler (see the module docstring): the
    evidence to add to the straggler finding."""
    table = _by_step(states, metric)
    full = [s for s in sorted(table) if len(table[s]) == len(states)][-PERSISTENCE_STEPS:]
    culprits: list[int] = []
    for step in full:
        values = table[step]
        worst = max(values, key=lambda r: (values[r], -r))
        others = [v for r, v in values.items() if r != worst]
        if others and values[worst] - statistics.median(others) >= min_gain_ms:
            culprits.append(worst)
    stability = culprits.count(rank) / len(full) if full else 0.0
    chronic = len(full) >= STRAGGLER_PERSISTENT_MIN_STEPS and stability >= CHRONIC_SHARE
    return {
        "persistence": "chronic" if chronic else "transient",
        "culprit_stability": round(stability, 3),
        "persistence_steps": len(full),
        "chronic_share": CHRONIC_SHARE,
    }


def with_persistence(finding: Finding, states: Sequence[RankState]) -> Finding:
    """The straggler finding with its worst rank judged chronic or transient (its title says
    which, its evidence why)."""
    metric = str(finding.evidence.get("metric", "step_time_ms"))
    min_gain = float(finding.evidence.get("min_gain_ms_per_step", STRAGGLER_MIN_GAIN_MS))
    judged = straggler_persistence(states, finding.ranks[0], metric, min_gain)
    return msgspec.structs.replace(
        finding,
        title=f"{judged['persistence']} straggler: {finding.title}",
        evidence={**finding.evidence, **judged},
    )


def slow_steps(states: Iterable[RankState]) -> Finding | None:
    """Ranks whose last step took `SLOW_STEP_FACTOR` times their recent median or more."""
    slow: dict[int, tuple[int, float, float]] = {}
    for s in states:
        tail = [t for t in s.tail(WINDOW_STEPS + 1) if t.step_time_ms is not None]
        if len(tail) < SLOW_STEP_MIN_HISTORY + 1:
            continue
        last, before = tail[-1], [float(t.step_time_ms or 0.0) for t in tail[:-1]]
        median = statistics.median(before)
        ms = float(last.step_time_ms or 0.0)
        if median > 0 and ms >= SLOW_STEP_FACTOR * median and ms - median >= STRAGGLER_MIN_GAIN_MS:
            slow[s.rank] = (last.step, ms, median)
    if not slow:
        return None
    ranks = sorted(slow, key=lambda r: -(slow[r][1] / slow[r][2]))
    step, ms, median = slow[ranks[0]]
    return Finding(
        id="slow-step",
        severity="warning",
        title=f"a slow step on {len(ranks)} rank(s): rank {ranks[0]}'s step {step} took "
        f"{ms:.0f} ms, {ms / median:.1f}x its recent median ({median:.0f} ms)",
        ranks=ranks,
        steps=sorted({slow[r][0] for r in ranks}),
        evidence={
            "step_ms": {str(r): round(slow[r][1], 3) for r in ranks[:16]},
            "recent_median_ms": {str(r): round(slow[r][2], 3) for r in ranks[:16]},
            "factor": SLOW_STEP_FACTOR,
            "min_excess_ms": STRAGGLER_MIN_GAIN_MS,
            "window_steps": WINDOW_STEPS,
        },
        recommendation=(
            "One step stalled: look for what runs every N steps (checkpointing, evaluation, "
            "logging that syncs) or a data-loader stall; `zdiag run --profile-steps` on that "
            "step shows where it went."
        ),
        gain_method="",
    )


def step_time_creep(states: Iterable[RankState]) -> Finding | None:
    """The job's step time rising part after part through the recent window."""
    states = list(states)
    table = _by_step(states, "step_time_ms")
    job = [(s, max(v.values())) for s, v in sorted(table.items()) if s >= CREEP_WARMUP_STEPS]
    job = job[-CREEP_WINDOW:]
    if len(job) < CREEP_MIN_STEPS:
        return None
    size = len(job) / CREEP_PARTS
    parts = [job[round(i * size) : round((i + 1) * size)] for i in range(CREEP_PARTS)]
    values = [[v for _, v in part] for part in parts]
    medians = [statistics.median(v) for v in values]
    noise = [half_iqr(v) for v in values]
    rise = medians[-1] / medians[0] - 1 if medians[0] > 0 else 0.0
    steady = all(
        b - a >= max(a * CREEP_MIN_PART_RISE, noise[i], noise[i + 1])
        for i, (a, b) in enumerate(itertools.pairwise(medians))
    )
    if not (steady and rise >= CREEP_MIN_SHARE):
        return None
    return Finding(
        id="step-time-creep",
        severity="warning",
        title=f"step time keeps rising: {medians[0]:.0f} -> {medians[-1]:.0f} ms "
        f"(+{100 * rise:.0f}%) over steps {job[0][0]}-{job[-1][0]}",
        ranks=sorted(s.rank for s in states),
        evidence={
            "part_medians_ms": [round(m, 3) for m in medians],
            "first_step": job[0][0],
            "last_step": job[-1][0],
            "min_rise_share": CREEP_MIN_SHARE,
            "parts": CREEP_PARTS,
            "warmup_steps": CREEP_WARMUP_STEPS,
        },
        recommendation=(
            "Something grows with the steps: a cache or list kept across steps, memory "
            "fragmentation (watch `memory-creep`), a data pipeline falling behind, or thermal "
            "throttling; diff a late profile against an early one (`zdiag diff`)."
        ),
        gain_method="",
    )


def stalls(states: Iterable[RankState], statuses: Mapping[int, str], now: float) -> Finding | None:
    """Ranks that stopped reporting (status "stale") while others still report, their hang
    watchdog silent: a stall below the hang timeout."""
    stalled = sorted(s.rank for s in states if statuses.get(s.rank) == "stale")
    if not stalled or not any(st == "ok" for st in statuses.values()):
        return None
    ages = {s.rank: now - s.last_recv for s in states if s.rank in stalled}
    return Finding(
        id="stall",
        severity="warning",
        title=f"{len(stalled)} rank(s) stopped reporting while the others go on: rank "
        f"{stalled[0]} silent for {ages[stalled[0]]:.1f} s, below the hang timeout",
        ranks=stalled,
        evidence={"silent_s": {str(r): round(ages[r], 2) for r in stalled[:16]}},
        recommendation=(
            "A rank is stuck outside a collective (I/O, a deadlock in the data loader, a Python "
            "lock) or in one its peers have not reached; if it lasts, the hang watchdog dumps "
            "its stack (`zdiag run --hang-timeout`)."
        ),
        gain_method="",
    )
