"""`--perfetto FILE`: the ranks' traces and zdiag's tracks in one file for ui.perfetto.dev."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from support.rendering import render_file
from zdiag.analyzers.inputs.raw_events import read_raw_events
from zdiag.analyzers.report import Report
from zdiag.render._sample import sample_report
from zdiag.render.perfetto_merge import collective_kind
from zdiag.render.perfetto_overlay import OVERLAY_PID_BASE

RUN = REPO_ROOT / "sample_traces" / "missing-overlap"


@pytest.fixture(scope="module")
def report() -> Report:
    from zdiag.analyzers.engine.summary_pipeline import analyze_paths

    return analyze_paths([RUN])


def test_one_file_holds_every_rank_trace_and_the_overlay(report: Report, tmp_path: Path) -> None:
    out = tmp_path / "merged.json.gz"
    assert render_file("perfetto", report, out).notes == []
    trace = json.loads(gzip.decompress(out.read_bytes()))
    events = trace["traceEvents"]
    names = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
    assert "zdiag · rank 0 (vm)" in names and "zdiag · rank 1 (vm)" in names
    assert any(n.startswith("rank 0 · ") for n in names)
    assert any(n.startswith("rank 1 · ") for n in names)
    # every original event of both ranks is there, on processes of its own rank
    originals = {r.rank: read_raw_events(Path(r.source)) for r in report.ranks}
    for rank, raw in originals.items():
        mine = [
            e
            for e in events
            if isinstance(e.get("pid"), int)
            and e["pid"] // 1000 == rank
            and e["pid"] < OVERLAY_PID_BASE
            and e.get("ph") != "M"
        ]
        assert len(mine) == sum(1 for e in raw if e.get("ph") != "M")
    assert trace["otherData"]["ranks_with_their_trace"] == [0, 1]


def test_finding_markers_sit_on_the_gathers_they_are_about(report: Report, tmp_path: Path) -> None:
    out = tmp_path / "merged.json"
    render_file("perfetto", report, out)
    events = json.loads(out.read_text())["traceEvents"]
    finding = next(f for f in report.findings if f.id == "missing-overlap")
    marks = [e for e in events if e.get("cat") == "zdiag.finding" and e["ph"] == "X"]
    assert marks
    for rank in report.ranks:
        raw = read_raw_events(Path(rank.source))
        steps = [s for s in rank.steps if s.step in finding.steps]
        windows = [
            (
                rank.trace_start_us + s.start_ms * 1e3,
                rank.trace_start_us + (s.start_ms + s.duration_ms) * 1e3,
            )
            for s in steps
        ]
        gathers = {
            (float(e["ts"]), float(e.get("dur", 0)))
            for e in raw
            if e.get("ph") == "X"
            and collective_kind(str(e.get("name", ""))) == "all_gather"
            and any(lo <= float(e["ts"]) < hi for lo, hi in windows)
        }
        mine = {(m["ts"], m["dur"]) for m in marks if m["pid"] == OVERLAY_PID_BASE + rank.rank}
        assert mine and mine <= gathers  # each marker covers one of the exposed all-gathers
        assert len(mine) == len(gathers)


def test_rank_placeholder_writes_one_file_per_rank(report: Report, tmp_path: Path) -> None:
    render_file("perfetto", report, tmp_path / "rank-{rank}.json")
    for rank in (0, 1):
        events = json.loads((tmp_path / f"rank-{rank}.json").read_text())["traceEvents"]
        zdiag = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
        assert f"zdiag · rank {rank} (vm)" in zdiag
        assert not any(n.startswith(f"rank {1 - rank} ·") for n in zdiag)


def test_missing_traces_give_the_overlay_alone_and_say_so(tmp_path: Path) -> None:
    rendered = render_file("perfetto", sample_report(ranks=2, steps=2), tmp_path / "o.json")
    assert any("no readable trace for ranks 0–1" in n for n in rendered.notes)
    assert (
        json.loads((tmp_path / "o.json").read_text())["otherData"]["ranks_with_their_trace"] == []
    )


def test_collective_names() -> None:
    assert collective_kind("gloo:all_gather") == "all_gather"
    assert collective_kind("nccl:reduce_scatter") == "reduce_scatter"
    assert (
        collective_kind("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long)")
        == "all_gather"
    )
    assert collective_kind("ncclKernel_AllReduce_RING_LL_Sum_float") == "all_reduce"
    assert collective_kind("aten::mm") is None


def test_the_root_unit_is_named_root_in_the_tracks() -> None:
    from zdiag.render.perfetto_overlay import overlay_events

    report = sample_report(ranks=1, steps=1)
    report.findings[0].units = ["", "layers.0"]
    report.findings[0].ranks = [0]
    events = overlay_events(report)["traceEvents"]
    units = [e["args"]["units"] for e in events if e.get("args", {}).get("units")]
    assert units and units[0] == ["(root)", "layers.0"]


def test_traces_are_read_through_the_bounded_input_reader(report: Report, tmp_path: Path) -> None:
    """A FIFO as a rank's trace is never opened for a blocking read, and a trace over the size
    limit in force is not read: both ranks get their zdiag tracks alone, and a note says so."""
    import os

    import msgspec

    from zdiag.analyzers.inputs.safe_read import use_limits

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    odd = msgspec.structs.replace(
        report,
        ranks=[
            msgspec.structs.replace(report.ranks[0], source=str(fifo)),
            report.ranks[1],
        ],
    )
    with use_limits(max_bytes=1000):  # the real trace of rank 1 is larger
        rendered = render_file("perfetto", odd, tmp_path / "o.json")
    assert any("no readable trace for ranks 0–1" in n for n in rendered.notes)
    merged = json.loads((tmp_path / "o.json").read_text())
    assert merged["otherData"]["ranks_with_their_trace"] == []


def test_the_renderer_writes_nothing_and_makes_rank_files_one_at_a_time(
    report: Report, tmp_path: Path
) -> None:
    from zdiag.render.perfetto import PerfettoRenderer
    from zdiag.render.renderer import Destination

    pattern = tmp_path / "rank-{rank}.json"
    rendered = PerfettoRenderer().render(report, Destination(pattern))
    assert rendered.paths == (tmp_path / "rank-0.json", tmp_path / "rank-1.json")
    assert list(tmp_path.iterdir()) == []
    outputs = iter(rendered.outputs)
    first = next(outputs)
    assert first.path == tmp_path / "rank-0.json" and json.loads(first.data)["traceEvents"]
    assert list(tmp_path.iterdir()) == []  # bytes handed over, never written by the renderer
