"""The HTML report without a browser: self-contained, escaped, aggregated when large, atomic."""

from __future__ import annotations

import re
from pathlib import Path

import plotly
import pytest

from conftest import REPO_ROOT
from support.html_pages import without_plotlyjs
from support.rendering import render_file
from zdiag.collectors import fsio
from zdiag.errors import UserError
from zdiag.render import html as html_mod
from zdiag.render._sample import HOSTILE, empty_report, sample_report
from zdiag.render.html import render_html

SECTIONS = ("summary", "findings", "steps", "timeline", "fsdp", "memory", "collectives", "run")


@pytest.fixture(scope="module")
def sample_page() -> str:
    return render_html(sample_report())


@pytest.fixture(scope="module")
def hostile_page() -> str:
    return render_html(sample_report(hostile=True))


def test_page_is_self_contained(sample_page: str) -> None:
    assert f"plotly.js v{plotly.__version__}" in sample_page or "Plotly" in sample_page
    assert not re.search(r"<script[^>]+src=", sample_page)
    assert "<link" not in sample_page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", without_plotlyjs(sample_page))


def test_page_has_every_section_and_figure(sample_page: str) -> None:
    for anchor in SECTIONS:
        assert f'<section id="{anchor}">' in sample_page
    ids = re.findall(r'id="(fig-[a-z0-9-]+)"', sample_page)
    assert {"fig-step-time", "fig-exposed-comm", "fig-breakdown", "fig-timeline-0"} <= set(ids)
    assert {"fig-fsdp-units", "fig-memory-0", "fig-memory-1"} <= set(ids)
    # findings with evidence, recommendation, code, gain
    assert "set_modules_to_forward_prefetch" in sample_page
    assert "What to change:" in sample_page and "Expected gain: 12.5 ms per step" in sample_page
    assert "exposed-comm" in sample_page and "compute-bound" in sample_page


def test_empty_report_renders_without_figures() -> None:
    page = render_html(empty_report())
    assert "<script" not in page  # nothing to plot: no plotly.js either
    assert "No steps were found" in page and "No findings" in page
    for anchor in SECTIONS:
        assert f'<section id="{anchor}">' in page


def test_untrusted_names_are_escaped(hostile_page: str) -> None:
    rest = without_plotlyjs(hostile_page)
    assert HOSTILE not in hostile_page
    assert "<img" not in rest and "onerror=" not in rest.replace("onerror=&quot;", "")
    assert "<!--" not in rest
    # the only script blocks are plotly.js and one per figure
    figures = len(re.findall(r'class="plotly-graph-div"', rest))
    assert figures >= 7
    assert rest.count("<script") == figures
    assert rest.count("</script>") == figures
    # shown literally in text, and escaped inside plotly's JSON
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in rest
    assert "layers.0&lt;script&gt;" in rest  # a unit label inside a figure's JSON


def test_unsafe_plotly_output_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(
        html_mod.pio, "to_html", lambda *a, **k: "<div></div><script>x</script><script>y"
    )
    with pytest.raises(RuntimeError, match="unsafe script block"):
        render_file("html", sample_report(ranks=2, steps=2), tmp_path / "r.html")
    assert list(tmp_path.iterdir()) == []


def test_large_runs_are_aggregated_and_the_page_says_so() -> None:
    page = render_html(sample_report(ranks=300, steps=4, units=130, timeline_spans=1200))
    notes = page[page.index('<section id="notes">') :]
    assert "300 ranks x 4 steps aggregated into blocks of 2 rank(s) x 1 step(s)" in notes
    assert "the first 32 of 300 ranks" in notes
    assert "apart are drawn as one bar" in notes  # every lane drawn across the whole step
    assert "the 120 of 130 units with the largest exposed wait" in notes
    long = render_html(sample_report(ranks=2, steps=1100, units=2))
    assert "2 ranks x 1100 steps aggregated into blocks of 1 rank(s) x 3 step(s)" in long
    assert "each bar is the mean over a block of 3 steps" in long


def test_timelines_of_more_steps_than_drawn_are_noted() -> None:
    report = sample_report(ranks=4, steps=6)
    for i, t in enumerate(report.timelines):
        t.step = i  # each of the 4 ranks' representative step differs
    page = render_html(report)
    notes = page[page.index('<section id="notes">') :]
    assert "the rank timelines cover 4 different steps; the first 3 are drawn" in notes
    assert page.count('id="fig-timeline-') == 3


def test_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "report.html"
    target.write_text("old")
    monkeypatch.setattr(html_mod, "render_html", lambda report: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        render_file("html", sample_report(ranks=1, steps=1), target)
    assert target.read_text() == "old"
    monkeypatch.undo()
    render_file("html", sample_report(ranks=1, steps=1), target)
    assert target.read_text().startswith("<!DOCTYPE html>")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]


def test_failed_rename_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "report.html"
    target.write_text("old")

    def refuse(src: str, dst: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(fsio.os, "replace", refuse)
    with pytest.raises(UserError, match="cannot write"):
        render_file("html", sample_report(ranks=1, steps=1), target)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]


def test_missing_folder_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        render_file("html", empty_report(), tmp_path / "nope" / "report.html")


def test_memory_chart_units_follow_the_data() -> None:
    """A CPU run's 20 MiB reads in MiB (not 0.02 GiB); a GPU near its 80 GiB capacity in GiB,
    with the capacity line and the peak marked."""
    from zdiag.analyzers.report import MemoryTimeline
    from zdiag.render._html_figures import memory

    mib, gib = 1024**2, 1024**3
    small = MemoryTimeline(
        rank=0, source="trace", times_ms=[0.0, 1.0, 2.0],
        bytes_by_category={"ACTIVATION": [5 * mib, 20 * mib, 3 * mib]}, peak_bytes=20 * mib,
    )  # fmt: skip
    fig, _ = memory(small)
    assert fig is not None and fig.layout.yaxis.title.text == "MiB"
    assert next(t for t in fig.data if t.name == "peak").y == (20.0,)
    big = MemoryTimeline(
        rank=1, source="snapshot", times_ms=[0.0, 1.0],
        bytes_by_category={"PARAMETER": [70 * gib, 76 * gib]}, peak_bytes=76 * gib,
        capacity_bytes=80 * gib,
    )  # fmt: skip
    fig, _ = memory(big)
    assert fig is not None and fig.layout.yaxis.title.text == "GiB"
    assert [s.y0 for s in fig.layout.shapes] == [80.0]  # the capacity line


def test_a_two_rank_run_stays_within_the_3_mb_budget() -> None:
    from zdiag.analyzers.engine.summary_pipeline import analyze_paths

    run = REPO_ROOT / "sample_traces" / "missing-overlap"
    page = render_html(analyze_paths([run])).encode("utf-8")
    assert len(page) <= 3 * 1024 * 1024, f"{len(page) / 2**20:.2f} MiB"


def test_heatmap_colours_start_at_zero_so_noise_looks_alike() -> None:
    from zdiag.render import _html_figures as figs

    report = sample_report(ranks=2, steps=2)
    for rank, ms in zip(report.ranks, (408.0, 412.0), strict=True):
        for s in rank.steps:
            s.duration_ms = ms
    fig, _ = figs.heatmap(report, lambda s: s.duration_ms, "t", "Step time")
    assert fig is not None
    heat = fig.data[0]
    assert heat.zmin == 0 and heat.zmax == 412.0  # 408 and 412 sit at 99% and 100%


def test_a_failed_detector_is_not_reported_as_no_findings() -> None:
    report = sample_report(ranks=2, steps=2)
    report.findings = []
    report.warnings = ["detector straggler failed (KeyError: 3); its finding is missing"]
    report.failed_detectors = ["straggler"]
    page = render_html(report)
    assert "No findings" not in page
    assert "1 detector failed" in page and "straggler" in page
