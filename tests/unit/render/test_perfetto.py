"""The Perfetto overlay: valid Chrome trace JSON, aligned tracks per rank, verdicts and findings."""

from __future__ import annotations

import gzip
import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec

from zdiag.analyzers.report import Report
from zdiag.render import perfetto_overlay as perfetto
from zdiag.render._sample import HOSTILE, empty_report, sample_report
from zdiag.render.perfetto_overlay import OVERLAY_PID_BASE, overlay_events


def _write_overlay(report: Report, path: Path) -> None:
    path.write_bytes(msgspec.json.encode(overlay_events(report)))


def _load(path: Path) -> list[dict[str, Any]]:
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events: list[dict[str, Any]] = trace["traceEvents"]
    for ev in events:
        assert ev["ph"] in {"M", "X", "C", "i"}
        assert isinstance(ev["pid"], int)
        if ev["ph"] != "M":
            assert isinstance(ev["ts"], (int, float))
    return events


def test_tracks_per_rank_aligned_to_trace_timestamps(tmp_path: Path) -> None:
    report = sample_report(ranks=4, steps=6)
    _write_overlay(report, tmp_path / "o.json")
    events = _load(tmp_path / "o.json")
    names = {
        ev["pid"]: ev["args"]["name"]
        for ev in events
        if ev["ph"] == "M" and ev["name"] == "process_name"
    }
    assert names[OVERLAY_PID_BASE + 3] == "zdiag · rank 3 (node0)"
    slices = [ev for ev in events if ev["ph"] == "X"]
    assert len(slices) == 4 * 6
    rank2 = report.ranks[2]
    step = rank2.steps[4]
    ev = next(e for e in slices if e["pid"] == OVERLAY_PID_BASE + 2 and e["args"]["step"] == 4)
    assert ev["name"] == f"step 4: {step.verdict}"
    assert ev["ts"] == round(rank2.trace_start_us + step.start_ms * 1000, 3)
    assert ev["dur"] == round(step.duration_ms * 1000, 3)
    assert ev["args"]["exposed_comm_ms"] == step.exposed_comm_ms
    counters = [e for e in events if e["ph"] == "C" and e["pid"] == OVERLAY_PID_BASE + 2]
    assert [c["args"]["ms"] for c in counters][:6] == [
        round(s.exposed_comm_ms, 3) for s in rank2.steps
    ]
    assert counters[-1]["args"]["ms"] == 0  # closed after the last step


def test_slices_on_a_track_never_overlap(tmp_path: Path) -> None:
    report = sample_report(ranks=2, steps=5)
    report.ranks[0].steps[2].duration_ms += 50.0  # runs into the next step (bad input)
    _write_overlay(report, tmp_path / "o.json")
    by_track: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for ev in _load(tmp_path / "o.json"):
        if ev["ph"] == "X":
            by_track[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"]))
    for spans in by_track.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in itertools.pairwise(spans))


def test_findings_are_instant_markers_with_evidence(tmp_path: Path) -> None:
    report = sample_report(ranks=3, steps=4, hostile=True)
    report.findings[2].ranks = []  # a finding about no rank in particular: a global marker
    _write_overlay(report, tmp_path / "o.json")
    markers = [ev for ev in _load(tmp_path / "o.json") if ev["ph"] == "i"]
    overlap = [m for m in markers if m["name"] == "critical: missing-overlap"]
    assert {m["pid"] - OVERLAY_PID_BASE for m in overlap} == {0, 1, 2}
    assert all(m["s"] == "t" and m["tid"] == perfetto.FINDING_TID for m in overlap)
    full = [m for m in overlap if "evidence" in m["args"]]
    assert len(full) == 3  # evidence once per rank
    assert "set_modules_to_forward_prefetch" in full[0]["args"]["code"]
    warmup = [m for m in markers if m["name"] == "info: first-step-warmup"]
    assert len(warmup) == 1 and warmup[0]["s"] == "g"
    assert HOSTILE in full[0]["args"]["title"]  # names with markup stay plain JSON strings


def test_empty_report_gives_an_empty_valid_trace(tmp_path: Path) -> None:
    _write_overlay(empty_report(), tmp_path / "o.json")
    assert _load(tmp_path / "o.json") == []


def test_large_runs_keep_the_file_compact(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(perfetto, "MAX_DETAILED_STEPS", 10)
    _write_overlay(sample_report(ranks=2, steps=8), tmp_path / "o.json")
    trace = json.loads((tmp_path / "o.json").read_text())
    assert trace["otherData"]["step_args"].startswith("none")
    assert all("args" not in ev for ev in trace["traceEvents"] if ev["ph"] == "X")


def test_overlay_lines_up_with_the_original_trace(real_traces: Path, tmp_path: Path) -> None:
    """Each step slice starts exactly where the trace's ProfilerStep#N annotation starts."""
    from zdiag.analyzers.engine.summary_pipeline import analyze_paths

    source = real_traces / "hta" / "sampled_128" / "rank-0.json.gz"
    _write_overlay(analyze_paths([source]), tmp_path / "o.json")
    with gzip.open(source, "rt") as fh:
        original = json.load(fh)["traceEvents"]
    annotated = {
        int(e["name"].split("#")[1]): float(e["ts"])
        for e in original
        if str(e.get("name", "")).startswith("ProfilerStep#")
    }
    slices = [e for e in _load(tmp_path / "o.json") if e["ph"] == "X"]
    assert slices
    for ev in slices:
        assert abs(ev["ts"] - annotated[ev["args"]["step"]]) < 1.0  # µs


def test_non_finite_numbers_do_not_break_the_json(tmp_path: Path) -> None:
    report = sample_report(ranks=1, steps=3)
    report.ranks[0].steps[1].duration_ms = float("nan")
    report.ranks[0].steps[2].start_ms = float("inf")
    report.ranks[0].steps[0].exposed_comm_ms = float("nan")
    _write_overlay(report, tmp_path / "o.json")
    for ev in _load(tmp_path / "o.json"):
        if ev["ph"] == "X":
            assert ev["dur"] >= 0 and ev["ts"] == ev["ts"]  # numbers, not null/NaN
        if ev["ph"] == "C":
            assert isinstance(ev["args"]["ms"], (int, float))
