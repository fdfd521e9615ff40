"""The report browser: pilot tests of the drill-down and pinned snapshots of its screens.

Snapshots live in tests/integration/ui/__snapshots__/test_report_tui/; after an intended change of the screens,
review and update them with `pytest tests/integration/ui/test_report_tui.py --snapshot-update`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from textual.widgets import DataTable, Static, TabbedContent

from zdiag.analyzers.report import Report
from zdiag.render._sample import empty_report, sample_report
from zdiag.render.stats import rank_stats
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
        ops = app.query_one("#ops", DataTable)
        timeline = next(t for t in report.timelines if (t.rank, t.step) == (3, 5))
        names = {(s.lane, s.name) for s in timeline.spans}
        assert ops.row_count == len(names)  # one row per kernel/op name, not per span
        totals = [float(ops.get_cell_at((i, 1)).plain.replace(",", "")) for i in range(3)]
        assert totals == sorted(totals, reverse=True)  # largest total first
        await pilot.press("enter")
        assert app.focused is ops
        await pilot.press("escape", "escape")
        assert app.focused is ranks


def test_aggregate_ops_adds_up_spans_by_name() -> None:
    from zdiag.analyzers.report import StepTimeline, TimelineSpan
    from zdiag.render.step_ops import aggregate_ops

    timeline = StepTimeline(
        rank=0,
        step=0,
        spans=[
            TimelineSpan("compute", "gemm", 0.0, 2.0),
            TimelineSpan("compute", "gemm", 5.0, 3.0),
            TimelineSpan("comm:all_gather", "nccl", 1.0, 4.0),
            TimelineSpan("compute", "relu", 9.0, 0.5),
        ],
    )
    ops = aggregate_ops(timeline)
    assert [(o.name, o.count, o.total_ms, o.max_ms) for o in ops] == [
        ("gemm", 2, 5.0, 3.0),
        ("nccl", 1, 4.0, 4.0),
        ("relu", 1, 0.5, 0.5),
    ]


def test_findings_tab_shows_evidence_and_recommendation() -> None:
    asyncio.run(_findings_tab_shows_evidence_and_recommendation())


async def _findings_tab_shows_evidence_and_recommendation() -> None:
    app = ReportApp(sample_report())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f")
        await pilot.pause()
        assert app.query_one(TabbedContent).active == "findings"
        ids = [app.findings[i].id for i in range(len(app.findings))]
        gains = [f.expected_gain_ms or 0.0 for f in app.findings]
        assert gains == sorted(gains, reverse=True)  # largest gain first, as in the text
        detail = _static_text(app, "#finding-detail")
        assert ids[0] in detail and "Evidence" in detail and "Expected gain" in detail
        await pilot.press("down")
        await pilot.pause()
        assert ids[1] in _static_text(app, "#finding-detail")
        await pilot.press("m")
        assert app.query_one(TabbedContent).active == "summary"
        assert "exposed-comm" in _static_text(app, "#summary-text")


def test_units_collectives_and_stragglers_tabs() -> None:
    asyncio.run(_units_collectives_and_stragglers_tabs())


async def _units_collectives_and_stragglers_tabs() -> None:
    report = sample_report()
    report.fsdp_units[0].name = ""
    app = ReportApp(report)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("u")
        await pilot.pause()
        units = app.query_one("#units-table", DataTable)
        assert app.focused is units and units.row_count == len(report.fsdp_units)
        cells = {units.get_cell_at((i, 1)).plain for i in range(units.row_count)}
        assert "(root)" in cells and "" not in cells
        await pilot.press("c")
        collectives = app.query_one("#collectives-table", DataTable)
        assert collectives.row_count == len(report.collectives)
        await pilot.press("t")
        stragglers = app.query_one("#stragglers-table", DataTable)
        assert stragglers.row_count == len(report.stragglers)
        worst = max(report.stragglers, key=lambda s: s.wait_caused_ms)
        assert stragglers.get_cell_at((0, 0)).plain == str(worst.rank)


def test_sort_and_filter() -> None:
    asyncio.run(_sort_and_filter())


async def _sort_and_filter() -> None:
    app = ReportApp(sample_report())
    async with app.run_test(size=SIZE) as pilot:
        ranks = app.query_one("#ranks", DataTable)
        await pilot.press("o", "o")  # sort by the second column: median ms, ascending
        medians = [float(ranks.get_cell_at((i, 1)).plain) for i in range(ranks.row_count)]
        assert medians == sorted(medians)
        await pilot.press("O")  # reversed
        medians = [float(ranks.get_cell_at((i, 1)).plain) for i in range(ranks.row_count)]
        assert medians == sorted(medians, reverse=True)
        await pilot.press("enter")  # the highlighted (slowest) rank's steps follow the sort
        await pilot.pause()
        slowest = max(app.ranks, key=lambda r: rank_stats(r).median_ms or 0.0)
        assert app.current_rank is slowest
        await pilot.press("escape", "u", "slash", *"layers.1")
        await pilot.pause()
        units = app.query_one("#units-table", DataTable)
        shown = {units.get_cell_at((i, 1)).plain for i in range(units.row_count)}
        assert shown == {"layers.1"}
        filtered = units.row_count
        assert filtered == sum(1 for u in app.report.fsdp_units if "layers.1" in u.name)
        assert "filter" in str(units.border_subtitle)
        await pilot.press("enter")
        assert app.focused is units and units.row_count == filtered
        await pilot.press("escape")  # clears the filter
        assert units.row_count == len(app.report.fsdp_units)


def test_help_and_ctrl_c() -> None:
    asyncio.run(_help_and_ctrl_c())


async def _help_and_ctrl_c() -> None:
    from zdiag.tui.report_app import HelpScreen

    app = ReportApp(sample_report(ranks=2, steps=3))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert "Ctrl-C" in str(app.screen.query_one("#help-text", Static).render())
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert app._exit  # quit, not a "press ctrl+q" notice


def test_names_that_look_like_markup_are_shown_literally() -> None:
    asyncio.run(_names_that_look_like_markup_are_shown_literally())


async def _names_that_look_like_markup_are_shown_literally() -> None:
    report = sample_report(ranks=2, steps=6)
    for finding in report.findings:  # whichever comes first
        finding.title = MARKUP
        finding.evidence = {"kernel": MARKUP}
    report.timelines[0].spans[0].name = MARKUP
    report.warnings = [MARKUP]
    app = ReportApp(report)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("enter", *["down"] * 5)
        await pilot.pause()
        ops = app.query_one("#ops", DataTable)
        names = [ops.get_cell_at((i, 0)).plain for i in range(ops.row_count)]
        assert any(n.startswith(MARKUP[:40]) for n in names)  # literal, cut to the cell width
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


def test_snapshot_steps_at_80x24(snap_compare: Any) -> None:
    app = ReportApp(sample_report())
    assert snap_compare(app, press=["down", "enter", *["down"] * 5], terminal_size=(80, 24))


def test_snapshot_units_at_80x24(snap_compare: Any) -> None:
    assert snap_compare(ReportApp(sample_report()), press=["u"], terminal_size=(80, 24))


def test_snapshot_help(snap_compare: Any) -> None:
    assert snap_compare(ReportApp(sample_report()), press=["question_mark"], terminal_size=(80, 24))
