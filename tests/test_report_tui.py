"""The report browser: pilot tests of the drill-down and pinned snapshots of its screens.

Snapshots live in tests/__snapshots__/test_report_tui/; after an intended change of the screens,
review and update them with `pytest tests/test_report_tui.py --snapshot-update`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from textual.widgets import DataTable, Static, TabbedContent

from zdiag.analyzers.report import Report
from zdiag.render._sample import empty_report, sample_report
from zdiag.tui.report_app import ReportApp

pytestmark = pytest.mark.tui

SIZE = (130, 38)
MARKUP = "[bold red]x[/][/] [@click=app.quit]click[/] [link=http://evil]l"


def _static_text(app: ReportApp, selector: str) -> str:
    return str(app.query_one(selector, Static).render())


def test_rank_then_step_drill_down() -> None:
    asyncio.run(_rank_then_step_drill_down())


async def _rank_then_step_drill_down() -> None:
    report = sample_report()
    app = ReportApp(report)
    async with app.run_test(size=SIZE) as pilot:
        ranks = app.query_one("#ranks", DataTable)
        steps = app.query_one("#steps-table", DataTable)
        assert ranks.row_count == 8 and app.focused is ranks
        await pilot.press("down", "down", "down")  # rank 3
        await pilot.pause()
        assert app.current_rank is not None and app.current_rank.rank == 3
        assert steps.row_count == 20
        await pilot.press("enter")  # into its steps
        assert app.focused is steps
        for _ in range(5):
            await pilot.press("down")  # step 5: the one with a timeline
        await pilot.pause()
        detail = _static_text(app, "#step-detail")
        step5 = report.ranks[3].steps[5]
        assert "Rank 3 · step 5" in detail and step5.verdict in detail
        assert f"{step5.exposed_comm_ms:.1f} ms" in detail
        assert "missing-overlap" in detail  # the findings that concern this step
        spans = app.query_one("#spans", DataTable)
        timeline = next(t for t in report.timelines if (t.rank, t.step) == (3, 5))
        assert spans.row_count == len(timeline.spans)
        await pilot.press("enter")
        assert app.focused is spans
        await pilot.press("escape", "escape")
        assert app.focused is ranks


def test_findings_tab_shows_evidence_and_recommendation() -> None:
    asyncio.run(_findings_tab_shows_evidence_and_recommendation())


async def _findings_tab_shows_evidence_and_recommendation() -> None:
    app = ReportApp(sample_report())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f")
        await pilot.pause()
        assert app.query_one(TabbedContent).active == "findings"
        detail = _static_text(app, "#finding-detail")
        assert "missing-overlap" in detail and "Evidence" in detail
        assert "set_modules_to_forward_prefetch" in detail and "Expected gain" in detail
        await pilot.press("down")
        await pilot.pause()
        assert "straggler" in _static_text(app, "#finding-detail")
        await pilot.press("m")
        assert app.query_one(TabbedContent).active == "summary"
        assert "exposed-comm" in _static_text(app, "#summary-text")


def test_names_that_look_like_markup_are_shown_literally() -> None:
    asyncio.run(_names_that_look_like_markup_are_shown_literally())


async def _names_that_look_like_markup_are_shown_literally() -> None:
    report = sample_report(ranks=2, steps=6)
    report.findings[0].title = MARKUP
    report.findings[0].evidence = {"kernel": MARKUP}
    report.timelines[0].spans[0].name = MARKUP
    report.warnings = [MARKUP]
    app = ReportApp(report)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("enter", *["down"] * 5)
        await pilot.pause()
        assert app.query_one("#spans", DataTable).get_cell_at((0, 3)).plain == MARKUP
        await pilot.press("f")
        await pilot.pause()
        assert MARKUP in _static_text(app, "#finding-detail")
        await pilot.press("m")
        assert MARKUP in _static_text(app, "#summary-text")
        assert app.is_running  # the [@click=app.quit] name did nothing


def test_empty_report() -> None:
    asyncio.run(_empty_report())


async def _empty_report() -> None:
    app = ReportApp(empty_report())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("down", "enter", "f", "down", "enter", "m", "s")
        await pilot.pause()
        assert "No steps in this report" in _static_text(app, "#step-detail")
        assert "No findings" in _static_text(app, "#finding-detail")


def test_browse_runs_the_app(monkeypatch: pytest.MonkeyPatch) -> None:
    from zdiag.tui import report_app

    ran: list[Report] = []
    monkeypatch.setattr(report_app.ReportApp, "run", lambda self, **kw: ran.append(self.report))
    report = sample_report(ranks=1, steps=1)
    report_app.browse(report)
    assert ran == [report]


def test_snapshot_steps(snap_compare: Any) -> None:
    app = ReportApp(sample_report())
    assert snap_compare(app, press=["down", "enter", *["down"] * 5], terminal_size=SIZE)


def test_snapshot_findings(snap_compare: Any) -> None:
    app = ReportApp(sample_report())
    assert snap_compare(app, press=["f"], terminal_size=SIZE)


def test_snapshot_empty_report(snap_compare: Any) -> None:
    assert snap_compare(ReportApp(empty_report()), terminal_size=SIZE)
