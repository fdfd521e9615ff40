"""The diff browser (`zdiag diff A B --tui`): pilot tests of its tabs, tables and keys."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from textual.widgets import DataTable, Static, TabbedContent

from conftest import REPO_ROOT
from zdiag.analyzers.compare.diff import diff_reports
from zdiag.analyzers.compare.model import RunDiff
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.report import Report
from zdiag.render._sample import sample_report
from zdiag.tui.diff_app import TABS, DiffApp

pytestmark = pytest.mark.tui

SIZE = (130, 38)
MARKUP = "[bold red]x[/][/] [@click=app.quit]click[/] [link=http://evil]l"


@pytest.fixture(scope="module")
def runs() -> tuple[RunDiff, Report, Report]:
    """A run and one that ran out of memory: every section of their diff has rows."""
    base, cand = "sample_traces/none", "sample_traces/activation-oom"
    a = analyze_paths([Path(REPO_ROOT / base)])
    b = analyze_paths([Path(REPO_ROOT / cand)])
    return diff_reports(a, b, baseline=base, candidate=cand), a, b


def test_every_tab_shows_its_table(runs: tuple[RunDiff, Report, Report]) -> None:
    asyncio.run(_every_tab_shows_its_table(*runs))


async def _every_tab_shows_its_table(diff: RunDiff, a: Report, b: Report) -> None:
    app = DiffApp(diff, a, b)
    app.animation_level = "none"  # tab switches without their underline's animation: faster
    async with app.run_test(size=SIZE) as pilot:
        tabs = app.query_one(TabbedContent)
        assert tabs.active == "summary"
        summary = str(app.query_one("#summary-text", Static).render())
        assert diff.headline[:60] in summary and "sample_traces/activation-oom" in summary
        assert app.query_one("#step-table", DataTable).row_count == len(diff.step)
        assert app.query_one("#shares-table", DataTable).row_count == len(diff.shares)
        for tab, _, key in TABS[1:]:
            await pilot.press(key)
            await pilot.pause()
            assert tabs.active == tab
            table = app.query_one(f"#{tab}-table", DataTable)
            assert app.focused is table
            assert table.row_count > 0, tab
        units = app.query_one("#units-table", DataTable)
        assert units.row_count == len(diff.units)
        assert "(root)" in {units.get_cell_at((i, 0)).plain for i in range(units.row_count)}
        await pilot.press("s")
        assert tabs.active == "summary"
        await pilot.press("q")
        await pilot.pause()
        assert app._exit


def test_names_that_look_like_markup_are_shown_literally() -> None:
    asyncio.run(_names_that_look_like_markup_are_shown_literally())


async def _names_that_look_like_markup_are_shown_literally() -> None:
    a = sample_report(ranks=2, steps=4, seed=1)
    b = sample_report(ranks=2, steps=4, seed=2)
    b.fsdp_units[0].name = MARKUP
    b.run = {"config": {MARKUP: MARKUP}}
    diff = diff_reports(a, b, baseline="a", candidate=MARKUP)
    app = DiffApp(diff, a, b)
    app.animation_level = "none"
    async with app.run_test(size=SIZE) as pilot:
        assert MARKUP in str(app.query_one("#summary-text", Static).render())
        await pilot.press("g")
        config = app.query_one("#config-table", DataTable)
        keys = {config.get_cell_at((i, 0)).plain for i in range(config.row_count)}
        assert MARKUP in keys
        await pilot.press("u")
        units = app.query_one("#units-table", DataTable)
        assert MARKUP in {units.get_cell_at((i, 0)).plain for i in range(units.row_count)}
        assert app.is_running  # the [@click=app.quit] name did nothing


def test_run_diff_app_runs_the_app(monkeypatch: pytest.MonkeyPatch) -> None:
    from zdiag.tui import diff_app

    ran: list[RunDiff] = []
    monkeypatch.setattr(diff_app.DiffApp, "run", lambda self, **kw: ran.append(self.diff))
    a = sample_report(ranks=1, steps=3, seed=1)
    diff = diff_reports(a, a)
    diff_app.run_diff_app(diff, a, a)
    assert ran == [diff]
