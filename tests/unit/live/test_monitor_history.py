"""The monitor's step-time history: the bounded per-rank ring, the job's history side by side by
step, its text with capture marks, and where a capture's traces are (to open them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from support.monitor_records import NOW, job, rec
from zdiag.live import history as hist
from zdiag.live.history import TIMELINE_STEPS, StepTimes
from zdiag.live.state import MonitorState
from zdiag.tui.monitor_captures import recorded_steps, verdict, where_to_open
from zdiag.tui.monitor_history import GUTTER, MARK, CaptureMark, history_lines


def test_step_times_keep_the_last_timeline_steps_oldest_first() -> None:
    times = StepTimes()
    for step in range(TIMELINE_STEPS + 150):
        times.append(step, float(step))
    items = times.items()
    assert len(times) == TIMELINE_STEPS == len(items)
    assert items[0] == (150, 150.0) and items[-1] == (TIMELINE_STEPS + 149, TIMELINE_STEPS + 149)
    assert [s for s, _ in items] == list(range(150, TIMELINE_STEPS + 150))
    times.append(2**64, 1.0)  # outside int64: ignored, never an error
    times.append(5, 1e300)  # clipped to float32's range, not infinite
    assert times.items()[-1] == (5, pytest.approx(3.0e38, rel=1e-6))
    times.clear()
    assert len(times) == 0 and times.items() == []


def slow_from_20() -> list[dict[str, Any]]:
    """4 ranks, 40 steps; rank 2 takes 400 ms from step 20, rank 3 misses step 30."""
    records = job(ranks=4, steps=40, r2={"step_time_ms": lambda s: 400.0 if s >= 20 else 100.0})
    return [r for r in records if (r["rank"], r["step"]) != (3, 30)]


def test_job_history_is_side_by_side_by_step_with_median_and_slowest() -> None:
    state = MonitorState()
    state.ingest(slow_from_20(), NOW)
    h = state.history(steps=15)
    assert h.job == "job-7" and h.steps == tuple(range(25, 40))
    assert h.ranks[2] == (400.0,) * 15 and h.ranks[0] == (100.0,) * 15
    assert h.ranks[3][30 - 25] is None  # the step it did not report
    assert set(h.median_ms) == {100.0} and set(h.slowest_ms) == {400.0}
    assert set(h.slowest_rank) == {2}
    early = state.history(steps=TIMELINE_STEPS)  # more than were kept: from step 0
    assert early.steps == tuple(range(40))
    assert early.slowest_rank[19] in (0, 1, 2, 3) and early.slowest_rank[20] == 2
    # an unknown job, or none yet: an empty history
    assert MonitorState().history().steps == ()


def test_job_history_is_bounded_and_a_restart_forgets_it(monkeypatch: Any) -> None:
    monkeypatch.setattr(hist, "TIMELINE_STEPS", 8)
    state = MonitorState()
    state.ingest(job(ranks=2, steps=30), NOW)
    assert all(len(s.times) == 8 for s in state.ranks.values())
    assert state.history().steps == tuple(range(22, 30))
    state.ingest([rec(1, 0, pid=999, step_time_ms=50.0)], NOW)  # rank 1 restarted
    assert state.ranks[1].times.items() == [(0, 50.0)]


def test_history_text_marks_the_captured_steps_in_the_right_columns() -> None:
    state = MonitorState()
    state.ingest(slow_from_20(), NOW)
    h = state.history(steps=40)
    mark = CaptureMark.of({"id": 3, "start_step": 24, "steps": 3})
    assert mark == CaptureMark(3, 25, 27)  # the start step warms the profiler up
    lines = [line.plain for line in history_lines(h, [mark], height=6)]
    marks = lines[0]
    columns = [i - GUTTER for i, ch in enumerate(marks) if ch == MARK]
    assert [h.steps[c] for c in columns] == [25, 26, 27]
    assert marks.rstrip().endswith(MARK * 3 + "c3")
    assert "max 400 ms ┤" in lines[1] and "min 100 ms ┤" in lines[6]
    assert lines[8].strip().startswith("step 0") and lines[8].rstrip().endswith("step 39")
    ranks = [line.split("│")[0].strip() for line in lines if line.lstrip().startswith("rank ")]
    assert ranks[0] == "rank 2 250 ms"  # slowest first: its median over the 40 steps
    assert [r.split()[1] for r in ranks] == ["2", "0", "1", "3"]
    rank2 = next(line for line in lines if line.lstrip().startswith("rank 2"))
    assert rank2[GUTTER + 19] == "▁" and rank2[GUTTER + 20] == "█"  # the jump at step 20
    assert history_lines(MonitorState().history(), [mark])[0].plain == "no step times yet"


def test_capture_mark_and_recorded_steps_of_a_damaged_entry() -> None:
    assert CaptureMark.of({"id": 1, "start_step": None, "steps": 3}) is None
    assert recorded_steps({"start_step": 44, "steps": 3}) == "45-47"
    assert recorded_steps({"start_step": 44, "steps": 1}) == "45"
    assert recorded_steps({}) == "?"


def capture(traces: list[str], **over: Any) -> dict[str, Any]:
    base = {
        "id": 1, "job": "job-7", "start_step": 44, "steps": 3, "reason": "straggler",
        "ranks": [0, 1, 2, 3], "states": {"0": "done", "1": "done"}, "traces": traces,
        "findings": [{"id": "straggler", "ranks": [2]}], "error": None,
    }  # fmt: skip
    base.update(over)
    return base


def test_where_a_capture_opens(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "captures" / "capture-1"
    folder.mkdir(parents=True)
    for rank in (0, 1):
        (folder / f"rank-{rank}.json.gz").write_bytes(b"")
    here = where_to_open(capture([str(folder / "rank-0.json.gz")]))
    assert here.folders == (folder,) and (here.traces_here, here.ranks) == (2, 4)
    away = where_to_open(capture(["/elsewhere/run/captures/capture-1/rank-0.json.gz"]))
    assert not away.folders and "not on this machine" in away.reason
    assert "/elsewhere/run/captures/capture-1" in away.reason
    # another capture's folder, or one that is not a capture folder: not opened
    assert not where_to_open(capture([str(folder / "rank-0.json.gz")], id=2)).folders
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "rank-0.json.gz").write_bytes(b"")
    assert not where_to_open(capture([str(other / "rank-0.json.gz")])).folders
    none = where_to_open(capture([], findings=None, states={"0": "recording"}))
    assert not none.folders and none.reason == "capture 1 has no trace yet (recording)"


def test_verdict_of_a_capture() -> None:
    assert verdict(capture([])) == "straggler (ranks 2)"
    assert verdict(capture([], findings=[])) == "no findings"
    assert verdict(capture([], findings=None)) == "analyzing..."
    assert verdict(capture([], findings=None, states={})) == "asked"
    assert verdict(capture([], error="some ranks never answered")).startswith("error: some")
