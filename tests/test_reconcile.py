"""The reconcile step: two findings never claim the same exposed-communication time."""

from __future__ import annotations

from zdiag.analyzers.detectors.comm_bound import NO_OVERLAP_FIX
from zdiag.analyzers.detectors.reconcile import reconcile
from zdiag.analyzers.report import Finding


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
