"""The straggler ranking: who arrives last at the matched collectives, and the `straggler` finding.

Reads the cross-rank matching (`crossrank.CrossRankResult`, built by `crossrank_match`):
`straggler_stats(result)` is the Report's per-rank table, `find_stragglers(result, breakdowns)`
the `straggler` finding, past the thresholds below (see crossrank.py's docstring for the
matching, the clock alignment and the skew they start from). On a 2-D or 3-D mesh a rank is
judged only against the ranks it shares a process group with (`straggler_groups.RankPeers`), and
a straggler is named once, with the groups it delays.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..report import Finding, StepBreakdown, StragglerStat
from .crossrank import (
    END_MATCH_MIN_TOL_US,
    END_MATCH_REL_TOL,
    SKEW_NOISE_US,
    CrossRankResult,
    FloatArray,
    IntArray,
    MatchTable,
)
from .straggler_groups import RankPeers

# --- thresholds (named, with their reasoning; reported in the finding's evidence) -----------

STRAGGLER_MIN_LAST_SHARE = 0.5
STRAGGLER_CHANCE_FACTOR = 1.5
"""A rank is a straggler candidate when it arrives last at >= max(50%, 1.5 x 1/N) of the
matched collectives (with a skew above the noise) it takes part in. By chance each of N ranks
is last 1/N of the time; 1.5x chance and a majority keep ordinary jitter out (with 2 ranks:
75%)."""

STRAGGLER_MAX_CHANCE_P = 0.05
"""...and when a rank no slower than the others would be last that often with probability below
5% (binomial tail at 1/N per collective): 4 last arrivals out of 5 with 2 ranks (p = 0.19) is
not evidence, 5 out of 5 (p = 0.03) is."""

STRAGGLER_MIN_GAIN_SHARE = 0.02
STRAGGLER_MIN_GAIN_MS = 0.1
"""...and when its lateness costs every rank at least 2% of the median step time (and 0.1 ms)
per step: below that, chasing it is not worth an engineer's afternoon."""

STRAGGLER_PERSISTENT_STEP_SHARE = 0.8
STRAGGLER_PERSISTENT_WAIT_SHARE = 0.10
STRAGGLER_DOMINANCE = 3.0
"""The second way to be a straggler, for a rank late once per step by a lot (a rank that sleeps
before each step is last at one collective per step, well under the share rule): in at least 80%
of the covered steps (all 3 of a default window) the waiting it causes (its lead over the next arrival, summed over the step's
collectives where it is last) is at least 10% of the median step (and the minimum gain), and over
the window it causes at least 3x the waiting any other rank causes. A profiler window covers few
steps (3 by default), too few for a chance test per step, hence the 10% magnitude. Ordinary
jitter spreads the waiting caused over all ranks (each causes about the same), so a 3x dominance
that persists over most steps is a cause, not chance. Both are judged from the arrivals of all ranks, never from one waiting rank's
exposed time."""

STRAGGLER_PERSISTENT_MIN_STEPS = 3
"""Steps the persistent-wait rule needs: over fewer, one of two ranks being the later in every
step is a coin toss (the share rule still applies)."""

STRAGGLER_SHARED_HOST_MIN_GAIN_SHARE = 0.20
"""Ranks sharing one CPU host compete for its cores: one of them is routinely later than the
others by several percent of the step, consistently over a short window (9% on a healthy FSDP1
run of the user zoo, 2 ranks on 2 shared cores). There a straggler must cost at least 20% of the
step, twice that contention; a rank that sleeps or loads data slowly costs far more. And it must
show its own cause: compute plus idle per step above the other ranks' medians by at least half
the wait it causes (STRAGGLER_OWN_CAUSE_SHARE), in most steps (STRAGGLER_PERSISTENT_STEP_SHARE: a
rank stalled in one step by the loaded host is not a straggler). A rank late although it computes and idles as
much as the others lost the time in its collectives, to the shared cores (a 2-rank FSDP1 run on
the loaded 2-core box: late at 76% of collectives by 35 ms per step, compute and idle within
0.5 ms of the other rank's)."""

STRAGGLER_OWN_CAUSE_SHARE = 0.5

STRAGGLER_CRITICAL_GAIN_SHARE = 0.10
"""A straggler costing >= 10% of the step time is critical; below, a warning."""

UNEVEN_WORK_SHARE = 0.10
"""The straggler's compute per step exceeding the other ranks' median by >= 10% points to uneven
work or a slower device; its device idling more than theirs by >= 10% of the median step time
(while computing about as much) points to the host side (its device waits for its CPU)."""


def thresholds() -> dict[str, float]:
    """The thresholds above by name (for Report.thresholds and the finding's evidence)."""
    return {
        "straggler_skew_noise_us": SKEW_NOISE_US,
        "straggler_end_match_min_tol_us": END_MATCH_MIN_TOL_US,
        "straggler_end_match_rel_tol": END_MATCH_REL_TOL,
        "straggler_min_last_share": STRAGGLER_MIN_LAST_SHARE,
        "straggler_persistent_step_share": STRAGGLER_PERSISTENT_STEP_SHARE,
        "straggler_persistent_wait_share": STRAGGLER_PERSISTENT_WAIT_SHARE,
        "straggler_dominance": STRAGGLER_DOMINANCE,
        "straggler_persistent_min_steps": STRAGGLER_PERSISTENT_MIN_STEPS,
        "straggler_shared_host_min_gain_share": STRAGGLER_SHARED_HOST_MIN_GAIN_SHARE,
        "straggler_own_cause_share": STRAGGLER_OWN_CAUSE_SHARE,
        "straggler_chance_factor": STRAGGLER_CHANCE_FACTOR,
        "straggler_max_chance_p": STRAGGLER_MAX_CHANCE_P,
        "straggler_min_gain_share": STRAGGLER_MIN_GAIN_SHARE,
        "straggler_min_gain_ms": STRAGGLER_MIN_GAIN_MS,
        "straggler_critical_gain_share": STRAGGLER_CRITICAL_GAIN_SHARE,
    }


# --- ranking --------------------------------------------------------------------------------


def straggler_stats(result: CrossRankResult) -> list[StragglerStat]:
    """Per rank: matched collectives, last arrivals (skew above the noise), waiting caused, mean
    lateness behind the first arrival. Sorted by waiting caused, worst first."""
    t = result.table
    noisy = t.skew_us >= SKEW_NOISE_US
    last_ranks, last_counts = np.unique(t.last_rank[noisy], return_counts=True)
    last = dict(zip(last_ranks.tolist(), last_counts.tolist(), strict=True))
    wait_us = _sum_by_rank(t.last_rank[noisy], t.wait_caused_us[noisy])
    stats = []
    for r in result.ranks:
        matched = result.matched_per_rank.get(r, 0)
        late_us = result.late_us_per_rank.get(r, 0.0)
        stats.append(
            StragglerStat(
                rank=r,
                matched_collectives=matched,
                last_arrivals=last.get(r, 0),
                wait_caused_ms=round(wait_us.get(r, 0.0) / 1000.0, 4),
                mean_skew_ms=round(late_us / matched / 1000.0, 4) if matched else 0.0,
            )
        )
    stats.sort(key=lambda s: (-s.wait_caused_ms, s.rank))
    return stats


def _sum_by_rank(ranks: IntArray, values: FloatArray) -> dict[int, float]:
    """Per rank, its values summed in their order (as a loop over the matches adds them)."""
    uniq, inverse = np.unique(ranks, return_inverse=True)
    sums = np.zeros(len(uniq))
    np.add.at(sums, inverse.reshape(-1), values)
    return dict(zip(uniq.tolist(), sums.tolist(), strict=True))


def _step_leads(t: MatchTable, noisy: npt.NDArray[np.bool_]) -> dict[int, dict[int, float]]:
    """Per last rank and step (of the noisy matches within steps): its lead over the next
    arrival, summed in match order."""
    sel = noisy & (t.step >= 0)
    ranks, steps = t.last_rank[sel], t.step[sel]
    pairs, inverse = np.unique(np.stack([ranks, steps], axis=1), axis=0, return_inverse=True)
    sums = np.zeros(len(pairs))
    np.add.at(sums, inverse.reshape(-1), t.lead_us[sel])
    out: dict[int, dict[int, float]] = defaultdict(dict)
    for (r, step), v in zip(pairs.tolist(), sums.tolist(), strict=True):
        out[r][step] = v
    return out


def chance_of_last(last: int, matched: int, n_ranks: int) -> float:
    """P(X >= last) for X ~ Binomial(matched, 1/n_ranks): how likely a rank no slower than the
    others is last at least this often."""
    q = 1.0 / max(n_ranks, 1)
    return float(
        sum(
            math.comb(matched, k) * q**k * (1 - q) ** (matched - k)
            for k in range(last, matched + 1)
        )
    )


def _median_step_ms(breakdowns: Mapping[int, Sequence[StepBreakdown]]) -> float | None:
    durs = [s.duration_ms for steps in breakdowns.values() for s in steps if s.duration_ms > 0]
    return float(statistics.median(durs)) if durs else None


def _per_step_mean(steps: Sequence[StepBreakdown], attr: str) -> float | None:
    vals = [float(getattr(s, attr)) for s in steps]
    return sum(vals) / len(vals) if vals else None


def _late_in_most_steps(
    lead_by_step: Mapping[int, float], steps: Sequence[int], min_gain_ms: float
) -> bool:
    """Whether the rank made the others wait at least `min_gain_ms` in STRAGGLER_PERSISTENT_STEP_SHARE
    of the steps (a rank stalled once, its total averaged over the steps, is not)."""
    if not steps:
        return False
    hit = sum(lead_by_step.get(s, 0.0) / 1000.0 >= min_gain_ms for s in steps)
    return hit >= STRAGGLER_PERSISTENT_STEP_SHARE * len(steps)


def _own_and_others(
    rank: int,
    breakdowns: Mapping[int, Sequence[StepBreakdown]],
    peers: Collection[int] | None = None,
) -> dict[str, tuple[float, float]]:
    """Per `compute_ms` / `idle_ms`: the rank's mean per step and the other ranks' (its `peers`,
    when given) median of theirs ({} when the rank or the others have no steps; a field missing
    on either side is left out)."""
    mine = breakdowns.get(rank) or []
    others = [b for r, b in breakdowns.items() if r != rank and b and (peers is None or r in peers)]
    if not mine or not others:
        return {}
    out = {}
    for attr in ("compute_ms", "idle_ms"):
        own = _per_step_mean(mine, attr)
        theirs = [v for b in others if (v := _per_step_mean(b, attr)) is not None]
        if own is not None and theirs:
            out[attr] = (own, float(statistics.median(theirs)))
    return out


def _own_excess_ms(
    rank: int,
    breakdowns: Mapping[int, Sequence[StepBreakdown]],
    peers: Collection[int] | None = None,
) -> float:
    """The rank's compute plus idle per step above the other ranks' medians (0 when unknown):
    the time its own work or its own waiting (sleep, data loading) adds to its step."""
    return sum(own - med for own, med in _own_and_others(rank, breakdowns, peers).values())


def _diagnosis(
    rank: int,
    breakdowns: Mapping[int, Sequence[StepBreakdown]],
    median_step_ms: float | None,
    gpu: bool = True,
    peers: Collection[int] | None = None,
) -> tuple[str, dict[str, float]]:
    """What the straggler's own breakdown suggests, with the numbers behind it."""
    pairs = _own_and_others(rank, breakdowns, peers)
    if not pairs:
        return "", {}
    ev: dict[str, float] = {}
    hint = ""
    for attr, (own, med) in pairs.items():
        ev[f"straggler_{attr}_per_step"] = round(own, 3)
        ev[f"others_median_{attr}_per_step"] = round(med, 3)
    own_c = ev.get("straggler_compute_ms_per_step")
    med_c = ev.get("others_median_compute_ms_per_step")
    own_i = ev.get("straggler_idle_ms_per_step")
    med_i = ev.get("others_median_idle_ms_per_step")
    who = "Its device" if gpu else "Its host thread"  # a CPU-only run has no device
    if own_c is not None and med_c and own_c >= med_c * (1 + UNEVEN_WORK_SHARE):
        hint = (
            f"{who} computes {own_c - med_c:.2f} ms per step more than the others' median: "
            "suspect uneven work (longer sequences or padding, MoE routing imbalance, rank-0-only "
            "work) or "
            + (
                "a slower GPU (thermal or power throttling: `nvidia-smi -q -d "
                "PERFORMANCE,CLOCK` on its host)."
                if gpu
                else "a slower or busier host (other processes on its cores: `top` on its host)."
            )
        )
    elif (
        own_i is not None
        and med_i is not None
        and median_step_ms
        and own_i - med_i >= UNEVEN_WORK_SHARE * median_step_ms
    ):
        hint = (
            f"{who} idles {own_i - med_i:.2f} ms per step more than the others' median while "
            "computing about as much: suspect the host side (data loading: DataLoader workers, "
            "pin_memory, storage reads; or host jitter: CPU contention, GC, logging or "
            "checkpointing on that rank)."
        )
    return hint, ev


def _others_exposed_comm_ms(
    exposed_by_rank: Mapping[int, float], rank: int, peers: Collection[int] | None = None
) -> float | None:
    """Median over the other ranks (its `peers`, when given) of their mean exposed communication
    per step (None: unknown); `exposed_by_rank` holds each rank's mean (computed once)."""
    known = [v for r, v in exposed_by_rank.items() if r != rank and (peers is None or r in peers)]
    return float(np.median(known)) if known else None


def _round_or_none(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _persistent_cause(
    rank: int,
    step_lead_us: Mapping[int, Mapping[int, float]],
    lead_us: Mapping[int, float],
    steps: Sequence[int],
    min_gain_ms: float,
    peers: Collection[int] | None = None,
) -> bool:
    """Whether `rank` makes the others wait by at least `min_gain_ms` in most covered steps and
    causes STRAGGLER_DOMINANCE x the waiting of any other rank (of its `peers`, when given: the
    wait a rank causes, over steps, not its share of last arrivals)."""
    if len(steps) < STRAGGLER_PERSISTENT_MIN_STEPS:
        return False
    others = max(
        (v for r, v in lead_us.items() if r != rank and (peers is None or r in peers)),
        default=0.0,
    )
    return (
        _late_in_most_steps(step_lead_us.get(rank, {}), steps, min_gain_ms)
        and lead_us.get(rank, 0.0) >= STRAGGLER_DOMINANCE * others
    )


@dataclass
class _Gate:
    """The bars a straggler must pass in this run (its steps, ranks and median step)."""

    n_ranks: int
    steps: list[int]
    n_steps: int
    median_step: float | None
    min_share: float
    min_gain: float
    min_wait: float
    peers: RankPeers

    def group_size(self, rank: int) -> int:
        """How many ranks `rank` meets at its collectives (all ranks on a single-group run)."""
        return self.peers.size_of(rank, self.n_ranks)

    def min_share_of(self, rank: int) -> float:
        """The share of last arrivals that makes `rank` a candidate, given its group size."""
        return max(STRAGGLER_MIN_LAST_SHARE, STRAGGLER_CHANCE_FACTOR / self.group_size(rank))

    @staticmethod
    def of(
        result: CrossRankResult,
        breakdowns: Mapping[int, Sequence[StepBreakdown]],
        shared_cpu_host: bool,
    ) -> _Gate:
        """The bars from the thresholds above, the ranks and the median step."""
        n_ranks = len(result.ranks)
        steps = [s for s in result.steps if s >= 0]
        median_step = _median_step_ms(breakdowns)
        min_gain = max(
            STRAGGLER_MIN_GAIN_MS, STRAGGLER_MIN_GAIN_SHARE * median_step if median_step else 0.0
        )
        if shared_cpu_host and median_step:
            min_gain = max(min_gain, STRAGGLER_SHARED_HOST_MIN_GAIN_SHARE * median_step)
        return _Gate(
            n_ranks=n_ranks,
            steps=steps,
            n_steps=max(1, len(steps)),
            median_step=median_step,
            min_share=max(STRAGGLER_MIN_LAST_SHARE, STRAGGLER_CHANCE_FACTOR / n_ranks),
            min_gain=min_gain,
            min_wait=max(min_gain, STRAGGLER_PERSISTENT_WAIT_SHARE * (median_step or 0.0)),
            peers=RankPeers.of(result),
        )


@dataclass
class _Leads:
    """The waiting each last arriver caused: its lead over the next arrival, summed over the
    run (µs) and per step."""

    total_us: dict[int, float]
    by_step_us: dict[int, dict[int, float]]

    @staticmethod
    def of(table: MatchTable) -> _Leads:
        """The leads of the noisy matches (skew above SKEW_NOISE_US)."""
        noisy = table.skew_us >= SKEW_NOISE_US
        total: dict[int, float] = defaultdict(
            float, _sum_by_rank(table.last_rank[noisy], table.lead_us[noisy])
        )
        return _Leads(total, _step_leads(table, noisy))

    def steps_over(self, rank: int, min_ms: float) -> int:
        """Steps in which `rank` made the others wait at least `min_ms`."""
        return sum(v / 1000.0 >= min_ms for v in self.by_step_us.get(rank, {}).values())


_Culprit = tuple[float, int, float, float | None]
"""(gain ms per step, rank, share of last arrivals, others' exposed comm ms per step)."""


def _named_by_share(s: StragglerStat, gate: _Gate) -> bool:
    """Whether rank `s` passes the share rule: last at >= its share bar, beyond chance."""
    if not s.matched_collectives:
        return False
    share = s.last_arrivals / s.matched_collectives
    p = chance_of_last(s.last_arrivals, s.matched_collectives, gate.group_size(s.rank))
    return share >= gate.min_share_of(s.rank) and p < STRAGGLER_MAX_CHANCE_P


def _last_at(s: StragglerStat, share: float, gate: _Gate) -> str:
    """The title's share of last arrivals, saying which rule named the rank when the share alone
    would not (below its bar, or within chance: named by the wait it causes)."""
    last = f"last at {share:.0%} of collectives"
    if _named_by_share(s, gate):
        return last
    bar = gate.min_share_of(s.rank)
    below = f"under the {bar:.0%} bar" if share < bar else "within chance"
    return f"{last}, {below}: named by the wait it causes in most steps"


def _culprits(
    stats: Mapping[int, StragglerStat],
    leads: _Leads,
    gate: _Gate,
    breakdowns: Mapping[int, Sequence[StepBreakdown]],
    shared_cpu_host: bool,
) -> list[_Culprit]:
    """The ranks that pass the bars, worst first: often last beyond chance, or causing most of
    the waiting in most steps; their gain capped by the others' exposed communication."""
    exposed_by_rank = {
        r: v
        for r, st in breakdowns.items()
        if (v := _per_step_mean(st, "exposed_comm_ms")) is not None
    }
    culprits = []
    for r, s in stats.items():
        if not s.matched_collectives:
            continue
        share = s.last_arrivals / s.matched_collectives
        gain_ms = leads.total_us[r] / 1000.0 / gate.n_steps
        if gain_ms < gate.min_gain:
            continue  # the cap below only lowers the gain: no need to compute it
        peers = gate.peers.others(r)
        if not _named_by_share(s, gate) and not _persistent_cause(
            r, leads.by_step_us, leads.total_us, gate.steps, gate.min_wait, peers
        ):
            continue
        exposed = _others_exposed_comm_ms(exposed_by_rank, r, peers)
        if exposed is not None:
            # the others' wait costs step time only where it is exposed (not hidden by compute)
            gain_ms = min(gain_ms, exposed)
        if shared_cpu_host and (
            _own_excess_ms(r, breakdowns, peers) < STRAGGLER_OWN_CAUSE_SHARE * gain_ms
            or not _late_in_most_steps(leads.by_step_us.get(r, {}), gate.steps, gate.min_gain)
        ):
            continue  # no cause of its own, or one stall: the shared cores' contention
        if gain_ms >= gate.min_gain:
            culprits.append((gain_ms, r, share, exposed))
    culprits.sort(key=lambda c: (-c[0], c[1]))
    return culprits


def find_stragglers(
    result: CrossRankResult,
    breakdowns: Mapping[int, Sequence[StepBreakdown]] | None = None,
    gpu: bool = True,
    shared_cpu_host: bool = False,
    replayed_gain: Callable[[Sequence[int]], tuple[float, str] | None] | None = None,
) -> list[Finding]:
    """The `straggler` finding (zero or one) from matched collectives and, when given, the
    per-rank step breakdowns (for the step time and the diagnosis). A rank is a straggler by
    its share of last arrivals (often last, beyond chance) or by the waiting it causes (late by a
    lot in most steps, and far more than any other rank: STRAGGLER_PERSISTENT_STEP_SHARE,
    STRAGGLER_DOMINANCE). `gpu=False` (a CPU-only run) keeps GPU advice out. The gain is
    `replayed_gain(stragglers)` (ms per step, how) when it gives one (the what-if replay with the
    stragglers removed), else the leads over the second-to-last arrivals; the judgement itself
    always rests on the leads."""
    breakdowns = breakdowns or {}
    if len(result.ranks) < 2 or not len(result.table):
        return []
    gate = _Gate.of(result, breakdowns, shared_cpu_host)
    stats = {s.rank: s for s in straggler_stats(result)}
    leads = _Leads.of(result.table)
    culprits = _culprits(stats, leads, gate, breakdowns, shared_cpu_host)
    if not culprits:
        return []
    ranks = [c[1] for c in culprits]
    gain_total = sum(c[0] for c in culprits)
    gain_method = (
        "per step, the sum over the collectives where the straggler arrived last of its "
        "lead over the second-to-last arrival, capped by the other ranks' exposed "
        "communication per step (a wait hidden behind their compute costs no step time): "
        "the time every rank would save if it arrived with the others (an upper bound "
        "when its lateness is work it must do)"
    )
    replayed = replayed_gain(ranks) if replayed_gain is not None else None
    if replayed is not None:
        gain_total, gain_method = replayed
    critical = (
        gate.median_step is not None
        and gain_total >= STRAGGLER_CRITICAL_GAIN_SHARE * gate.median_step
        and not shared_cpu_host
    )
    per_rank, hints = _per_rank(culprits, stats, leads, gate, breakdowns, gpu)
    first = culprits[0]
    names = titled = ", ".join(str(r) for r in ranks)
    if gate.peers.subgroups:  # name each straggler once, with the group instances it delays
        titled = ", ".join(
            f"{r} (delaying {'; '.join(gate.peers.delayed.get(r, [])) or 'none'})" for r in ranks
        )
    plural = "s" if len(ranks) > 1 else ""
    title = (
        f"Straggler rank{plural} {titled}: others wait for {'them' if plural else 'it'} in "
        f"{leads.steps_over(first[1], gate.min_wait)} of {gate.n_steps} steps "
        f"({_last_at(stats[first[1]], first[2], gate)}), costing every rank "
        f"{gain_total:.2f} ms per step"
    )
    late_steps = {r: set(per_step) for r, per_step in leads.by_step_us.items()}
    return [
        Finding(
            id="straggler",
            severity="critical" if critical else "warning",
            title=title,
            ranks=ranks,
            steps=sorted(set().union(*(late_steps.get(r, set()) for r in ranks))),
            evidence=_evidence(result, gate, per_rank),
            recommendation=_recommendation(names, plural, hints, gpu, shared_cpu_host),
            expected_gain_ms=round(gain_total, 3),
            gain_method=gain_method,
        )
    ]


def _per_rank(
    culprits: list[_Culprit],
    stats: Mapping[int, StragglerStat],
    leads: _Leads,
    gate: _Gate,
    breakdowns: Mapping[int, Sequence[StepBreakdown]],
    gpu: bool,
) -> tuple[dict[str, dict[str, object]], list[str]]:
    """The evidence per straggler, and the diagnosis hints of its own breakdown."""
    per_rank: dict[str, dict[str, object]] = {}
    hints = []
    n_steps = gate.n_steps
    for _gain, r, share, exposed in culprits:
        s = stats[r]
        peers = gate.peers.others(r)
        hint, diag = _diagnosis(r, breakdowns, gate.median_step, gpu, peers)
        if hint:
            hints.append(f"Rank {r}: {hint}")
        chance = chance_of_last(s.last_arrivals, s.matched_collectives, gate.group_size(r))
        per_rank[str(r)] = {
            "last_arrivals": s.last_arrivals,
            "matched_collectives": s.matched_collectives,
            "last_arrival_share": round(share, 3),
            "chance_p": round(chance, 5),
            "wait_caused_ms_per_step": round(s.wait_caused_ms / n_steps, 3),
            "lead_over_next_ms_per_step": round(leads.total_us[r] / 1000.0 / n_steps, 3),
            "steps_causing_wait": leads.steps_over(r, gate.min_wait),
            "others_exposed_comm_ms_per_step": _round_or_none(exposed),
            "mean_lateness_ms": s.mean_skew_ms,
            **diag,
        }
        if gate.peers.subgroups:  # a 2-D/3-D job: whom it was judged against, whom it delays
            per_rank[str(r)]["compared_with"] = sorted(peers or ())
            per_rank[str(r)]["delays_groups"] = gate.peers.delayed.get(r, [])
    return per_rank, hints


def _recommendation(
    names: str, plural: str, hints: list[str], gpu: bool, shared_cpu_host: bool
) -> str:
    """What to look at on the late rank(s), in order."""
    return (
        f"Find out why rank{plural} {names} reach{'' if plural else 'es'} the collectives late; "
        + (
            "the others wait for them at every collective they are last to. "
            if plural
            else "the others wait for it at every collective it is last to. "
        )
        + (" ".join(hints) + " " if hints else "")
        + "Look at, in order: data loading (input pipeline stalls or uneven batch sizes on that "
        "rank), host jitter (CPU contention, garbage collection, sleeps, logging/eval/"
        "checkpointing done only on that rank), "
        + ("thermal or clock throttling of its GPU/host, " if gpu else "a slower or busier host, ")
        + "and uneven work (sequence lengths, padding, MoE routing). "
        + (
            "All ranks ran on the CPUs of one host: other processes competing for its cores "
            "slow ranks unevenly, so confirm on a quiet host (this is at most a warning here). "
            if shared_cpu_host
            else ""
        )
        + "Re-profile after the fix: this finding's skew should shrink below the noise."
    )


def _evidence(
    result: CrossRankResult, gate: _Gate, per_rank: dict[str, dict[str, object]]
) -> dict[str, object]:
    """The finding's evidence: the matching, the bars and the per-rank numbers."""
    table = result.table
    skews = table.skew_us
    return {
        "ranks_compared": gate.n_ranks,
        "matched_collectives": len(table),
        "steps_covered": gate.n_steps,
        "median_step_ms": round(gate.median_step, 3) if gate.median_step is not None else None,
        "median_skew_ms": round(float(np.median(skews)) / 1000.0, 4),
        "max_skew_ms": round(float(skews.max()) / 1000.0, 4),
        "per_rank": per_rank,
        "clock_offset_ms": {
            str(r): round(v / 1000.0, 4) for r, v in result.clock_offset_us.items() if v
        },
        "end_time_matched": int(table.end_time.sum()),
        "min_last_share": round(gate.min_share, 3),
        "min_gain_ms_per_step": round(gate.min_gain, 4),
        "min_persistent_wait_ms_per_step": round(gate.min_wait, 4),
        "skew_noise_us": SKEW_NOISE_US,
    }
