"""One renderer contract: every renderer runs on the same Reports, the empty one included.

Formats: every entry of `zdiag.render.renderer.FORMATS` (text, JSON, HTML, Perfetto; the TUI
viewer), each renderer through the `Renderer` protocol and the one writer, plus `zdiag render`
re-rendering the same Report from its saved JSON, and the flags the commands make of the registry. The shared step-column spec is checked in every view: text, TUI, HTML, Perfetto.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from support.rendering import render_file
from zdiag.analyzers.report import Report, decode_report, encode_report
from zdiag.render._sample import empty_report, sample_report
from zdiag.render.columns import STEP_COLUMNS
from zdiag.render.renderer import FORMATS, Destination, Renderer, get_renderer, get_viewer

DURATION = next(c for c in STEP_COLUMNS if c.key == "duration_ms")

REPORTS: dict[str, Callable[[], Report]] = {
    "empty": empty_report,
    "sample": sample_report,
    "hostile-names": lambda: sample_report(hostile=True),
    "one-rank-one-step": lambda: sample_report(ranks=1, steps=1, units=1),
    "no-timeline-no-memory": lambda: _strip(sample_report(ranks=2, steps=3)),
    "repeated-ids": lambda: _repeat_ids(sample_report(ranks=2, steps=3)),
}


def _repeat_ids(report: Report) -> Report:
    """Odd input: two ranks with the same number, a step number that repeats."""
    report.ranks[1].rank = report.ranks[0].rank
    report.ranks[0].steps[1].step = report.ranks[0].steps[0].step
    return report


def _strip(report: Report) -> Report:
    report.timelines = []
    report.memory = []
    report.fsdp_units = []
    report.findings = []
    return report


def _to_file(name: str, report: Report, tmp: Path, file_name: str) -> str:
    """Run renderer `name` through the protocol into a file; its text."""
    path = tmp / file_name
    render_file(name, report, path)
    return path.read_text(encoding="utf-8")


def render_text(report: Report, tmp: Path) -> str:
    out = _to_file("text", report, tmp, "report.txt")
    assert out.endswith("\n")
    return out


def render_json(report: Report, tmp: Path) -> str:
    out = _to_file("json", report, tmp, "report.json")
    assert decode_report(out.encode()) == report  # round-trips
    return out


def render_html(report: Report, tmp: Path) -> str:
    page = _to_file("html", report, tmp, "report.html")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    return page


def render_perfetto(report: Report, tmp: Path) -> str:
    out = _to_file("perfetto", report, tmp, "overlay.json")
    assert isinstance(json.loads(out)["traceEvents"], list)
    return out


def render_tui(report: Report, tmp: Path) -> str:
    from textual.widgets import DataTable

    from zdiag.tui.report_app import ReportApp

    async def drive() -> str:
        app = ReportApp(report)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            first_screen = app.export_screenshot()  # rank 0 and its steps
            assert app.query_one("#ranks", DataTable).row_count == len(report.ranks)
            steps = app.query_one("#steps-table", DataTable)
            assert [str(c.label) for c in steps.columns.values()] == [
                c.header for c in STEP_COLUMNS
            ]
            if report.ranks and report.ranks[0].steps:  # the cells of rank 0's first step
                cells = [str(getattr(c, "plain", c)) for c in steps.get_row_at(0)]
                first_step = sorted(report.ranks, key=lambda r: r.rank)[0].steps[0]
                assert cells == [c.cell(first_step) for c in STEP_COLUMNS]
            await pilot.press("down", "enter", "down", "enter", "f", "down", "m", "s")
            await pilot.pause()
            return first_screen

    return asyncio.run(drive())


RENDERERS_UNDER_TEST: dict[str, Callable[[Report, Path], str]] = {
    "text": render_text,
    "json": render_json,
    "html": render_html,
    "perfetto": render_perfetto,
    "tui": render_tui,
}


def test_every_registered_format_is_tested_and_implements_the_protocol() -> None:
    assert {fmt.name for fmt in FORMATS} == set(RENDERERS_UNDER_TEST)
    for fmt in FORMATS:
        if fmt.kind == "viewer":
            assert callable(get_viewer(fmt.name))
            with pytest.raises(KeyError):
                get_renderer(fmt.name)
        else:
            renderer = get_renderer(fmt.name)
            assert isinstance(renderer, Renderer) and renderer.name == fmt.name


@pytest.mark.parametrize("report_name", list(REPORTS))
@pytest.mark.parametrize("renderer", list(RENDERERS_UNDER_TEST))
def test_every_renderer_renders_every_report(
    renderer: str, report_name: str, tmp_path: Path
) -> None:
    report = REPORTS[report_name]()
    out = RENDERERS_UNDER_TEST[renderer](report, tmp_path)
    assert out  # something was produced, even for the empty report
    if report.ranks and renderer in ("html", "text", "tui"):
        # the numbers come from the Report: the first step's duration is shown
        first = report.ranks[0].steps[0].duration_ms
        assert (
            repr(first) if renderer == "html" else DURATION.cell(report.ranks[0].steps[0])
        ) in out
    if report.ranks and renderer in ("html", "text"):
        for column in STEP_COLUMNS:  # every step column has its header
            assert column.header in out, column.key
    if report.ranks and renderer == "perfetto":
        slices = [e for e in json.loads(out)["traceEvents"] if e.get("cat") == "zdiag.step"]
        assert slices and all(set(e["args"]) >= {c.key for c in STEP_COLUMNS} for e in slices)


@pytest.mark.parametrize("report_name", list(REPORTS))
@pytest.mark.parametrize("fmt", ["text", "html", "perfetto"])
def test_zdiag_render_matches_the_renderer_on_the_saved_report(
    fmt: str,
    report_name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`zdiag render saved.json --FORMAT` gives the bytes the renderer gives on the Report."""
    from zdiag.cli import main

    monkeypatch.delenv("COLUMNS", raising=False)  # the default width, as for a file (xdist sets it)

    # through JSON once: the sample builders put ints in some float fields, as JSON keeps them
    report = decode_report(encode_report(REPORTS[report_name]()))
    saved = tmp_path / "saved.json"
    saved.write_bytes(encode_report(report))
    direct = tmp_path / "direct"
    direct.mkdir()
    expected = RENDERERS_UNDER_TEST[fmt](report, direct)
    out = tmp_path / "out"
    if fmt == "text":
        assert main(["render", str(saved)]) == 0
        assert capsys.readouterr().out == expected
        assert main(["render", str(saved), "--text", "-o", str(out)]) == 0
    else:
        assert main(["render", str(saved), f"--{fmt}", str(out)]) == 0, capsys.readouterr().err
    assert out.read_text(encoding="utf-8") == expected


def test_zdiag_render_tui_browses_the_saved_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zdiag.cli import main
    from zdiag.tui import report_app

    browsed: list[Report] = []
    monkeypatch.setattr(report_app, "browse", browsed.append)
    monkeypatch.setattr("zdiag.render.terminal.check_tui_possible", lambda **kw: None)
    report = sample_report(ranks=2, steps=3)
    saved = tmp_path / "saved.json"
    saved.write_bytes(encode_report(report))
    assert main(["render", str(saved), "--tui"]) == 0
    assert browsed == [report]


@pytest.mark.parametrize("fmt", [f.name for f in FORMATS if f.kind != "viewer"])
def test_renderers_return_bytes_and_write_nothing(fmt: str, tmp_path: Path) -> None:
    report = sample_report(ranks=2, steps=3)
    target = tmp_path / "out"
    rendered = get_renderer(fmt).render(report, Destination(target))
    assert rendered.paths == (target,)
    data = rendered.data()
    assert isinstance(data, bytes) and data
    assert list(tmp_path.iterdir()) == []  # only zdiag.render.output writes
    on_stdout = get_renderer(fmt).render(report, Destination.stdout())
    assert on_stdout.paths == (None,)


def test_renderers_leave_no_temporary_files(tmp_path: Path) -> None:
    report = sample_report(ranks=2, steps=3)
    render_html(report, tmp_path)
    render_perfetto(report, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["overlay.json", "report.html"]


def test_every_renderer_renders_a_real_report(real_traces: Path, tmp_path: Path) -> None:
    """The same contract on a Report analyzed from real traces (2 ranks, HTA's sampled_128)."""
    from zdiag.analyzers.engine.summary_pipeline import analyze_paths

    report = analyze_paths([real_traces / "hta" / "sampled_128"])
    assert report.ranks and all(r.steps for r in report.ranks)
    for name, renderer in RENDERERS_UNDER_TEST.items():
        assert renderer(report, tmp_path), name


def test_analyze_cli_writes_html_and_overlay(
    real_traces: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`zdiag analyze PATH --html FILE --perfetto FILE` reaches these renderers."""
    from zdiag.cli import main

    html_path, overlay_path = tmp_path / "r.html", tmp_path / "o.json"
    trace = real_traces / "hta" / "sampled_128"
    code = main(["analyze", str(trace), "--html", str(html_path), "--perfetto", str(overlay_path)])
    assert code == 0, capsys.readouterr().err
    assert html_path.read_text().startswith("<!DOCTYPE html>")
    assert json.loads(overlay_path.read_text())["traceEvents"]
