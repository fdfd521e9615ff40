"""The monitor's pure model: statuses, live findings, bounded memory, and the text/JSON renderers."""

from __future__ import annotations

import json
from typing import Any

from support.monitor_records import NOW, job, rec
from zdiag.analyzers.detectors import comm_bound as comm_bound_rule
from zdiag.analyzers.rank import verdict
from zdiag.analyzers.run import stragglers
from zdiag.live import state as ms
from zdiag.live.state import MonitorState
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
    assert finding.evidence["others_median_ms"] == {"5": 70.0}
    assert finding.expected_gain_ms == 25.0  # what the others wait for it, per step
    assert finding.severity == "critical"  # 25 ms is >= 10% of the 100 ms step
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


def _straggler(compute_ms: float, *, one_cpu_host: bool = False, ranks: int = 8) -> Any:
    """The straggler finding (or None) of a job whose rank 1 computes `compute_ms` per 100 ms
    step, the others 70 ms; `one_cpu_host`: every rank on one host, sending process RSS."""
    records = job(ranks=ranks, r1={"compute_ms": compute_ms})
    if one_cpu_host:
        records = [dict(r, host="node0", mem_source="process") for r in records]
    state = MonitorState()
    state.ingest(records, NOW)
    return next((f for f in state.view(NOW).findings if f.id == "straggler"), None)


def test_straggler_is_judged_on_the_analyzers_thresholds() -> None:
    """1 + UNEVEN_WORK_SHARE times the others' median, an excess of at least
    STRAGGLER_MIN_GAIN_SHARE of the step, critical from STRAGGLER_CRITICAL_GAIN_SHARE."""
    others, step = 70.0, 100.0
    at_ratio = (1 + stragglers.UNEVEN_WORK_SHARE) * others
    assert at_ratio - others >= stragglers.STRAGGLER_MIN_GAIN_SHARE * step  # the ratio decides
    assert _straggler(at_ratio * 0.999) is None
    found = _straggler(at_ratio)
    assert found is not None and found.ranks == [1] and found.severity == "warning"
    assert found.evidence["min_excess_share"] == stragglers.UNEVEN_WORK_SHARE
    assert found.evidence["min_gain_ms_per_step"] == stragglers.STRAGGLER_MIN_GAIN_SHARE * step
    critical = others + stragglers.STRAGGLER_CRITICAL_GAIN_SHARE * step
    assert _straggler(critical - 0.5).severity == "warning"
    assert _straggler(critical + 0.5).severity == "critical"
    # two ranks: the straggler is compared with the other rank, not with a median it is part of
    two = _straggler(at_ratio, ranks=2)
    assert two is not None and two.ranks == [1]


def test_straggler_on_one_shared_cpu_host_needs_the_analyzers_larger_gain() -> None:
    """Ranks on the CPUs of one host compete for its cores: STRAGGLER_SHARED_HOST_MIN_GAIN_SHARE
    of the step, and never critical (as `zdiag analyze` judges them)."""
    others, step = 70.0, 100.0
    needed = others + stragglers.STRAGGLER_SHARED_HOST_MIN_GAIN_SHARE * step
    assert _straggler(needed - 0.5, one_cpu_host=True) is None
    assert _straggler(needed - 0.5) is not None  # on GPUs or several hosts it is one
    found = _straggler(needed + 0.5, one_cpu_host=True)
    assert found is not None and found.severity == "warning" and found.evidence["shared_cpu_host"]


def test_memory_creep() -> None:
    state = MonitorState()
    grow = {"mem_allocated_bytes": lambda s: float(2 << 30) + s * 64 * 2**20}
    state.ingest(job(r1=grow), NOW)
    found = {f.id: f for f in state.view(NOW).findings}
    assert set(found) == {"memory-creep"}
    assert found["memory-creep"].ranks == [1]
    assert found["memory-creep"].evidence["bytes_per_step"]["1"] == 64 * 2**20
    assert state.detail(1, NOW) is not None
    assert state.detail(1, NOW).mem_creep_bytes_per_step == 64 * 2**20  # type: ignore[union-attr]


def _comm_bound(bound_ranks: int, **split: float) -> Any:
    """The comm-bound finding (or None) of 8 ranks with 100 ms steps, `bound_ranks` of them with
    the `split` (compute_ms, comm_ms, exposed_comm_ms), the others with the healthy default."""
    state = MonitorState()
    overrides: dict[str, Any] = {f"r{r}": dict(split) for r in range(bound_ranks)}
    state.ingest(job(**overrides), NOW)
    return next((f for f in state.view(NOW).findings if f.id == "comm-bound"), None)


def test_comm_bound_follows_the_analyzers_step_verdict_and_step_share() -> None:
    """A step is comm-bound by `verdict.decide` (comm >= COMM_BOUND_COMM_TO_COMPUTE x compute,
    exposed >= MIN_EXPOSED_FRACTION of the step, idle under HOST_BOUND_IDLE_FRACTION); the job when
    COMM_BOUND_STEP_SHARE of the recent steps, all ranks together, are."""
    compute, step = 70.0, 100.0
    comm = verdict.COMM_BOUND_COMM_TO_COMPUTE * compute
    exposed = verdict.MIN_EXPOSED_FRACTION * step
    half = round(8 * comm_bound_rule.COMM_BOUND_STEP_SHARE)
    bound = {"compute_ms": compute, "comm_ms": comm, "exposed_comm_ms": exposed}
    found = _comm_bound(half, **bound)
    assert found is not None and found.ranks == list(range(half))
    assert found.evidence["comm_bound_steps"] == half * 10 and found.evidence["steps"] == 80
    assert found.evidence["threshold_step_share"] == comm_bound_rule.COMM_BOUND_STEP_SHARE
    assert _comm_bound(half - 1, **bound) is None  # a minority of the steps
    assert _comm_bound(8, **{**bound, "comm_ms": comm * 0.99}) is None  # compute can hide it
    assert _comm_bound(8, **{**bound, "exposed_comm_ms": exposed * 0.99}) is None  # it is hidden
    idle = verdict.HOST_BOUND_IDLE_FRACTION * step
    host_bound = {**bound, "compute_ms": step - exposed - idle, "comm_ms": step}
    assert _comm_bound(8, **host_bound) is None  # host-bound first, as the analyzers decide
    assert _comm_bound(8, **{**host_bound, "compute_ms": host_bound["compute_ms"] + 1}) is not None


def test_memory_creep_ignores_warm_up_and_a_noisy_plateau() -> None:
    """What a healthy CPU harness run sends (process RSS): it rises 60 MiB over the first 4 steps,
    then wanders +-20 MiB around a plateau, rising more often than not in some windows."""
    warm = [386, 401, 426, 447]
    plateau = [439, 423, 434, 434, 439, 439, 412, 417, 442, 442, 415, 412, 406, 440, 411, 415]
    mib = [float(v * 2**20) for v in warm + plateau * 3]
    state = MonitorState()
    state.ingest(
        [rec(0, s, mem_allocated_bytes=m) for s, m in enumerate(mib)]
        + [rec(1, s) for s in range(len(mib))],
        NOW,
    )
    for n in range(1, len(mib) + 1):  # at no point of the run
        state2 = MonitorState()
        state2.ingest([rec(0, s, mem_allocated_bytes=m) for s, m in enumerate(mib[:n])], NOW)
        assert all(f.id != "memory-creep" for f in state2.view(NOW).findings), n
    # a leak of 4 MiB per step under the same noise is found
    leaking = [m + s * 4 * 2**20 for s, m in enumerate(mib)]
    state3 = MonitorState()
    state3.ingest([rec(0, s, mem_allocated_bytes=m) for s, m in enumerate(leaking)], NOW)
    (finding,) = [f for f in state3.view(NOW).findings if f.id == "memory-creep"]
    assert 3 * 2**20 < finding.evidence["bytes_per_step"]["0"] < 6 * 2**20


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
    killed = {**rec(1, 5), "step_time_ms": None, "ended": "failed"}  # its launcher ends it
    state.ingest([killed], NOW + 400)
    assert {r.rank: r for r in state.view(NOW + 400).rows}[1].status == "hung"  # says where
    state.ingest([{**rec(1, 6), "recv_ts": NOW + 401}], NOW + 401)  # it moved on
    assert {r.rank: r for r in state.view(NOW + 401).rows}[1].status == "ok"


def test_finished_and_failed_ranks_and_findings_kept_after_the_job() -> None:
    state = MonitorState()
    state.ingest(job(ranks=4, r2={"compute_ms": 95.0}), NOW)
    end = {"step_time_ms": None, "compute_ms": None, "mem_allocated_bytes": None}
    state.ingest([rec(r, 29, ended="finished", **end) for r in (0, 1, 2)], NOW)
    state.ingest([rec(3, 29, ended="failed", **end)], NOW)
    later = state.view(NOW + 3600)  # an hour after: never "gone"
    assert [r.status for r in later.rows] == ["finished", "finished", "finished", "failed"]
    assert [r.step_time_ms for r in later.rows] == [100.0] * 4  # the last step's figures stay
    assert [f.id for f in later.findings] == ["straggler"]  # the findings outlive the job
    assert "0 ranks (3 finished, 1 failed)" in render_summary(later)


def test_findings_stay_when_every_rank_is_gone() -> None:
    state = MonitorState()
    state.ingest(job(ranks=4, r2={"compute_ms": 95.0}), NOW)
    view = state.view(NOW + 600)
    assert {r.status for r in view.rows} == {"gone"}
    assert [f.id for f in view.findings] == ["straggler"]


def test_jobs_are_kept_apart_and_the_latest_is_shown() -> None:
    state = MonitorState()
    state.ingest(job(ranks=2), NOW)
    state.ingest([dict(r, job="job-8", recv_ts=r["recv_ts"] + 1) for r in job(ranks=3)], NOW)
    view = state.view(NOW)
    assert view.jobs == ("job-7", "job-8") and view.job == "job-8" and len(view.rows) == 3
    old = state.view(NOW, job="job-7")
    assert old.job == "job-7" and len(old.rows) == 2
    assert state.view(NOW, job="no-such-job").job == "job-8"
    assert state.detail(2, NOW, job="job-7") is None
    assert state.detail(2, NOW, job="job-8") is not None


def test_jobs_are_bounded(monkeypatch: Any) -> None:
    monkeypatch.setattr(ms, "MAX_JOBS", 2)
    state = MonitorState()
    for i in range(4):
        state.ingest([rec(0, 0, job=f"j{i}", recv_ts=NOW + i)], NOW)
    assert list(state.jobs) == ["j2", "j3"]


def test_rank_detail_has_the_history_split_memory_and_last_collective() -> None:
    state = MonitorState()
    records = job(ranks=2, r1={"last_collective": "all_gather_single 4.0 MiB"})
    state.ingest(records, NOW)
    detail = state.detail(1, NOW)
    assert detail is not None
    assert len(detail.history) == 30 and detail.history[-1] == (29, NOW - 1, 100.0)
    assert (detail.compute_ms, detail.comm_ms, detail.exposed_comm_ms) == (70.0, 30.0, 5.0)
    assert detail.overlapped_comm_ms == 25.0 and detail.idle_ms == 25.0  # 100 - 70 - 5
    assert detail.mem_reserved_bytes == float(3 << 30) and detail.mem_creep_bytes_per_step is None
    assert detail.last_collective == "all_gather_single 4.0 MiB"
    assert state.detail(7, NOW) is None


def test_step_chart_labels_its_axes_and_handles_flat_and_empty_histories() -> None:
    from zdiag.tui.monitor_detail import step_chart

    history = tuple((s, NOW + s, 100.0 + (1400.0 if s == 0 else s % 3)) for s in range(40))
    rows = step_chart(history, 80, 4)
    assert rows[0].startswith("max 1,500 ms ┤█") and rows[3].startswith("  min 100 ms ┤")
    assert len({row.index("┤") if "┤" in row else row.index("│") for row in rows[:4]}) == 1
    assert rows[4].endswith("└" + "─" * 40)
    assert rows[5].split() == ["step", "0", "step", "39", "(39", "s)"]
    flat = step_chart(tuple((s, NOW + s, 50.0) for s in range(5)), 80, 2)
    assert flat[0].endswith("█" * 5) and flat[1].endswith("█" * 5)
    assert step_chart((), 80, 4) == ["no step times yet"]
    assert len(step_chart(history, 30, 4)[0]) <= 30  # the last steps that fit


def test_memory_creep_is_not_judged_on_process_rss() -> None:
    from zdiag.tui.monitor_detail import detail_lines

    state = MonitorState()
    grow = {"mem_allocated_bytes": lambda s: float(2 << 30) + s * 64 * 2**20}
    state.ingest(job(ranks=2, r1={**grow, "mem_source": "process"}), NOW)
    assert state.view(NOW).findings == ()
    detail = state.detail(1, NOW)
    assert detail is not None and detail.mem_source == "process"
    assert "process RSS: creep not judged" in detail_lines(detail)[3]
    device = MonitorState()
    device.ingest(job(ranks=2, r1={**grow, "mem_source": "device"}), NOW)
    assert [f.id for f in device.view(NOW).findings] == ["memory-creep"]
