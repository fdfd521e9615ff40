"""The live anomaly rules (zdiag/live/anomalies.py) through the monitor's state: a chronic and a
transient straggler told apart, a one-step spike, a creeping step time, a stall; none on a
healthy job."""

from __future__ import annotations

from typing import Any

from support.monitor_records import NOW, job, rec
from zdiag.live import anomalies
from zdiag.live.state import MonitorState


def _findings(records: list[dict[str, Any]], now: float = NOW) -> dict[str, Any]:
    state = MonitorState()
    state.ingest(records, now)
    return {f.id: f for f in state.view(now).findings}


def test_a_healthy_job_raises_no_anomaly() -> None:
    assert _findings(job(ranks=4, steps=60)) == {}


def test_a_rank_slow_from_step_30_is_a_chronic_straggler() -> None:
    slow = {"compute_ms": lambda s: 370.0 if s >= 30 else 70.0}
    found = _findings(job(ranks=4, steps=60, r2=slow))
    f = found["straggler"]
    assert f.ranks == [2] and f.title.startswith("chronic straggler:")
    assert f.evidence["persistence"] == "chronic" and f.evidence["culprit_stability"] >= 0.6


def test_a_straggler_whose_culprit_moves_is_transient() -> None:
    """Rank 1 is slow in the window the straggler rule reads (steps 52-59); before that, the
    slow rank rotated over all four, one step each."""
    per_rank = {
        f"r{r}": {
            "compute_ms": lambda s, r=r: (
                200.0 if (s < 50 and s % 4 == r) or (r == 1 and s >= 52) else 70.0
            )
        }
        for r in range(4)
    }
    f = _findings(job(ranks=4, steps=60, **per_rank))["straggler"]
    assert f.ranks == [1]
    assert f.evidence["persistence"] == "transient", f.evidence
    assert f.evidence["culprit_stability"] < anomalies.CHRONIC_SHARE


def test_a_one_step_spike_is_a_slow_step() -> None:
    spike = {"step_time_ms": lambda s: 900.0 if s == 29 else 100.0}
    f = _findings(job(ranks=4, steps=30, r3=spike))["slow-step"]
    assert f.ranks == [3] and f.steps == [29]
    assert f.evidence["step_ms"] == {"3": 900.0} and f.evidence["recent_median_ms"] == {"3": 100.0}


def test_a_step_time_that_keeps_rising_is_creep_and_noise_is_not() -> None:
    rising = {"step_time_ms": lambda s: 100.0 + 3.0 * s}
    per_rank = {f"r{r}": rising for r in range(4)}
    f = _findings(job(ranks=4, steps=60, **per_rank))["step-time-creep"]
    assert f.evidence["part_medians_ms"][-1] > f.evidence["part_medians_ms"][0] * 1.15
    noisy = {"step_time_ms": lambda s: 100.0 + (17 * s) % 23}
    per_rank = {f"r{r}": noisy for r in range(4)}
    assert "step-time-creep" not in _findings(job(ranks=4, steps=60, **per_rank))


def test_a_rank_that_stops_reporting_while_others_go_on_is_a_stall() -> None:
    records = [r for r in job(ranks=4, steps=30) if not (r["rank"] == 1 and r["step"] > 20)]
    # the others' last record is recent; rank 1's is 9 s old (stale after 5 s, gone after more)
    records += [rec(r, 30, ts=NOW - 0.5, recv_ts=NOW - 0.5) for r in (0, 2, 3)]
    state = MonitorState()
    state.ingest(records, NOW)
    view = state.view(NOW)
    statuses = {row.rank: row.status for row in view.rows}
    assert statuses[1] == "stale"
    f = {x.id: x for x in view.findings}["stall"]
    assert f.ranks == [1]


def test_a_single_jump_in_step_time_is_not_a_creep() -> None:
    jump = {"step_time_ms": lambda s: 400.0 + (s % 3) if s >= 30 else 100.0 + (s % 3)}
    per_rank = {f"r{r}": jump for r in range(4)}
    assert "step-time-creep" not in _findings(job(ranks=4, steps=60, **per_rank))


def test_a_drift_inside_the_step_noise_is_not_a_creep() -> None:
    """A healthy job on a busy host (seen in CI: part medians 100, 106, 109, 124 ms): 22% over
    the window, 10 ms per part, but steps jump 40 ms from one to the next."""
    drift = {"step_time_ms": lambda s: 95.0 + 1.0 * s + (40.0 if s % 2 else 0.0)}
    per_rank = {f"r{r}": drift for r in range(4)}
    assert "step-time-creep" not in _findings(job(ranks=4, steps=60, **per_rank))
