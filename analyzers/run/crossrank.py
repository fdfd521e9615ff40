"""Across ranks: match collectives, measure arrival skew, rank the stragglers.

A collective (all-reduce, all-gather, ...) cannot finish on any rank before every rank of its
process group has started it, so the rank that *arrives* last makes the others wait: their
kernels (or gloo ops) start early and sit idle until it arrives. This module

1. **matches** the same collective across ranks: by process group + kind + step + sequence number
   (the i-th collective of that kind on that group in that `ProfilerStep`); when a rank holds a
   different count (sampled or truncated traces, different profiler windows), or the sequence
   pairs disagree on when the collective ended, it falls back to **end-time matching**: a
   blocking collective ends on all its ranks at (nearly) the same moment, so pairs whose
   (clock-aligned) end times agree within a tolerance are the same collective, taken in order.
   Traces without process-group args use one default group; without steps, the whole trace.
2. **aligns clocks**: ranks on different hosts have clocks that disagree by up to milliseconds;
   a rank's offset is the median difference of its matched collectives' end times (which should
   coincide) against the reference rank.
3. **measures arrival skew** per matched collective (start of each rank), the **last arriver**,
   the **waiting** it causes (sum over the other ranks of how long before it they arrived) and
   its **lead** over the second-to-last arrival (what the collective, and the step, would gain if
   it arrived with the others).
4. ranks them into `StragglerStat`s (Report.stragglers) and, past the thresholds below, a
   `straggler` Finding.

Everything here is a pure function of values: `rank_collectives(trace, windows)` is the map's
per-rank input (kept in the rank's summary), `crossrank_match.match_collectives(ranks)` returns
the matching (ranks are consumed one at a time and the matches kept as columns, a
`MatchTable`, so memory stays O(ranks x collectives) in numpy arrays),
`straggler_stats(result)` the Report's per-rank table, and `find_stragglers(result, breakdowns)`
the `straggler` finding (called by the straggler detector on the reduce's matching); both read
the table's columns.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from ..report import Finding, StepBreakdown, StragglerStat

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# --- thresholds (named, with their reasoning; the straggler rule declares them, detectors/
# straggler.py, and Report.thresholds shows them) ------------------------------------------

SKEW_NOISE_US = 50.0
"""Arrivals closer than this are a tie: nobody counts as last. Kernel-launch jitter is a few us
and the clock alignment (median of end-time differences) leaves tens of us of error; 50 us is
above both and far below a step-relevant delay."""

END_MATCH_MIN_TOL_US = 100.0
END_MATCH_REL_TOL = 0.05
"""Two ranks' ends of one collective agree within max(100 us, 5% of the shorter of the two
kernels). Ranks finish a ring/tree collective a data-transfer tail apart (the last chunks travel
the ring), which grows with the transfer itself; the shorter kernel (the last arriver's) is
about the pure transfer time. 100 us covers small collectives' tail plus clock-alignment error."""

SEQUENCE_AGREEMENT = 0.8
"""Sequence-number pairs are trusted outright when at least 80% of them end together (within
the end tolerance). Otherwise, when the two ranks' ends are reliable (a clock offset was
measured from them, see OFFSET_MIN_SUPPORT), end-time matching replaces the sequence: the
sequence was broken by dropped events, and collectives whose ends find no partner are left
unmatched. When ends are not reliable (CPU/gloo collectives, whose ranks finish milliseconds
apart; loosely synchronized hosts), the sequence number, or for unequal counts the order, is the
better evidence and is kept."""

OFFSET_MIN_SUPPORT = 3
OFFSET_MIN_SUPPORT_SHARE = 0.25
"""A clock offset is measured (and the ranks' ends called reliable) only when at least 3
collective pairs, and 25% of the smaller rank's collectives in the shared groups, agree on it
within END_MATCH_MIN_TOL_US; otherwise the clocks are taken as synchronized."""

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


# --- inputs ---------------------------------------------------------------------------------

OFFSET_INDEX_WINDOW = 3
"""Clock-offset candidates pair each collective with the other rank's collectives up to 3
places away in the same (group, kind, step) sequence: enough to bridge a few dropped events."""


# --- outputs --------------------------------------------------------------------------------


@dataclass
class MatchedCollective:
    """One collective seen on two or more ranks; starts/ends are clock-aligned, in `ranks` order."""

    process_group: str
    kind: str
    step: int  # -1 when the traces have no steps
    seq: int  # index among the reference rank's (group, kind, step) collectives
    ranks: list[int]
    start_us: list[float]
    end_us: list[float]
    method: Literal["sequence", "end-time"] = "sequence"

    @property
    def skew_us(self) -> float:
        """Last arrival minus first arrival."""
        return max(self.start_us) - min(self.start_us)

    @property
    def last_rank(self) -> int:
        """The rank that arrived last (lowest rank on exact ties)."""
        return self.ranks[int(np.argmax(self.start_us))]

    @property
    def wait_caused_us(self) -> float:
        """Sum over the other ranks of how long they waited for the last arrival."""
        last = max(self.start_us)
        return float(sum(last - s for s in self.start_us))

    @property
    def lead_us(self) -> float:
        """Last arrival minus second-to-last: what the collective gains if the last one is on time."""
        s = sorted(self.start_us)
        return s[-1] - s[-2]


@dataclass(frozen=True)
class MatchTable:
    """The matched collectives as columns, one row per match, in order of first arrival (ties:
    by step, group, kind, sequence number): what the straggler ranking and the views read.

    `group`/`kind` are codes into `groups`/`kinds`; arrivals are clock-aligned starts;
    `before_last_arrival_us` is the second-to-last arrival (equal to the last on a tie);
    `last_rank` the last arrival's rank (lowest on exact ties); `end_time` whether end times
    paired the match (else sequence numbers); `wait_caused_us` the sum over its ranks of how long
    each arrived before the last one.
    """

    groups: tuple[str, ...]
    kinds: tuple[str, ...]
    group: IntArray
    kind: IntArray
    step: IntArray
    seq: IntArray
    first_arrival_us: FloatArray
    last_arrival_us: FloatArray
    before_last_arrival_us: FloatArray
    last_rank: IntArray
    n_ranks: IntArray
    end_time: npt.NDArray[np.bool_]
    wait_caused_us: FloatArray

    def __len__(self) -> int:
        return len(self.step)

    @property
    def skew_us(self) -> FloatArray:
        """Last arrival minus first arrival, per match."""
        return self.last_arrival_us - self.first_arrival_us

    @property
    def lead_us(self) -> FloatArray:
        """Last arrival minus second-to-last, per match (the gain if the last were on time)."""
        return self.last_arrival_us - self.before_last_arrival_us

    @staticmethod
    def empty() -> MatchTable:
        """No matches."""
        return MatchTable.of([])

    @staticmethod
    def of(matched: Sequence[MatchedCollective]) -> MatchTable:
        """The columns of matches held as objects (kept in their order)."""
        groups = tuple(dict.fromkeys(m.process_group for m in matched))
        kinds = tuple(dict.fromkeys(m.kind for m in matched))
        g_of = {g: i for i, g in enumerate(groups)}
        k_of = {k: i for i, k in enumerate(kinds)}

        def ints(values: Iterable[int]) -> IntArray:
            return np.fromiter(values, np.int64, len(matched))

        def floats(values: Iterable[float]) -> FloatArray:
            return np.fromiter(values, np.float64, len(matched))

        return MatchTable(
            groups=groups,
            kinds=kinds,
            group=ints(g_of[m.process_group] for m in matched),
            kind=ints(k_of[m.kind] for m in matched),
            step=ints(m.step for m in matched),
            seq=ints(m.seq for m in matched),
            first_arrival_us=floats(min(m.start_us) for m in matched),
            last_arrival_us=floats(max(m.start_us) for m in matched),
            before_last_arrival_us=floats(sorted(m.start_us)[-2] for m in matched),
            last_rank=ints(m.last_rank for m in matched),
            n_ranks=ints(len(m.ranks) for m in matched),
            end_time=np.fromiter((m.method == "end-time" for m in matched), bool, len(matched)),
            wait_caused_us=floats(m.wait_caused_us for m in matched),
        )


@dataclass
class CrossRankResult:
    """The matched collectives of a run and how they were matched.

    `table` holds the matches as columns (crossrank_match.py builds it streaming);
    `late_us_per_rank` is, per rank, the sum over its matches of how long after the first
    arrival it arrived. `matched` gives the matches as `MatchedCollective` objects (with every
    rank's aligned start and end), built on each access: for tests and small runs, not for the
    reduce of a large one.
    """

    ranks: list[int]
    table: MatchTable = field(default_factory=MatchTable.empty)
    clock_offset_us: dict[int, float] = field(default_factory=dict)  # add to a rank's times
    collectives_per_rank: dict[int, int] = field(default_factory=dict)
    matched_per_rank: dict[int, int] = field(default_factory=dict)
    late_us_per_rank: dict[int, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    member_detail: Callable[[], list[MatchedCollective]] | None = None

    @property
    def matched(self) -> list[MatchedCollective]:
        """The matches as objects, in the table's order (see the class docstring)."""
        return self.member_detail() if self.member_detail is not None else []

    @property
    def steps(self) -> list[int]:
        """Distinct step numbers of the matched collectives (-1 when there are no steps)."""
        return [int(s) for s in np.unique(self.table.step)]

    @staticmethod
    def from_matched(ranks: list[int], matched: list[MatchedCollective]) -> CrossRankResult:
        """A result from matches held as objects (ordered by first arrival, as the matcher
        orders them), with the per-rank counters they imply."""
        matched = sorted(matched, key=lambda m: min(m.start_us))
        per_rank: dict[int, int] = dict.fromkeys(ranks, 0)
        late: dict[int, float] = dict.fromkeys(ranks, 0.0)
        for m in matched:
            first = min(m.start_us)
            for r, s in zip(m.ranks, m.start_us, strict=True):
                per_rank[r] = per_rank.get(r, 0) + 1
                late[r] = late.get(r, 0.0) + (s - first)
        return CrossRankResult(
            ranks=ranks,
            table=MatchTable.of(matched),
            matched_per_rank=per_rank,
            late_us_per_rank=late,
            member_detail=lambda: list(matched),
        )


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
    rank: int, breakdowns: Mapping[int, Sequence[StepBreakdown]]
) -> dict[str, tuple[float, float]]:
    """Per `compute_ms` / `idle_ms`: the rank's mean per step and the other ranks' median of
    theirs ({} when the rank or the others have no steps; a field missing on either side is left
    out)."""
    mine = breakdowns.get(rank) or []
    others = [b for r, b in breakdowns.items() if r != rank and b]
    if not mine or not others:
        return {}
    out = {}
    for attr in ("compute_ms", "idle_ms"):
        own = _per_step_mean(mine, attr)
        theirs = [v for b in others if (v := _per_step_mean(b, attr)) is not None]
        if own is not None and theirs:
            out[attr] = (own, float(statistics.median(theirs)))
    return out


def _own_excess_ms(rank: int, breakdowns: Mapping[int, Sequence[StepBreakdown]]) -> float:
    """The rank's compute plus idle per step above the other ranks' medians (0 when unknown):
    the time its own work or its own waiting (sleep, data loading) adds to its step."""
    return sum(own - med for own, med in _own_and_others(rank, breakdowns).values())


def _diagnosis(
    rank: int,
    breakdowns: Mapping[int, Sequence[StepBreakdown]],
    median_step_ms: float | None,
    gpu: bool = True,
) -> tuple[str, dict[str, float]]:
    """What the straggler's own breakdown suggests, with the numbers behind it."""
    pairs = _own_and_others(rank, breakdowns)
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
    if own_c is not None and med_c and own_c >= med_c * (1 + UNEVEN_WORK_SHARE):
        hint = (
            f"Its device computes {own_c - med_c:.2f} ms per step more than the others' median: "
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
            f"Its device idles {own_i - med_i:.2f} ms per step more than the others' median while "
            "computing about as much: suspect the host side (data loading: DataLoader workers, "
            "pin_memory, storage reads; or host jitter: CPU contention, GC, logging or "
            "checkpointing on that rank)."
        )
    return hint, ev


def _others_exposed_comm_ms(exposed_by_rank: Mapping[int, float], rank: int) -> float | None:
    """Median over the other ranks of their mean exposed communication per step (None: unknown);
    `exposed_by_rank` holds each rank's mean (computed once: ranks x steps, not ranks^2)."""
    known = [v for r, v in exposed_by_rank.items() if r != rank]
    return float(np.median(known)) if known else None


def _round_or_none(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _persistent_cause(
    rank: int,
    step_lead_us: Mapping[int, Mapping[int, float]],
    lead_us: Mapping[int, float],
    steps: Sequence[int],
    min_gain_ms: float,
) -> bool:
    """Whether `rank` makes the others wait by at least `min_gain_ms` in most covered steps and
    causes STRAGGLER_DOMINANCE x the waiting of any other rank (the wait a rank causes, over steps,
    not its share of last arrivals)."""
    if len(steps) < STRAGGLER_PERSISTENT_MIN_STEPS:
        return False
    others = max((v for r, v in lead_us.items() if r != rank), default=0.0)
    return (
        _late_in_most_steps(step_lead_us.get(rank, {}), steps, min_gain_ms)
        and lead_us.get(rank, 0.0) >= STRAGGLER_DOMINANCE * others
    )


def find_stragglers(
    result: CrossRankResult,
    breakdowns: Mapping[int, Sequence[StepBreakdown]] | None = None,
    gpu: bool = True,
    shared_cpu_host: bool = False,
) -> list[Finding]:
    """The `straggler` finding (zero or one) from matched collectives and, when given, the
    per-rank step breakdowns (for the step time and the diagnosis). A rank is a straggler by
    its share of last arrivals (often last, beyond chance) or by the waiting it causes (late by a
    lot in most steps, and far more than any other rank: STRAGGLER_PERSISTENT_STEP_SHARE,
    STRAGGLER_DOMINANCE). `gpu=False` (a CPU-only run) keeps GPU advice out."""
    breakdowns = breakdowns or {}
    n_ranks = len(result.ranks)
    if n_ranks < 2 or not len(result.table):
        return []
    steps = [s for s in result.steps if s >= 0]
    n_steps = max(1, len(steps))
    median_step = _median_step_ms(breakdowns)
    min_share = max(STRAGGLER_MIN_LAST_SHARE, STRAGGLER_CHANCE_FACTOR / n_ranks)
    min_gain = max(
        STRAGGLER_MIN_GAIN_MS, STRAGGLER_MIN_GAIN_SHARE * median_step if median_step else 0.0
    )

    if shared_cpu_host and median_step:
        min_gain = max(min_gain, STRAGGLER_SHARED_HOST_MIN_GAIN_SHARE * median_step)
    min_wait = max(min_gain, STRAGGLER_PERSISTENT_WAIT_SHARE * (median_step or 0.0))
    stats = {s.rank: s for s in straggler_stats(result)}
    table = result.table
    noisy = table.skew_us >= SKEW_NOISE_US
    lead_us: dict[int, float] = defaultdict(
        float, _sum_by_rank(table.last_rank[noisy], table.lead_us[noisy])
    )
    step_lead_us = _step_leads(table, noisy)
    late_steps: dict[int, set[int]] = defaultdict(set)
    for r, per_step in step_lead_us.items():
        late_steps[r] = set(per_step)

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
        gain_ms = lead_us[r] / 1000.0 / n_steps
        if gain_ms < min_gain:
            continue  # the cap below only lowers the gain: no need to compute it
        p = chance_of_last(s.last_arrivals, s.matched_collectives, n_ranks)
        by_share = share >= min_share and p < STRAGGLER_MAX_CHANCE_P
        if not by_share and not _persistent_cause(r, step_lead_us, lead_us, steps, min_wait):
            continue
        exposed = _others_exposed_comm_ms(exposed_by_rank, r)
        if exposed is not None:
            # the others' wait costs step time only where it is exposed (not hidden by compute)
            gain_ms = min(gain_ms, exposed)
        if shared_cpu_host and (
            _own_excess_ms(r, breakdowns) < STRAGGLER_OWN_CAUSE_SHARE * gain_ms
            or not _late_in_most_steps(step_lead_us.get(r, {}), steps, min_gain)
        ):
            continue  # no cause of its own, or one stall: the shared cores' contention
        if gain_ms >= min_gain:
            culprits.append((gain_ms, r, share, exposed))
    if not culprits:
        return []
    culprits.sort(key=lambda c: (-c[0], c[1]))
    ranks = [c[1] for c in culprits]
    gain_total = sum(c[0] for c in culprits)
    critical = (
        median_step is not None
        and gain_total >= STRAGGLER_CRITICAL_GAIN_SHARE * median_step
        and not shared_cpu_host
    )

    per_rank: dict[str, dict[str, float | None]] = {}
    hints = []
    for _gain, r, share, exposed in culprits:
        s = stats[r]
        hint, diag = _diagnosis(r, breakdowns, median_step, gpu)
        if hint:
            hints.append(f"Rank {r}: {hint}")
        per_rank[str(r)] = {
            "last_arrivals": s.last_arrivals,
            "matched_collectives": s.matched_collectives,
            "last_arrival_share": round(share, 3),
            "chance_p": round(chance_of_last(s.last_arrivals, s.matched_collectives, n_ranks), 5),
            "wait_caused_ms_per_step": round(s.wait_caused_ms / n_steps, 3),
            "lead_over_next_ms_per_step": round(lead_us[r] / 1000.0 / n_steps, 3),
            "steps_causing_wait": sum(
                v / 1000.0 >= min_wait for v in step_lead_us.get(r, {}).values()
            ),
            "others_exposed_comm_ms_per_step": _round_or_none(exposed),
            "mean_lateness_ms": s.mean_skew_ms,
            **diag,
        }
    skews = table.skew_us
    names = ", ".join(str(r) for r in ranks)
    plural = "s" if len(ranks) > 1 else ""
    first = culprits[0]
    n_late = sum(v / 1000.0 >= min_wait for v in step_lead_us.get(first[1], {}).values())
    title = (
        f"Straggler rank{plural} {names}: others wait for {'them' if plural else 'it'} in "
        f"{n_late} of {n_steps} steps (last at {first[2]:.0%} of collectives), "
        f"costing every rank {gain_total:.2f} ms per step"
    )
    recommendation = (
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
    evidence: dict[str, object] = {
        "ranks_compared": n_ranks,
        "matched_collectives": len(table),
        "steps_covered": n_steps,
        "median_step_ms": round(median_step, 3) if median_step is not None else None,
        "median_skew_ms": round(float(np.median(skews)) / 1000.0, 4),
        "max_skew_ms": round(float(skews.max()) / 1000.0, 4),
        "per_rank": per_rank,
        "clock_offset_ms": {
            str(r): round(v / 1000.0, 4) for r, v in result.clock_offset_us.items() if v
        },
        "end_time_matched": int(table.end_time.sum()),
        "min_last_share": round(min_share, 3),
        "min_gain_ms_per_step": round(min_gain, 4),
        "min_persistent_wait_ms_per_step": round(min_wait, 4),
        "skew_noise_us": SKEW_NOISE_US,
    }
    return [
        Finding(
            id="straggler",
            severity="critical" if critical else "warning",
            title=title,
            ranks=ranks,
            steps=sorted(set().union(*(late_steps[r] for r in ranks))),
            evidence=evidence,
            recommendation=recommendation,
            expected_gain_ms=round(gain_total, 3),
            gain_method=(
                "per step, the sum over the collectives where the straggler arrived last of its "
                "lead over the second-to-last arrival, capped by the other ranks' exposed "
                "communication per step (a wait hidden behind their compute costs no step time): "
                "the time every rank would save if it arrived with the others (an upper bound "
                "when its lateness is work it must do)"
            ),
        )
    ]
