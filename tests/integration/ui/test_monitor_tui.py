"""The monitor's Textual app, driven by a fake source and a frozen clock (pilots and snapshots)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import DataTable, Static

from support.monitor_records import NOW, job, rec
from zdiag.tui.monitor_app import MonitorApp

pytestmark = [pytest.mark.tui, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    """Textual runs on asyncio (anyio's pytest plugin runs the async tests)."""
    return "asyncio"


class FakeSource:
    """Hands out queued batches of records, one batch per poll (a `MonitorSource`)."""

    def __init__(self, *batches: list[dict[str, Any]], rejected: int = 0) -> None:
        self.batches = list(batches)
        self.rejected = rejected
        self.closed = False

    def poll(self) -> list[dict[str, Any]]:
        return self.batches.pop(0) if self.batches else []

    def close(self) -> None:
        self.closed = True


def problem_job() -> list[dict[str, Any]]:
    """16 ranks on 4 nodes: a straggler, a creeping rank, a stale one, a vanished one."""
    grow = {"mem_allocated_bytes": lambda s: float(2 << 30) + s * 64 * 2**20}
    records = job(
        ranks=16,
        steps=31,  # the last step arrives at NOW
        r5={
            "compute_ms": 95.0,
            "exposed_comm_ms": 0.0,
            "step_time_ms": lambda s: 101.0 + s % 4 * 15,
        },
        r9=grow,
    )
    # rank 12 stopped 8 s ago (stale), rank 13 a minute ago (gone)
    delay = {12: 8.0, 13: 60.0}
    return [
        dict(r, ts=r["ts"] - delay[r["rank"]], recv_ts=r["recv_ts"] - delay[r["rank"]])
        if r["rank"] in delay
        else r
        for r in records
    ]


def make_app(
    *batches: list[dict[str, Any]],
    rejected: int = 0,
    poll_interval_s: float = 0.05,
    listen: str = "127.0.0.1:5577",
) -> MonitorApp:
    return MonitorApp(
        FakeSource(*batches, rejected=rejected),
        clock=lambda: NOW,
        poll_interval_s=poll_interval_s,
        refresh_interval_s=3600,  # tests refresh explicitly
        listen=listen,
    )


def two_jobs() -> list[dict[str, Any]]:
    """job-7 (4 ranks) ended cleanly at step 29; job-8 (2 ranks) runs, its rank 1 waits longer."""
    old = job(ranks=4, r2={"compute_ms": 95.0})
    ended = [
        rec(r, 29, ended="finished", step_time_ms=None, compute_ms=None, mem_allocated_bytes=None)
        for r in range(4)
    ]
    new = [
        dict(r, job="job-8", pid=200 + r["rank"], ts=r["ts"] + 30, recv_ts=r["recv_ts"] + 30)
        for r in job(ranks=2, steps=12, r1={"exposed_comm_ms": 40.0, "step_time_ms": 120.0})
    ]
    return old + ended + new


def header_text(app: MonitorApp) -> str:
    return str(app.query_one("#header", Static).render())


def first_column(app: MonitorApp) -> list[str]:
    table = app.query_one("#ranks", DataTable)
    return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]


async def test_header_table_and_findings_show_the_job() -> None:
    app = make_app(problem_job(), rejected=3)
    async with app.run_test(size=(130, 40)) as pilot:
        await pilot.pause()
        header = header_text(app)
        assert "job job-7" in header and "14 ranks" in header
        assert "1 straggler" in header and "1 stale" in header and "1 gone" in header
        assert "rejected 3" in header
        table = app.query_one("#ranks", DataTable)
        assert table.row_count == 16
        ids = [f.id for f in app.last_view.findings] if app.last_view else []
        assert ids == ["straggler", "stall", "memory-creep"]  # rank 12 is stale: a stall
        assert "[critical] straggler" in str(app.query_one("#findings", Static).render())
    assert app.source.closed  # type: ignore[attr-defined]


async def test_sort_keys_and_worst_first() -> None:
    app = make_app(problem_job())
    async with app.run_test(size=(130, 40)) as pilot:
        await pilot.pause()
        assert (app.sort_key, app.sort_reverse) == ("step time", True)
        assert first_column(app)[:3] == ["5", "0", "1"]  # slowest first, ties by rank
        assert "sort: step time (desc)" in header_text(app)
        await pilot.press("w")
        assert first_column(app)[:3] == ["13", "12", "5"]  # gone, stale, straggler
        await pilot.press("s")  # status -> rank (the cycle wraps)
        assert app.sort_key == "rank" and first_column(app)[:3] == ["0", "1", "2"]
        await pilot.press("r")
        assert first_column(app)[0] == "15"
        await pilot.press("s")  # step time, keeping the descending order
        assert app.sort_key == "step time" and app.sort_reverse


async def test_late_attach_pause_and_findings_toggle() -> None:
    # Nothing at first (the job has not started, or the monitor attached between records).
    app = make_app([], [], problem_job(), poll_interval_s=0.5)
    async with app.run_test(size=(130, 40)) as pilot:
        await pilot.pause()
        assert "0 ranks" in header_text(app)
        await pilot.pause(1.3)  # the poll timer picks the records up
        await pilot.press("p")
        assert "[paused]" in header_text(app)
        await pilot.press("p")
        assert "14 ranks" in header_text(app)
        await pilot.press("f")
        assert not app.query_one("#findings", Static).display


def test_snapshot_problem_job(snap_compare: Any) -> None:
    assert snap_compare(make_app(problem_job(), rejected=2), terminal_size=(130, 36))


def test_snapshot_empty(snap_compare: Any) -> None:
    assert snap_compare(make_app(), terminal_size=(100, 20))


async def test_refresh_updates_cells_in_place_and_rebuilds_on_reorder() -> None:
    app = make_app(problem_job())
    async with app.run_test(size=(130, 40)) as pilot:
        await pilot.pause()
        table = app.query_one("#ranks", DataTable)
        await pilot.press("w", "s")  # by rank
        app.state.ingest([rec(0, 31, ts=NOW, recv_ts=NOW, step_time_ms=250.0)], NOW)
        app.refresh_view()  # same order (by rank): cells are updated in place
        assert [str(c) for c in table.get_row("0")][2:4] == ["31", "250 ms"]
        await pilot.press("s")  # by step time: the order changes, the table is rebuilt
        assert first_column(app)[:2] == ["1", "2"]  # 100 ms ranks first, rank 0 (250 ms) last
        await pilot.press("r")
        assert first_column(app)[0] == "0"


class BrokenSource(FakeSource):
    def poll(self) -> list[dict[str, Any]]:
        raise RuntimeError("socket gone")


async def test_a_failing_source_does_not_crash_the_app() -> None:
    app = MonitorApp(BrokenSource(), clock=lambda: NOW, refresh_interval_s=3600)
    async with app.run_test(size=(100, 20)) as pilot:
        await pilot.pause()
        assert app.source_error == "RuntimeError: socket gone"
        assert "0 ranks" in header_text(app)


async def test_app_on_a_real_receiver_follows_a_real_publisher() -> None:
    from zdiag.live.publisher import StepPublisher
    from zdiag.live.receiver import LiveReceiver

    receiver = LiveReceiver("127.0.0.1:0")
    app = MonitorApp(receiver, poll_interval_s=0.05, refresh_interval_s=0.1)
    pub = StepPublisher(str(receiver.endpoint), rank=3, host="node0", job="live-1")
    try:
        async with app.run_test(size=(130, 30)) as pilot:
            for step in range(100):  # ~5 s at most; stops as soon as the table shows rank 3
                pub.publish({"rank": 3, "host": "node0", "step": step, "step_time_ms": 50.0})
                await pilot.pause(0.05)
                if first_column(app) == ["3"] and "job live-1" in header_text(app):
                    break
            assert first_column(app) == ["3"]
            assert "job live-1 · 1 ranks" in header_text(app)
    finally:
        pub.close()


def screen_text(app: MonitorApp) -> str:
    return "\n".join(str(w.render()) for w in app.screen.query(Static))


async def test_enter_opens_the_rank_detail_and_escape_closes_it() -> None:
    from zdiag.tui.monitor_screens import RankScreen

    records = problem_job()
    for r in records:
        if r["rank"] == 5:
            r["last_collective"] = "reduce_scatter_single 8.0 MiB"
    app = make_app(records)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.press("enter")  # the cursor is on the slowest rank: 5
        assert isinstance(app.screen, RankScreen) and app.screen.rank == 5
        text = screen_text(app)
        assert "rank 5 · node1 · job job-7 · pid 105" in text
        assert "max 146 ms ┤" in text and "min 101 ms ┤" in text  # the y axis, labelled
        assert "step 0" in text and "step 30" in text and "(30 s)" in text  # the time axis
        assert "step 124 ms: compute 95.0 ms, exposed comm 0 ms, idle 28.5 ms" in text
        assert "comm in flight 30.0 ms: overlapped 30.0 ms, exposed 0 ms" in text
        assert "last collective: reduce_scatter_single 8.0 MiB" in text
        assert "memory: allocated 2.0 GiB" in text
        app.refresh_view()  # the detail follows the state
        await pilot.press("escape")
        assert not isinstance(app.screen, RankScreen)


async def test_help_and_ctrl_c_quits() -> None:
    from zdiag.tui.monitor_screens import HelpScreen

    app = make_app(problem_job())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "Ctrl-C" in screen_text(app) and "next job" in screen_text(app)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert not app.is_running


async def test_header_shows_the_listen_address() -> None:
    app = make_app(problem_job(), listen="10.0.0.5:5577")
    async with app.run_test(size=(200, 30)) as pilot:
        await pilot.pause()
        assert header_text(app).endswith("on 10.0.0.5:5577  sort: step time (desc)")


async def test_job_switcher_and_finished_ranks() -> None:
    app = make_app(two_jobs())
    async with app.run_test(size=(160, 30)) as pilot:
        await pilot.pause()
        assert "job job-8 (2/2) · 2 ranks" in header_text(app)
        assert first_column(app) == ["1", "0"]
        await pilot.press("j")
        assert "job job-7 (1/2) · 0 ranks (4 finished)" in header_text(app)
        table = app.query_one("#ranks", DataTable)
        assert {str(table.get_cell_at((i, 7))) for i in range(4)} == {"finished"}
        assert "straggler" in str(app.query_one("#findings", Static).render())  # kept
        app.state.ingest([dict(rec(0, 12, job="job-8", pid=200), ts=NOW, recv_ts=NOW)], NOW)
        app.refresh_view()
        assert app.last_view is not None and app.last_view.job == "job-7"  # the pick stays
        await pilot.press("j")
        assert "job job-8 (2/2)" in header_text(app)


def test_snapshot_80x24_problem_job(snap_compare: Any) -> None:
    assert snap_compare(make_app(problem_job()), terminal_size=(80, 24))


def test_snapshot_80x24_rank_detail(snap_compare: Any) -> None:
    assert snap_compare(make_app(problem_job()), terminal_size=(80, 24), press=["enter"])


def test_snapshot_80x24_help(snap_compare: Any) -> None:
    assert snap_compare(make_app(problem_job()), terminal_size=(80, 24), press=["question_mark"])


def test_snapshot_80x24_finished_job_after_switching(snap_compare: Any) -> None:
    assert snap_compare(make_app(two_jobs()), terminal_size=(80, 24), press=["j"])


class FakeCaptures:
    """The capture controller's face the app uses: update, request, to_json."""

    def __init__(self) -> None:
        self.updates = 0
        self.asked: list[tuple[str, str | None, bool]] = []

    def update(self, state: Any, now: float) -> None:
        self.updates += 1

    def request(
        self, state: Any, now: float, reason: str, job: str | None = None, *, manual: bool = False
    ) -> Any:
        self.asked.append((reason, job, manual))
        return type("Capture", (), {"id": 1, "step": 44})()

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {"id": 1, "start_step": 44, "states": {"0": "done", "1": "done"}, "error": None,
             "findings": [{"id": "straggler", "ranks": [1]}]}
        ]  # fmt: skip


async def test_the_capture_key_asks_and_the_findings_panel_shows_the_capture() -> None:
    captures = FakeCaptures()
    app = MonitorApp(
        FakeSource(job(ranks=2)), clock=lambda: NOW, poll_interval_s=0.05,
        refresh_interval_s=3600, listen="127.0.0.1:5577", captures=captures,
    )  # fmt: skip
    async with app.run_test(size=(130, 40)) as pilot:
        await pilot.pause()
        await pilot.press("c")
        await pilot.pause()
        assert captures.asked == [("asked in the monitor", None, True)]
        app.refresh_view()
        panel = str(app.query_one("#findings", Static).render())
        assert "capture 1 at step 44: done - straggler (ranks 1)" in panel
        assert captures.updates >= 1


# -- the step-time history (h) and the captures (l) --------------------------------------------

SAMPLE_TRACES = Path(__file__).parents[2].parent / "sample_traces" / "missing-overlap" / "traces"


class ListedCaptures(FakeCaptures):
    """A capture controller that has taken the captures `entries` (as `to_json` lists them)."""

    def __init__(self, *entries: dict[str, Any]) -> None:
        super().__init__()
        self.entries = list(entries)

    def to_json(self) -> list[dict[str, Any]]:
        return self.entries


def taken(traces: list[str], **over: Any) -> dict[str, Any]:
    """Capture 1 of job-7: asked for step 24, it recorded steps 25-27 on ranks 0-3."""
    entry = {
        "id": 1, "job": "job-7", "start_step": 24, "steps": 3, "reason": "straggler: rank 2",
        "requested_at": NOW, "ranks": [0, 1, 2, 3], "traces": traces,
        "states": {str(r): "done" for r in range(4)}, "error": None,
        "findings": [{"id": "straggler", "severity": "warning", "title": "", "ranks": [2]}],
    }  # fmt: skip
    entry.update(over)
    return entry


def slow_rank_2() -> list[dict[str, Any]]:
    """4 ranks, 40 steps; rank 2 takes 400 ms from step 20."""
    return job(ranks=4, steps=40, r2={"step_time_ms": lambda s: 400.0 if s >= 20 else 100.0})


def capture_app(captures: Any, **kw: Any) -> MonitorApp:
    from zdiag.commands.monitor import load_capture_report

    kw.setdefault("load_report", load_capture_report)  # what `zdiag monitor` injects
    return MonitorApp(
        FakeSource(slow_rank_2()), clock=lambda: NOW, poll_interval_s=0.05,
        refresh_interval_s=3600, captures=captures, **kw,
    )  # fmt: skip


async def test_h_shows_the_step_time_history_with_the_capture_marked() -> None:
    from zdiag.tui.monitor_history import GUTTER, MARK
    from zdiag.tui.monitor_screens import HistoryScreen

    app = capture_app(ListedCaptures(taken([])))
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        await pilot.press("h")
        assert isinstance(app.screen, HistoryScreen)
        history = app.screen.history
        assert history is not None and history.steps == tuple(range(40))  # all fit in 100
        assert history.ranks[2][19:21] == (100.0, 400.0)
        title = str(app.screen.query_one("#history-title", Static).render())
        assert "job job-7 · steps 0-39 · captures: c1 25-27" in title
        lines = str(app.screen.query_one("#history-chart", Static).render()).splitlines()
        assert lines[0].startswith("bars: median of the ranks")  # the legend, then the marks
        marks = lines[1]
        columns = [i - GUTTER for i, ch in enumerate(marks) if ch == MARK]
        assert [history.steps[c] for c in columns] == [25, 26, 27]
        assert any("max 400 ms ┤" in line for line in lines)
        assert any("min 100 ms ┤" in line for line in lines)
        rank_lines = [line.strip() for line in lines if line.strip().startswith("rank ")]
        assert rank_lines[0].startswith("rank 2 250 ms │")  # the slowest rank first
        await pilot.press("w")  # the table's keys are off here
        assert app.sort_key == "step time" and isinstance(app.screen, HistoryScreen)
        await pilot.press("l")  # to the capture list, in place of the history
        assert type(app.screen).__name__ == "CapturesScreen" and len(app.screen_stack) == 2
        await pilot.press("h", "escape")
        assert not isinstance(app.screen, HistoryScreen) and len(app.screen_stack) == 1


async def test_a_capture_on_this_machine_opens_in_the_report_browser(tmp_path: Path) -> None:
    """The real analysis (in-job summaries, else the traces) of two sample traces."""
    from zdiag.tui.monitor_captures import CapturesScreen
    from zdiag.tui.report_app import ReportScreen

    folder = tmp_path / "run" / "captures" / "capture-1"
    folder.mkdir(parents=True)
    for trace in SAMPLE_TRACES.glob("rank-*.json.gz"):
        shutil.copy(trace, folder / trace.name)
    app = capture_app(ListedCaptures(taken([str(folder / "rank-0.json.gz")])))
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        before = app.export_screenshot()
        await pilot.press("l")
        assert isinstance(app.screen, CapturesScreen)
        table = app.screen.query_one("#captures", DataTable)
        assert [str(c) for c in table.get_row_at(0)] == [
            "1", "job-7", "25-27", "straggler: rank 2", "4", "straggler (ranks 2)", "2 here",
        ]  # fmt: skip
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        report = app.screen
        assert isinstance(report, ReportScreen)
        assert report.title == "capture 1 · steps 25-27"
        assert "2 of 4 ranks' traces on this machine" in str(report.sub_title)
        assert report.query_one("#ranks", DataTable).row_count == 2
        assert "missing-overlap" in [f.id for f in report.findings]
        # the monitor's rules for its own #findings panel leave the report's Findings tab alone
        assert report.query_one("#findings").styles.max_height is None
        await pilot.press("j")  # the monitor's keys are off over the report
        assert app.job is None
        await pilot.press("question_mark")  # the browser's keys; q closes them, not the monitor
        assert type(app.screen).__name__ == "CaptureHelpScreen"
        await pilot.press("q")
        assert app.screen is report and app.is_running
        await pilot.press("q")
        assert isinstance(app.screen, CapturesScreen)
        await pilot.press("escape")
        app.refresh_css(animate=False)  # restyle the monitor with the report's CSS loaded
        await pilot.pause()
        assert app.export_screenshot() == before  # the report's CSS left the monitor alone


async def test_a_capture_elsewhere_or_damaged_says_so_and_opens_nothing(tmp_path: Path) -> None:
    from zdiag.tui.monitor_captures import CapturesScreen

    damaged = tmp_path / "run" / "captures" / "capture-2"
    damaged.mkdir(parents=True)
    (damaged / "rank-0.json.gz").write_bytes(b"not gzip")
    said: list[str] = []
    asked: list[list[Path]] = []

    def load(folders: list[Path]) -> Any:
        asked.append(folders)
        raise ValueError("not a trace")

    app = capture_app(
        ListedCaptures(
            taken(["/on/node3/run/captures/capture-1/rank-0.json.gz"]),
            taken([str(damaged / "rank-0.json.gz")], id=2, start_step=60),
        ),
        load_report=load,
    )
    app.notify = lambda message, **kw: said.append(message)  # type: ignore[method-assign]
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        await pilot.press("l", "o")
        await pilot.pause()
        assert isinstance(app.screen, CapturesScreen) and not asked
        assert said and "capture 1's traces are not on this machine" in said[-1]
        assert "/on/node3/run/captures/capture-1" in said[-1]
        await pilot.press("down", "o")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert asked == [[damaged]] and isinstance(app.screen, CapturesScreen)
        assert said[-1] == "capture 2 did not open: ValueError: not a trace"


def test_snapshot_80x24_history(snap_compare: Any) -> None:
    app = capture_app(ListedCaptures(taken([])))
    assert snap_compare(app, terminal_size=(80, 24), press=["h"])


def test_snapshot_80x24_captures(snap_compare: Any) -> None:
    app = capture_app(ListedCaptures(taken(["/on/node3/run/captures/capture-1/rank-0.json.gz"])))
    assert snap_compare(app, terminal_size=(80, 24), press=["l"])
