"""The reconcile step: two findings never claim the same exposed-communication time."""

from __future__ import annotations

from zdiag.analyzers.detectors.comm_bound import NO_OVERLAP_FIX
from zdiag.analyzers.detectors.reconcile import reconcile
from zdiag.analyzers.report import Finding, StepBreakdown


def _step(i: int, verdict: str, idle: float, exposed: float) -> StepBreakdown:
    """A 100 ms step: `idle` idle, `exposed` exposed communication, the rest compute."""
    return StepBreakdown(
        step=i, duration_ms=100.0, compute_ms=100.0 - idle - exposed, comm_ms=exposed,
        overlapped_ms=0.0, exposed_comm_ms=exposed, idle_ms=idle, verdict=verdict,
    )  # fmt: skip


def _f(id_: str, gain: float | None, **evidence: object) -> Finding:
    return Finding(
        id=id_,
        severity="warning",
        title=id_,
        expected_gain_ms=gain,
        evidence=dict(evidence),
        recommendation=NO_OVERLAP_FIX + " What would: bf16." if id_ == "comm-bound" else "x",
    )


def test_comm_bound_after_missing_overlap_no_longer_says_prefetch_cannot_help() -> None:
    mo, cb = _f("missing-overlap", 20.0), _f("comm-bound", 50.0)
    out = reconcile([mo, cb])
    assert [f.id for f in out] == ["missing-overlap", "comm-bound"]
    assert cb.expected_gain_ms == 30.0
    assert cb.evidence["gain_before_reconcile_ms"] == 50.0
    assert "No prefetch or overlap setting can fix this" not in cb.recommendation
    assert "Beyond the 20.00 ms per step that prefetch recovers" in cb.recommendation


def test_a_straggler_takes_the_wait_missing_overlap_would_claim() -> None:
    """The exposed time on the waiting rank is the straggler's: missing-overlap, whose gain is
    smaller than the straggler's, is dropped and listed as explained by it."""
    st = _f("straggler", 300.0)
    mo = _f("missing-overlap", 40.0, min_gain_ms_per_step=5.0)
    cb = _f("comm-bound", 320.0)
    out = reconcile([mo, st, cb])
    assert [f.id for f in out] == ["straggler", "comm-bound"]
    assert st.evidence["explains"] == ["missing-overlap"]
    assert cb.expected_gain_ms == 20.0  # the straggler's 300 ms taken out; mo was dropped


def test_a_remainder_below_the_findings_own_minimum_drops_it() -> None:
    st, mo = _f("straggler", 10.0), _f("missing-overlap", 12.0, min_gain_ms_per_step=5.0)
    assert [f.id for f in reconcile([st, mo])] == ["straggler"]


def test_unrelated_findings_and_zero_claims_are_untouched() -> None:
    mo = _f("missing-overlap", 0.0)
    cb = _f("comm-bound", 50.0)
    other = _f("activation-oom", None)
    out = reconcile([other, mo, cb])
    assert out == [other, mo, cb]
    assert cb.expected_gain_ms == 50.0 and cb.recommendation.startswith(NO_OVERLAP_FIX)


def test_bad_verdicts_on_most_steps_come_with_a_finding() -> None:
    """Most steps host-bound: a host-bound finding with the idle split by cause (data loading,
    host syncs, the rest); most steps exposed-comm: an exposed-comm finding, dropped by the
    reconcile step when a more specific finding (here comm-bound) explains the time."""
    from zdiag.analyzers.detectors import run_context
    from zdiag.analyzers.detectors.context import DetectorContext
    from zdiag.analyzers.rank.host_syncs import HostSyncSites
    from zdiag.analyzers.rank.rank_analysis import RankFacts

    facts = RankFacts(data_loading_ms=120.0, host_sync_sites=HostSyncSites(blocked_ms=30.0))
    host = DetectorContext(
        ledgers={},
        facts={0: facts},
        breakdowns={0: [_step(i, "host-bound", 60.0, 0.0) for i in range(3)]},
    )
    (f,) = [f for f in run_context(host).findings if f.id == "host-bound"]
    assert f.evidence["data_loading_ms_per_step"] == 40.0
    assert f.evidence["host_sync_ms_per_step"] == 10.0
    assert f.evidence["launch_overhead_ms_per_step"] == 10.0
    assert "num_workers" in f.recommendation and f.expected_gain_ms == 40.0
    comm = DetectorContext(
        ledgers={}, breakdowns={0: [_step(i, "exposed-comm", 0.0, 30.0) for i in range(3)]}
    )
    (e,) = [f for f in run_context(comm).findings if f.id == "exposed-comm"]
    assert e.evidence["exposed_comm_ms_per_step"] == 30.0
    assert [f.id for f in reconcile([e, _f("comm-bound", 5.0)])] == ["comm-bound"]


def test_host_bound_only_on_the_straggler_is_the_stragglers_idle() -> None:
    st = _f("straggler", 300.0)
    st.ranks = [1]
    hb = _f("host-bound", 180.0)
    hb.ranks = [1]
    assert [f.id for f in reconcile([st, hb])] == ["straggler"]
    assert st.evidence["explains"] == ["host-bound"]
    hb2 = _f("host-bound", 180.0)
    hb2.ranks = [0, 1]  # idle on a rank that is not late: its own finding
    assert [f.id for f in reconcile([_f("straggler", 300.0), hb2])] == ["straggler", "host-bound"]


def test_a_pipeline_ranks_waits_for_its_neighbours_are_not_host_bound() -> None:
    """A pipeline stage's rank idles waiting for its neighbours: listed as pipeline waits, and
    when they are the largest part, no host-bound finding (the bubble is pipeline-bubble's)."""
    from zdiag.analyzers.detectors import run_context
    from zdiag.analyzers.detectors.context import DetectorContext
    from zdiag.analyzers.rank.pipeline_times import PipelineStepTimes
    from zdiag.analyzers.rank.rank_analysis import RankFacts

    def ctx(waits: float) -> DetectorContext:
        pipe = [
            PipelineStepTimes(
                step=i,
                step_ms=100.0,
                window_ms=80.0,
                busy_ms=20.0,
                wait_ms=60.0,
                actions=8,
                neighbour_wait_ms=waits,
            )
            for i in range(3)
        ]
        bds = [_step(i, "host-bound", 60.0, 0.0) for i in range(3)]
        return DetectorContext(ledgers={}, facts={1: RankFacts(pipeline=pipe)}, breakdowns={1: bds})

    assert [f for f in run_context(ctx(45.0)).findings if f.id == "host-bound"] == []
    (f,) = [f for f in run_context(ctx(20.0)).findings if f.id == "host-bound"]
    assert f.evidence["pipeline_wait_ms_per_step"] == 20.0
    assert f.evidence["launch_overhead_ms_per_step"] == 40.0 and f.expected_gain_ms == 40.0
    assert "(pipeline waits 20.00 ms, data loading 0.00 ms" in f.title
