"""`straggler`: ranks that arrive last at collectives and make the others wait (run/stragglers.py).

The judgment itself lives with the cross-rank reduce (analyzers/run/stragglers.py:
`find_stragglers`), whose named constants carry the full reasoning; this module runs it on the
reduce's matching and declares the rule, with those constants as its thresholds (the ones
`Report.thresholds` shows for runs of two or more ranks, in that order).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..report import Finding
from ..run import crossrank as cr
from ..run import stragglers as st
from ..whatif.run_whatif import Change
from .context import DetectorContext
from .replayed_gain import gain_text, replayed
from .rule import Rule, Threshold


def detect(ctx: DetectorContext) -> list[Finding]:
    """The cross-rank straggler finding, from the reduce's matching and the step tables."""
    if ctx.crossrank is None or len(ctx.crossrank.ranks) < 2:
        return []
    sheet = ctx.sheet
    gpu = not sheet.cpu_only
    one_host = len(sheet.hosts) == 1 and None not in sheet.hosts

    def replayed_gain(ranks: Sequence[int]) -> tuple[float, str] | None:
        result = replayed(ctx, Change(without_stragglers=tuple(sorted(ranks))))
        return None if result is None else (result.gain_ms, gain_text(result))

    return st.find_stragglers(
        ctx.crossrank,
        ctx.breakdowns,
        gpu=gpu,
        shared_cpu_host=not gpu and one_host,
        replayed_gain=replayed_gain,
    )


def _t(name: str, value: float, why: str, key: str, evidence: str | None = None) -> Threshold:
    return Threshold(name, value, why, evidence=evidence, report=f"straggler_{key}")


THRESHOLDS = (
    _t(
        "SKEW_NOISE_US",
        cr.SKEW_NOISE_US,
        "Arrivals closer than this are a tie: above kernel-launch jitter and the clock "
        "alignment's error, far below a step-relevant delay.",
        "skew_noise_us",
        evidence="skew_noise_us",
    ),
    _t(
        "END_MATCH_MIN_TOL_US",
        cr.END_MATCH_MIN_TOL_US,
        "Two ranks' ends of one collective agree within max(this, END_MATCH_REL_TOL of the "
        "shorter kernel): a small collective's transfer tail plus clock-alignment error.",
        "end_match_min_tol_us",
    ),
    _t(
        "END_MATCH_REL_TOL",
        cr.END_MATCH_REL_TOL,
        "Ranks finish a ring collective a transfer tail apart, which grows with the transfer.",
        "end_match_rel_tol",
    ),
    _t(
        "STRAGGLER_MIN_LAST_SHARE",
        st.STRAGGLER_MIN_LAST_SHARE,
        "A candidate is last at >= max(this, STRAGGLER_CHANCE_FACTOR / N) of its matched "
        "collectives: a majority keeps ordinary jitter out.",
        "min_last_share",
    ),
    _t(
        "STRAGGLER_PERSISTENT_STEP_SHARE",
        st.STRAGGLER_PERSISTENT_STEP_SHARE,
        "The wait rule (a rank late once per step by a lot) holds in at least this share of "
        "the covered steps (all 3 of a default window).",
        "persistent_step_share",
    ),
    _t(
        "STRAGGLER_PERSISTENT_WAIT_SHARE",
        st.STRAGGLER_PERSISTENT_WAIT_SHARE,
        "...where the wait it causes in a step is at least this share of the median step: a "
        "3-step window is too short for a chance test per step.",
        "persistent_wait_share",
    ),
    _t(
        "STRAGGLER_DOMINANCE",
        st.STRAGGLER_DOMINANCE,
        "...and it causes at least this many times the wait of any other rank: jitter spreads "
        "the wait over all ranks.",
        "dominance",
    ),
    _t(
        "STRAGGLER_PERSISTENT_MIN_STEPS",
        st.STRAGGLER_PERSISTENT_MIN_STEPS,
        "Steps the wait rule needs: over 2, one of two ranks being later each time is a coin toss.",
        "persistent_min_steps",
    ),
    _t(
        "STRAGGLER_SHARED_HOST_MIN_GAIN_SHARE",
        st.STRAGGLER_SHARED_HOST_MIN_GAIN_SHARE,
        "Ranks sharing one CPU host compete for its cores (a healthy run had one rank late by "
        "9% of the step): there a straggler must cost at least this share of the step.",
        "shared_host_min_gain_share",
    ),
    _t(
        "STRAGGLER_OWN_CAUSE_SHARE",
        st.STRAGGLER_OWN_CAUSE_SHARE,
        "On a shared host the rank must show its own cause: compute plus idle per step above "
        "the others' medians by at least this share of the wait it causes.",
        "own_cause_share",
    ),
    _t(
        "STRAGGLER_CHANCE_FACTOR",
        st.STRAGGLER_CHANCE_FACTOR,
        "By chance each of N ranks is last 1/N of the time: a candidate is last at least this "
        "many times as often.",
        "chance_factor",
    ),
    _t(
        "STRAGGLER_MAX_CHANCE_P",
        st.STRAGGLER_MAX_CHANCE_P,
        "...and a rank no slower than the others would be last that often with a probability "
        "below this (binomial tail): 5 of 5 with 2 ranks is evidence, 4 of 5 is not.",
        "max_chance_p",
    ),
    _t(
        "STRAGGLER_MIN_GAIN_SHARE",
        st.STRAGGLER_MIN_GAIN_SHARE,
        "Its lateness must cost every rank at least this share of the median step per step: "
        "below, not worth an engineer's afternoon.",
        "min_gain_share",
    ),
    _t(
        "STRAGGLER_MIN_GAIN_MS",
        st.STRAGGLER_MIN_GAIN_MS,
        "...and at least this many ms per step.",
        "min_gain_ms",
    ),
    _t(
        "STRAGGLER_CRITICAL_GAIN_SHARE",
        st.STRAGGLER_CRITICAL_GAIN_SHARE,
        "A straggler costing at least this share of the step is critical; below, a warning.",
        "critical_gain_share",
    ),
)
"""The straggler thresholds, in the order `Report.thresholds` lists them."""

RULE = Rule(
    id="straggler",
    summary="a rank arrives last at collectives and makes the others wait",
    detect=detect,
    what=(
        "A rank arrives last at collectives and makes the others wait, judged from all ranks' "
        "arrivals, never from one waiting rank's exposed time. A rank is named either by its "
        "share of last arrivals (>= max(50%, 1.5/N) of the collectives, binomial chance < 5%) "
        "or by the wait it causes: over at least 3 steps, in >= 80% of them its lead over the "
        "next arrival sums to >= 10% of the median step, and over the window it causes >= 3x "
        "the wait of any other rank (a rank sleeping before each step is last once per step, by "
        "a lot). Either way the gain must be >= 2% of the step; critical at >= 10%. Ranks "
        "sharing one CPU host compete for its cores (a healthy 2-rank FSDP1 run on the loaded "
        "2-core box had one rank late at 76% of collectives by 35 ms per step, computing and "
        "idling as much as the other): there the gain must be "
        ">= 20% of the step, the rank must show its own cause (its compute plus idle per step "
        "above the others' medians by at least half the wait it causes), and the finding is at "
        "most a warning. No GPU advice (`nvidia-smi`) on CPU-only runs (the manifest's "
        "devices, else no device kernel in the traces)."
    ),
    why=(
        "A collective cannot finish on any rank before every rank of its group has started it: "
        "every rank runs at the pace of the slowest, and the wait shows up on the others' "
        "timelines as exposed communication that no overlap setting removes."
    ),
    example=(
        "Straggler rank 1: others wait for it in 3 of 3 steps (last at 100% of collectives), "
        "costing every rank 41.20 ms per step (a rank that sleeps or loads data slowly before "
        "each step)."
    ),
    fix=(
        "What to look at on the late rank, in order: data loading, host jitter (CPU "
        "contention, garbage collection, work only that rank does), throttling, uneven work; "
        "its step table says whether it computes more or idles more than the others."
    ),
    gain=(
        "The what-if replay of the measured steps with the stragglers arriving with the others "
        "(`zdiag whatif RUN --without-straggler RANK`): each other rank's call of a collective "
        "gets shorter by the stragglers' lead over the last of the others (the ranks finish a "
        "call together, so a lead is a difference of call durations), the steps are re-timed, "
        "and the stragglers run as their peers' median. Without modelled steps: per step, the "
        "sum of its lead over the second-to-last arrival at the collectives it was last to, "
        "capped by the other ranks' exposed communication per step. Either way the judgement "
        "rests on the leads: collectives are matched by process group, kind, step and "
        "sequence; device kernels may fall back to end-time matching with a measured clock "
        "offset when counts differ, host-thread collectives (CPU/gloo) keep the sequence."
    ),
    scope="runs of two or more ranks (the cross-rank matching of their collectives)",
    thresholds=THRESHOLDS,
    markers=(),
)
