"""`zdiag monitor`'s Textual app: one screen that follows every rank of a running job.

The app takes its data source (a `MonitorSource`: the zmq `LiveReceiver`, or a fake in tests)
and its clock as constructor arguments; all figures come from `MonitorState.view` (pure), the
app only lays them out: a header (job, ranks reporting, step rate, lag, drops, rejections, the
listen address), the rank table (slowest first by default, sortable; stragglers, stale, gone,
hung, finished and failed ranks styled), a sparkline of the slowest rank's step time per step,
the live findings, and the keys in the footer. Enter opens a rank (`monitor_screens.RankScreen`),
`h` the step-time history with the captures marked (`monitor_screens.HistoryScreen`), `l` the
captures taken (`monitor_captures.CapturesScreen`), where Enter opens one in the report browser;
`j` switches between jobs, `?` lists the keys.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label, Sparkline, Static
from textual.worker import get_current_worker

from zdiag.analyzers.report import Report
from zdiag.live.state import (
    Clock,
    JobHistory,
    MonitorSource,
    MonitorState,
    MonitorView,
    RankDetail,
    RankRow,
)
from zdiag.render.printable import printable_report

from .monitor_captures import (
    CaptureReportScreen,
    CapturesScreen,
    ReportLoader,
    Where,
    capture_entries,
    report_title,
    where_to_open,
)
from .monitor_history import CaptureMark
from .monitor_screens import HelpScreen, HistoryScreen, RankScreen
from .monitor_text import (
    COLUMNS,
    STATUS_ORDER,
    fmt_ms,
    header_line,
    row_cells,
    spark_scale,
)

STATUS_STYLE = {
    "ok": "",
    "straggler": "bold dark_orange",
    "stale": "yellow",
    "gone": "bold red",
    "hung": "bold white on red",
    "failed": "bold red",
    "finished": "green",
}
SEVERITY_STYLE = {"critical": "bold red", "warning": "dark_orange", "info": "cyan"}


def _sort_value(row: RankRow, key: str) -> float:
    """The value of column `key` to sort by (missing values sort as the smallest)."""
    values: dict[str, float | None] = {
        "rank": float(row.rank),
        "step": float(row.step),
        "step time": row.step_time_ms,
        "exposed comm": row.exposed_comm_ms,
        "mem alloc": row.mem_allocated_bytes,
        "mem peak": row.mem_peak_bytes,
        "status": float(STATUS_ORDER.get(row.status, 9)),
    }
    value = values.get(key, float(row.rank))
    return float("-inf") if value is None else value


SORT_KEYS = ("rank", "step time", "exposed comm", "mem alloc", "mem peak", "step", "status")
TABLE_ACTIONS = frozenset(
    {"cycle_sort", "reverse_sort", "worst_first", "toggle_findings", "next_job", "toggle_pause"}
)
"""The app's keys that act on the rank table: off while the history, the capture list or a
capture's report is on top (they would change what is hidden)."""


class MonitorApp(App[None]):
    """The live monitor; `source` and `clock` are injected (tests pass fakes)."""

    CSS_PATH = "monitor.tcss"
    TITLE = "zdiag monitor"
    BINDINGS: ClassVar[list[BindingType]] = [
        # in the footer's order: what fits 80 columns first
        Binding("s", "cycle_sort", "sort"),
        Binding("h", "history", "history"),
        Binding("l", "captures", "captures"),
        Binding("c", "capture", "capture"),
        Binding("w", "worst_first", "worst first"),
        Binding("f", "toggle_findings", "findings"),
        Binding("j", "next_job", "next job"),
        Binding("p", "toggle_pause", "pause"),
        Binding("r", "reverse_sort", "reverse"),
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
    ]

    def __init__(
        self,
        source: MonitorSource,
        *,
        clock: Clock = time.time,
        poll_interval_s: float = 0.25,
        refresh_interval_s: float = 1.0,
        listen: str = "",
        captures: Any = None,
        load_report: ReportLoader | None = None,
    ) -> None:
        """Follow `source` (received on `listen`, shown in the header); figures are computed at
        `clock()` times. `captures` (a `zdiag.live.captures.CaptureController`, or None) asks the
        ranks for triggered captures; its answers are shown under the findings and in the
        capture list, where `load_report` makes a capture's Report from its folders (None: captures
        cannot open here)."""
        super().__init__()
        self.source = source
        self.clock = clock
        self.state = MonitorState()
        self.poll_interval_s = poll_interval_s
        self.refresh_interval_s = refresh_interval_s
        self.listen = listen
        self.captures = captures
        self.load_report = load_report
        self.sort_key = "step time"  # slowest first
        self.sort_reverse = True
        self.job: str | None = None  # the job shown; None follows the latest one
        self.paused = False
        self.last_view: MonitorView | None = None
        self.source_error: str | None = None  # the first error the source raised
        self._order: list[str] = []  # row keys as shown
        self._shown: dict[str, tuple[tuple[str, ...], str]] = {}  # key -> (cells, status)

    def compose(self) -> ComposeResult:
        """Header, table, sparkline, findings, footer (kept as attributes: the refresh timer
        updates them while another screen, a rank's detail or the help, is on top)."""
        self.header = Static(id="header")
        self.table: DataTable[Text] = DataTable(id="ranks", cursor_type="row", zebra_stripes=True)
        self.trend_label = Label("slowest rank, last steps", id="trend-label")
        self.spark = Sparkline([], summary_function=max, id="spark")
        self.findings_panel = Static(id="findings")
        yield self.header
        yield self.table
        with Horizontal(id="trend"):
            yield self.trend_label
            yield self.spark
        yield self.findings_panel
        yield Footer()

    def on_mount(self) -> None:
        """Set up the table and the timers; show whatever is there at once."""
        table = self.table
        for name in COLUMNS:
            table.add_column(name, key=name)
        self.poll_source()
        self.refresh_view()
        self.set_interval(self.poll_interval_s, self.poll_source)
        self.set_interval(self.refresh_interval_s, self.refresh_view)

    def poll_source(self) -> None:
        """Fold the source's new records into the state (a late attach just starts here)."""
        try:
            records = self.source.poll()
            self.state.ingest(records, self.clock())
            self.state.sync_rejections(self.source)
        except Exception as exc:  # a broken source must not take the display down
            if self.source_error is None:
                self.source_error = f"{type(exc).__name__}: {exc}"
                self.notify(f"receiving failed: {self.source_error}", severity="error")

    def refresh_view(self) -> None:
        """Redraw every widget from a fresh view (skipped while paused)."""
        if self.paused:
            return
        if self.captures is not None:
            try:
                self.captures.update(self.state, self.clock())
            except Exception as exc:  # the captures must not take the display down
                self.notify(f"captures stopped: {type(exc).__name__}: {exc}", severity="error")
                self.captures = None
        view = self.last_view = self.state.view(self.clock(), self.job)
        self.header.update(self._header(view))
        self._fill_table(view)
        self.spark.data = list(view.slowest_step_ms)
        last = view.slowest_step_ms[-1] if view.slowest_step_ms else None
        self.trend_label.update(f"slowest rank per step: {fmt_ms(last)} ")
        self.findings_panel.update(self._findings(view))
        if isinstance(self.screen, RankScreen | HistoryScreen | CapturesScreen):
            self.screen.redraw()

    def _header(self, view: MonitorView) -> Text:
        text = Text(header_line(view, self.listen))
        if self.paused:
            text.append("  [paused]", style="bold")
        sort = f"  sort: {self.sort_key}{' (desc)' if self.sort_reverse else ''}"
        text.append(sort, style="dim")
        return text

    def _fill_table(self, view: MonitorView) -> None:
        """Update the cells that changed; rebuild the table only when the row order changed."""
        table = self.table
        # view.rows are in rank order and the sort is stable (reversed too): ties stay by rank
        rows = sorted(
            view.rows, key=lambda r: _sort_value(r, self.sort_key), reverse=self.sort_reverse
        )
        scale = spark_scale(view)
        shown = {str(row.rank): (row_cells(row, scale), row.status) for row in rows}
        order = list(shown)
        if order == self._order:
            for key, (cells, status) in shown.items():
                old_cells, old_status = self._shown[key]
                style = STATUS_STYLE.get(status, "")
                for column, new, old in zip(COLUMNS, cells, old_cells, strict=True):
                    if new != old or status != old_status:
                        table.update_cell(
                            key, column, Text(new, style=style), update_width=len(new) > len(old)
                        )
        else:
            cursor = table.cursor_row
            table.clear()
            for key, (cells, status) in shown.items():
                style = STATUS_STYLE.get(status, "")
                table.add_row(*(Text(c, style=style) for c in cells), key=key)
            if rows:
                table.move_cursor(row=min(cursor, len(rows) - 1), animate=False)
        self._order, self._shown = order, shown

    def _findings(self, view: MonitorView) -> Text:
        text = Text()
        if not view.rows:
            text.append(
                "waiting for step records: ranks publish when ZDIAG_MONITOR=HOST:PORT is set "
                "(zdiag run --monitor HOST:PORT)",
                style="dim",
            )
            return text
        self._capture_lines(text)
        if not view.findings:
            text.append("no findings", style="dim")
            return text
        for i, f in enumerate(view.findings):
            if i:
                text.append("\n")
            text.append(f"[{f.severity}] {f.id}", style=SEVERITY_STYLE.get(f.severity, ""))
            ranks = ", ".join(str(r) for r in f.ranks[:8]) + (" ..." if len(f.ranks) > 8 else "")
            text.append(f": {f.title} (ranks {ranks})\n")
            text.append(f"  {f.recommendation}", style="dim")
        return text

    def _capture_lines(self, text: Text) -> None:
        """One line per triggered capture: its step, the ranks' answers, its findings."""
        for c in self.captures.to_json() if self.captures is not None else []:
            states = sorted(set(c["states"].values())) or ["asked"]
            found = "; ".join(
                f"{f['id']} (ranks {', '.join(map(str, f['ranks'][:8]))})"
                for f in c["findings"] or []
            )
            text.append(
                f"capture {c['id']} at step {c['start_step']}: {', '.join(states)}"
                f"{' - ' + found if found else ''}{' - ' + c['error'] if c['error'] else ''}\n",
                style="bold",
            )

    # -- actions -------------------------------------------------------------------------------

    def action_capture(self) -> None:
        """Ask every rank of the job shown for a capture now."""
        if self.captures is None:
            self.notify("captures are off (--no-capture, or no control port)", severity="warning")
            return
        capture = self.captures.request(
            self.state, self.clock(), "asked in the monitor", self.job, manual=True
        )
        if capture is None:
            self.notify("no capture: no live rank, the captures are used up, or cooling down")
        else:
            self.notify(f"capture {capture.id} asked for step {capture.step}")

    def _set_sort(self, key: str, reverse: bool) -> None:
        self.sort_key, self.sort_reverse = key, reverse
        self.refresh_view()

    def action_cycle_sort(self) -> None:
        """Sort by the next column."""
        nxt = SORT_KEYS[(SORT_KEYS.index(self.sort_key) + 1) % len(SORT_KEYS)]
        self._set_sort(nxt, self.sort_reverse)

    def action_reverse_sort(self) -> None:
        """Flip the sort order."""
        self._set_sort(self.sort_key, not self.sort_reverse)

    def action_worst_first(self) -> None:
        """Gone, stale and straggler ranks on top."""
        self._set_sort("status", False)

    def action_next_job(self) -> None:
        """Show the next job the monitor has seen (and stay on it)."""
        jobs = self.state.view(self.clock(), self.job).jobs
        if not jobs:
            return
        shown = self.last_view.job if self.last_view is not None else jobs[-1]
        self.job = jobs[(jobs.index(shown) + 1) % len(jobs)] if shown in jobs else jobs[-1]
        self._order = []  # other ranks: rebuild the table
        self.refresh_view()

    def action_help(self) -> None:
        """The keys and statuses."""
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def _detail(self, rank: int, job: str) -> RankDetail | None:
        """A rank's detail now (what the rank screen shows)."""
        return self.state.detail(rank, self.clock(), job)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a row opens that rank."""
        if self.last_view is not None and event.row_key.value is not None:
            self.push_screen(RankScreen(int(event.row_key.value), self.last_view.job, self._detail))

    def action_toggle_findings(self) -> None:
        """Show or hide the findings panel."""
        self.findings_panel.display = not self.findings_panel.display

    def action_toggle_pause(self) -> None:
        """Freeze the display (records are still received and counted)."""
        self.paused = not self.paused
        if not self.paused:
            self.refresh_view()
        elif self.last_view is not None:
            self.header.update(self._header(self.last_view))

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        """Clicking a column header sorts by it (again: reverses)."""
        key = str(event.column_key.value)
        if key in SORT_KEYS:
            self._set_sort(key, not self.sort_reverse if key == self.sort_key else False)

    # -- history and captures ------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The rank table's keys only where the table is (shown in the footer only there too);
        `h` and `l` not over a capture's report."""
        top = self.screen
        if action in TABLE_ACTIONS:
            return not isinstance(top, HistoryScreen | CapturesScreen | CaptureReportScreen)
        if action in ("history", "captures"):
            return not isinstance(top, CaptureReportScreen)
        return True

    def _history(self, steps: int) -> tuple[JobHistory, list[CaptureMark]]:
        """The shown job's history over `steps` steps and the marks of its captures."""
        history = self.state.history(self.job, steps)
        marks = [
            mark
            for c in capture_entries(self.captures)
            if c.get("job") == history.job and (mark := CaptureMark.of(c)) is not None
        ]
        return history, marks

    def _on_top(self, screen: Screen[None]) -> None:
        """Show `screen` over the rank table (in place of the history or the capture list)."""
        if isinstance(self.screen, HistoryScreen | CapturesScreen):
            self.pop_screen()
        self.push_screen(screen)

    def action_history(self) -> None:
        """The step-time history of the shown job (`h` again goes back)."""
        if not isinstance(self.screen, HistoryScreen):
            self._on_top(HistoryScreen(self._history))

    def action_captures(self) -> None:
        """The captures taken (`l` again goes back)."""
        if not isinstance(self.screen, CapturesScreen):
            self._on_top(
                CapturesScreen(lambda: list(capture_entries(self.captures)), self.open_capture)
            )

    def open_capture(self, capture: dict[str, Any]) -> None:
        """Open a capture's Report in the report browser, when its folder is on this machine
        (else say why not); the analysis runs in a worker thread (opening another capture
        meanwhile cancels it)."""
        where = where_to_open(capture)
        if not where.folders:
            self.notify(where.reason, severity="warning", timeout=10)
            return
        if self.load_report is None:
            self.notify("this monitor cannot open captures (no report loader)", severity="warning")
            return
        self.notify(f"analyzing capture {capture.get('id')} ...")
        self.run_worker(
            lambda: self._load(capture, where),
            thread=True,
            exclusive=True,
            group="capture-report",
        )

    def _load(self, capture: dict[str, Any], where: Where) -> None:
        """In the worker: the Report, then its screen (or the error) on the app's thread."""
        try:
            assert self.load_report is not None  # open_capture checked it
            report = printable_report(self.load_report(list(where.folders)))
        except Exception as exc:  # a damaged capture is reported, never fatal to the monitor
            message = f"capture {capture.get('id')} did not open: {type(exc).__name__}: {exc}"
            self.call_from_thread(self.notify, message[:300], severity="error", timeout=10)
            return
        if not get_current_worker().is_cancelled:  # another capture was opened since
            self.call_from_thread(self._show_report, report, *report_title(capture, where))

    def _show_report(self, report: Report, title: str, sub_title: str) -> None:
        screen = CaptureReportScreen(report, title=title)
        screen.sub_title = f"{sub_title} · {screen.sub_title}"
        self.push_screen(screen)

    def on_unmount(self) -> None:
        """Release the source."""
        self.source.close()
