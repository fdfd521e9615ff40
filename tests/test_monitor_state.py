"""The monitor's pure model: statuses, live findings, bounded memory, and the text/JSON renderers."""

from __future__ import annotations

import json
from typing import Any

from support.monitor_records import NOW, job, rec
from zdiag.tui import monitor_state as ms
from zdiag.tui.monitor_state import MonitorState
from zdiag.tui.monitor_text import render_summary, view_to_json


def test_healthy_job_has_no_findings_and_counts_ranks() -> None:
    state = MonitorState()
    state.ingest(job(), NOW)
    view = state.view(NOW)
    assert len(view.rows) == 8 and view.findings == ()
    assert {r.status for r in view.rows} == {"ok"}
    assert view.steps_per_s is not None and abs(view.steps_per_s - 1.0) < 1e-9
    assert view.jobs == ("job-7",)
    assert view.lag_p50_ms is not None and abs(view.lag_p50_ms - 10.0) < 0.5


def test_straggler_uses_compute_time_when_sent() -> None:
    state = MonitorState()
    # Synchronous training: every rank's step time is the same, but rank 5 computes longer.
    state.ingest(job(r5={"compute_ms": 95.0, "exposed_comm_ms": 0.0}), NOW)
    view = state.view(NOW)
    (finding,) = view.findings
    assert finding.id == "straggler" and finding.ranks == [5]
    assert finding.evidence["metric"] == "compute_ms"
    assert [r.status for r in view.rows if r.rank == 5] == ["straggler"]


def test_straggler_falls_back_to_step_time() -> None:
    state = MonitorState()
    records = job(r2={"step_time_ms": 300.0})
    for r in records:
        r.pop("compute_ms")
    state.ingest(records, NOW)
    (finding,) = state.view(NOW).findings
    assert finding.id == "straggler" and finding.severity == "critical"
    assert finding.evidence["metric"] == "step_time_ms"


def test_memory_creep_and_comm_bound() -> None:
    state = MonitorState()
    grow = {"mem_allocated_bytes": lambda s: float(2 << 30) + s * 64 * 2**20}
    state.ingest(job(r1=grow, r3={"comm_ms": 90.0, "compute_ms": 70.0}), NOW)
    found = {f.id: f for f in state.view(NOW).findings}
    assert set(found) == {"memory-creep", "comm-bound"}
    assert found["memory-creep"].ranks == [1]
    assert found["memory-creep"].evidence["bytes_per_step"]["1"] == 64 * 2**20
    assert found["comm-bound"].ranks == [3]


def test_silent_ranks_turn_stale_then_gone() -> None:
    state = MonitorState()
    state.ingest(job(ranks=4), NOW)
    state.ingest([rec(0, 30, ts=NOW + 20, recv_ts=NOW + 20)], NOW + 20)
    by_rank = {r.rank: r for r in state.view(NOW + 20).rows}
    assert by_rank[0].status == "ok" and by_rank[1].status == "stale"
    assert by_rank[1].age_s > 20
    later = {r.rank: r.status for r in state.view(NOW + 60).rows}
    assert later == {0: "gone", 1: "gone", 2: "gone", 3: "gone"}
    header = render_summary(state.view(NOW + 20))
    assert "1 ranks (3 stale)" in header


def test_restarted_rank_starts_a_fresh_history() -> None:
    state = MonitorState()
    state.ingest(job(ranks=1), NOW)
    state.ingest([rec(0, 0, pid=999)], NOW)
    assert state.ranks[0].restarts == 1 and len(state.ranks[0].steps) == 1


def test_memory_is_bounded(monkeypatch: Any) -> None:
    monkeypatch.setattr(ms, "MAX_RANKS", 16)
    state = MonitorState()
    state.ingest(job(ranks=20, steps=200), NOW)
    assert len(state.ranks) == 16 and state.ignored_ranks == 4 * 200
    assert all(len(s.steps) == ms.HISTORY_STEPS for s in state.ranks.values())
    assert len(state.view(NOW).slowest_step_ms) <= ms.HISTORY_STEPS


def test_renderers_handle_an_empty_and_a_full_view() -> None:
    empty = MonitorState().view(NOW)
    assert "no rank has reported yet" in render_summary(empty)
    json.dumps(view_to_json(empty))
    state = MonitorState()
    state.ingest(job(r5={"compute_ms": 95.0}), NOW)
    view = state.view(NOW)
    text = render_summary(view)
    assert "8 ranks (1 straggler)" in text and "straggler:" in text
    data = json.loads(json.dumps(view_to_json(view)))
    assert data["findings"][0]["id"] == "straggler" and data["status_counts"]["ok"] == 7


def test_relay_records_count_relays_and_their_drops() -> None:
    state = MonitorState()
    state.ingest([{"kind": "relay", "host": "node0", "dropped": 3, "forwarded": 10}], NOW)
    view = state.view(NOW)
    assert view.relays == 1 and view.dropped == 3 and view.records == 0


def test_a_hang_record_marks_the_rank_hung_with_where_until_it_steps_again() -> None:
    state = MonitorState()
    state.ingest(job(ranks=2, steps=5), NOW)
    stuck = {**rec(1, 5), "step_time_ms": None, "hung_in": "all_gather_single #34 at train.py:67"}
    state.ingest([stuck], NOW + 400)  # long after: a hung rank is "hung", never "gone"
    rows = {r.rank: r for r in state.view(NOW + 400).rows}
    assert rows[1].status == "hung" and rows[1].hung_in == stuck["hung_in"]
    assert render_summary(state.view(NOW + 400)).count("hung in all_gather_single #34") == 1
    assert rows[0].status == "gone"
    state.ingest([{**rec(1, 6), "recv_ts": NOW + 401}], NOW + 401)  # it moved on
    assert {r.rank: r for r in state.view(NOW + 401).rows}[1].status == "ok"
