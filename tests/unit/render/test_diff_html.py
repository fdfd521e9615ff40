"""The diff page (`zdiag diff A B --html`) without a browser: content, escaping, self-contained."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from support.html_pages import without_plotlyjs
from zdiag.analyzers.compare.diff import diff_reports
from zdiag.analyzers.compare.model import RunDiff
from zdiag.analyzers.report import Report
from zdiag.render._sample import HOSTILE, sample_report
from zdiag.render.diff_html import render_diff_html

FIGURES = (
    "fig-a-breakdown",
    "fig-b-breakdown",
    "fig-a-fsdp-units",
    "fig-b-fsdp-units",
    "fig-a-memory",
    "fig-b-memory",
    "fig-step-deltas",
)
SECTIONS = ("summary", "side-by-side", "deltas", "ranks", "units", "collectives", "memory")
SECTIONS += ("findings", "config", "operators")


def _runs(hostile: bool = False) -> tuple[Report, Report, RunDiff]:
    """Two synthetic runs (B's unit and config names hostile when asked) and their diff."""
    a = sample_report(ranks=4, steps=6, seed=1)
    b = sample_report(ranks=4, steps=6, seed=2, hostile=hostile)
    a.run = {"world_size": 4, "config": {"prefetch": "explicit"}}
    b.run = {
        "world_size": 4,
        "config": {"prefetch": "off", **({HOSTILE: HOSTILE} if hostile else {})},
    }
    a.findings = a.findings[1:]  # so one finding appeared in B
    label_b = f"runs/b{HOSTILE}" if hostile else "runs/b"
    return a, b, diff_reports(a, b, baseline="runs/a", candidate=label_b)


@pytest.fixture(scope="module")
def page() -> str:
    a, b, diff = _runs()
    return render_diff_html(diff, a, b)


@pytest.fixture(scope="module")
def hostile_page() -> str:
    a, b, diff = _runs(hostile=True)
    return render_diff_html(diff, a, b)


def test_page_has_headline_labels_sections_and_figures(page: str) -> None:
    diff = _runs()[2]
    assert diff.headline and html.escape(diff.headline) in page
    assert "runs/a" in page and "runs/b" in page
    for anchor in SECTIONS:
        assert f'<section id="{anchor}">' in page
    ids = set(re.findall(r'id="(fig-[a-z0-9-]+)"', page))
    assert set(FIGURES) <= ids
    for u in diff.units:
        assert html.escape(u.unit or "(root)") in page
    assert "prefetch" in page and "explicit" in page  # the configuration difference
    assert "appeared" in page and diff.findings[0].id in page
    assert "Δ wait" in page and "GB/s A" in page


def test_hostile_names_are_escaped(hostile_page: str) -> None:
    body = without_plotlyjs(hostile_page)
    assert HOSTILE not in hostile_page
    assert "<script>document.title" not in hostile_page
    assert "<img src=x" not in hostile_page
    assert html.escape(HOSTILE, quote=True) in body  # shown as text (unit, config key, label)
    assert body.count("<script") == body.count("</script>")
    assert body.count("<!--") == 0


def test_page_is_self_contained(page: str) -> None:
    assert not re.search(r"<script[^>]+src=", page)
    assert "<link" not in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", without_plotlyjs(page))
    assert page.count('id="zdiag-plotly-gz"') == 1  # plotly.js inlined once


def test_runs_without_units_or_memory_say_so() -> None:
    a = sample_report(ranks=2, steps=4, units=0, seed=3)
    b = sample_report(ranks=2, steps=4, units=0, seed=4)
    a.memory, b.memory, a.fsdp_units, b.fsdp_units = [], [], [], []
    page = render_diff_html(diff_reports(a, b), a, b)
    assert "No FSDP units were found." in page and "No memory timeline." in page
    assert "Neither run has FSDP units." in page and "Neither run recorded memory." in page


def test_real_sample_traces() -> None:
    from zdiag.analyzers.engine.summary_pipeline import analyze_paths

    base, cand = "sample_traces/none", "sample_traces/missing-overlap"
    a = analyze_paths([Path(REPO_ROOT / base)])
    b = analyze_paths([Path(REPO_ROOT / cand)])
    diff = diff_reports(a, b, baseline=base, candidate=cand)
    page = render_diff_html(diff, a, b)
    assert html.escape(diff.headline) in page and base in page and cand in page
    assert "layers.0" in page and "missing-overlap" in page
    assert "fig-a-fsdp-units" in page and "fig-b-fsdp-units" in page
