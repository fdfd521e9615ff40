"""The terminal report browser (`zdiag analyze PATH --tui`, `zdiag render REPORT --tui`).

A viewer: `browse(report)` (the `tui` entry of zdiag/render/renderer.py's FORMATS) shows a
Report and computes nothing; every number comes from the Report through the view layer
(zdiag/render: stats, columns, step_ops, _details, memory_view). Tabs (key in brackets):

- Steps [s]: the ranks; highlighting a rank fills its step table; highlighting a step shows its
  breakdown, verdict, the findings that concern it, and the step's kernels and ops aggregated by
  name (render/step_ops.py: count, total, longest) when the Report holds that step's timeline.
  Enter moves right (ranks -> steps -> ops), Escape moves back.
- Findings [f]: largest expected gain first (as the text summary); the highlighted finding's
  evidence, recommendation, code and gain.
- Units [u], Collectives [c], Stragglers [t]: the FSDP unit ledger, collective totals and the
  straggler ranking, one row per rank and unit / kind / rank.
- Memory [y] (when the Report has memory data): the text report's memory section per rank
  (render/memory_view.py: peak by category, top sites, what-ifs, the timeline, its peak).
- Summary [m]: verdict counts, warnings, run facts, thresholds and inputs.

Every table sorts (`o`: next column, `O`: reverse) and filters (`/`: rows containing the text,
Escape clears). `?` shows the keys, `q` or Ctrl-C quits. The layout works from 80x24 up.

The browser is one screen, `ReportScreen`: `ReportApp` runs it on its own, and the live monitor
pushes it over its own screen to open a triggered capture (tui/monitor_captures.py).
Cells and texts built from trace names are Rich `Text` objects (never parsed as markup).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import DataTable, Footer, Header, Input, Static, TabbedContent, TabPane

from zdiag.render import _details as details
from zdiag.render.columns import StepColumn, shown_columns
from zdiag.render.format import fmt_bytes, fmt_ms, fmt_share, known_bytes, unit_label
from zdiag.render.memory_view import memory_lines
from zdiag.render.printable import printable_report
from zdiag.render.stats import RankView, by_gain, rank_stats
from zdiag.render.step_ops import aggregate_ops

from ..analyzers.report import Finding, Report, StepBreakdown, StepTimeline

MAX_OP_ROWS = 500
"""Aggregated kernel/op rows shown for one step (the largest total time first)."""

MAX_NAME_CELL = 48
"""Characters of a kernel/op name shown in its cell."""

SortValue = float | str


@dataclass(frozen=True)
class Row:
    """One table row: its key (an index into the tab's data), cells, and values to sort by."""

    key: str
    cells: tuple[Text, ...]
    sort: tuple[SortValue, ...]

    def matches(self, query: str) -> bool:
        """Whether any cell contains `query` (case-insensitive)."""
        q = query.lower()
        return any(q in c.plain.lower() for c in self.cells)


def _short(name: str) -> str:
    """A kernel name cut to MAX_NAME_CELL characters (C++ template names run to kilobytes)."""
    return name if len(name) <= MAX_NAME_CELL else name[: MAX_NAME_CELL - 1] + "…"


def _num(value: float | None, text: str | None = None) -> Text:
    """A right-aligned number cell."""
    return Text(text if text is not None else fmt_ms(value, unit=False), justify="right")


def _step_cell(column: StepColumn, step: StepBreakdown) -> Text:
    """One cell of the step table, from the shared step-column spec."""
    if column.kind == "verdict":
        return details.verdict_text(step.verdict)
    return Text(column.cell(step), justify="right")


def _sort_value(value: object) -> SortValue:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return str(value)


HELP = """\
zdiag report browser: keys

  s f u c t    tabs: Steps Findings Units Collectives Stragglers
  y m          tabs: Memory (when the run has memory data), Summary
  ↑ ↓ PgUp/Dn  move in a table; the panels beside it follow
  Enter        Steps tab: ranks → steps → kernels/ops of the step
  Escape       back one level; clears the filter
  o / O        sort the table by its next column / reverse the order
  /            filter the table: rows containing the text (Enter: keep)
  Tab          next panel
  ?            this help
  q, Ctrl-C    quit

Steps are numbered as the profiler numbers them (ProfilerStep#N,
from 0); the root FSDP unit shows as (root).  Escape or ? closes this.
"""


class HelpScreen(ModalScreen[None]):
    """The keys, over the browser."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close"),
        Binding("q", "dismiss", "Close"),
    ]

    def compose(self) -> ComposeResult:
        """The help text in a box."""
        with VerticalScroll(id="help-box"):
            yield Static(Text(HELP), id="help-text")


class ReportScreen(Screen[None]):
    """Browse a Report: steps per rank with drill-down, findings, units, collectives,
    stragglers and a summary; every table sorts and filters.

    The whole browser is this screen: `ReportApp` shows it as its only screen (`q` quits), and
    another app can push it over its own (the live monitor opens a triggered capture's Report
    this way; `q` then goes back). Its CSS (report_app.tcss) is scoped to `ReportScreen`, so it
    leaves the host app's widgets alone."""

    CSS_PATH = "report_app.tcss"
    HORIZONTAL_BREAKPOINTS = [  # noqa: RUF012 (Screen declares it as an instance variable)
        (0, "-narrow"),
        (110, "-wide"),
    ]
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "close", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("slash", "filter", "Filter"),
        Binding("o", "sort(False)", "Sort"),
        Binding("O", "sort(True)", "Reverse", show=False),
        Binding("s", "show_tab('steps')", "Steps", show=False),
        Binding("f", "show_tab('findings')", "Findings", show=False),
        Binding("u", "show_tab('units')", "Units", show=False),
        Binding("c", "show_tab('collectives')", "Collectives", show=False),
        Binding("t", "show_tab('stragglers')", "Stragglers", show=False),
        Binding("y", "show_tab('memory')", "Memory", show=False),
        Binding("m", "show_tab('summary')", "Summary", show=False),
        Binding("escape", "drill_out", "Back"),
    ]

    MAIN_TABLE: ClassVar[dict[str, str]] = {
        "steps": "ranks",
        "findings": "findings-table",
        "units": "units-table",
        "collectives": "collectives-table",
        "stragglers": "stragglers-table",
    }

    def __init__(self, report: Report, *, title: str = "zdiag report") -> None:
        """Browse `report` (ranks by rank, findings by gain) under `title`."""
        super().__init__()
        self.title = title
        self.report = report
        self.ranks: list[RankView] = sorted(report.ranks, key=lambda r: r.rank)
        self.findings: list[Finding] = sorted(report.findings, key=by_gain)
        self.columns = shown_columns(r.device for r in self.ranks)
        self.timelines: dict[tuple[int, int], StepTimeline] = {
            (t.rank, t.step): t for t in report.timelines
        }
        self.memory_text = memory_lines(report, max_ranks=16)[2:]  # without the heading
        self.current_rank: RankView | None = None
        self.rows: dict[str, list[Row]] = {}
        self.headers: dict[str, list[str]] = {}
        self.sort_state: dict[str, tuple[int, bool]] = {}
        self.queries: dict[str, str] = {}
        self.filter_target: str | None = None
        nranks, nfindings = len(self.ranks), len(self.findings)
        self.sub_title = (
            f"{nranks} rank{'' if nranks == 1 else 's'}"
            f" · {nfindings} finding{'' if nfindings == 1 else 's'} · ? for help"
        )

    def compose(self) -> ComposeResult:
        """The tabs, the (hidden) filter box and the key footer."""
        yield Header()
        with TabbedContent(initial="steps"):
            with TabPane("Steps", id="steps"):
                with Horizontal():
                    yield DataTable(id="ranks", cursor_type="row", zebra_stripes=True)
                    with Vertical(id="step-side"):
                        yield DataTable(id="steps-table", cursor_type="row", zebra_stripes=True)
                        with Horizontal(id="step-bottom"):
                            with VerticalScroll(id="step-detail-box"):
                                yield Static(id="step-detail")
                            yield DataTable(id="ops", cursor_type="row", zebra_stripes=True)
            with TabPane("Findings", id="findings"):
                with Horizontal():
                    yield DataTable(id="findings-table", cursor_type="row", zebra_stripes=True)
                    with VerticalScroll(id="finding-detail-box"):
                        yield Static(id="finding-detail")
            with TabPane("Units", id="units"):
                yield DataTable(id="units-table", cursor_type="row", zebra_stripes=True)
            with TabPane("Collectives", id="collectives"):
                yield DataTable(id="collectives-table", cursor_type="row", zebra_stripes=True)
            with TabPane("Stragglers", id="stragglers"):
                yield DataTable(id="stragglers-table", cursor_type="row", zebra_stripes=True)
            if self.memory_text:
                with TabPane("Memory", id="memory"), VerticalScroll(id="memory-box"):
                    yield Static(Text("\n".join(self.memory_text)), id="memory-text")
            with TabPane("Summary", id="summary"):
                with VerticalScroll(id="summary-box"):
                    yield Static(details.summary(self.report), id="summary-text")
        yield Input(
            placeholder="filter rows: type text, Enter keeps it, Escape clears", id="filter"
        )
        yield Footer()

    # --- tables ---------------------------------------------------------------------------

    def _table(self, table_id: str) -> DataTable[Text]:
        return self.query_one(f"#{table_id}", DataTable)

    def _set_rows(self, table_id: str, headers: Sequence[str], rows: list[Row]) -> None:
        self.headers[table_id] = list(headers)
        self.rows[table_id] = rows
        self._fill(table_id)

    def _fill(self, table_id: str) -> None:
        """Show the table's rows: filtered by its query, sorted by its sort state."""
        table = self._table(table_id)
        table.clear(columns=True)
        headers = list(self.headers.get(table_id, []))
        rows = self.rows.get(table_id, [])
        query = self.queries.get(table_id, "")
        if query:
            rows = [r for r in rows if r.matches(query)]
        state = self.sort_state.get(table_id)
        if state is not None:
            col, reverse = state
            rows = sorted(
                rows, key=lambda r: (isinstance(r.sort[col], str), r.sort[col]), reverse=reverse
            )
            headers[col] += " ▼" if reverse else " ▲"
        table.add_columns(*headers)
        for row in rows:
            table.add_row(*row.cells, key=row.key)
        notes = []
        if query:
            notes.append(f"filter “{query}”: {len(rows)} of {len(self.rows.get(table_id, []))}")
        table.border_subtitle = " · ".join(notes) or self.SUBTITLES.get(table_id, "")

    SUBTITLES: ClassVar[dict[str, str]] = {
        "ranks": "Enter → steps",
        "steps-table": "Enter → ops · Esc ← ranks",
        "findings-table": "o sort · / filter",
    }

    def on_mount(self) -> None:
        """Fill the tables; the first rank and finding are shown."""
        rank_rows = []
        for i, r in enumerate(self.ranks):
            stats = rank_stats(r)
            rank_rows.append(
                Row(
                    str(i),
                    (
                        Text(str(r.rank), justify="right"),
                        _num(stats.median_ms),
                        details.verdict_text(stats.dominant_verdict),
                        Text(str(stats.step_count), justify="right"),
                    ),
                    (r.rank, stats.median_ms or 0.0, stats.dominant_verdict, stats.step_count),
                )
            )
        self._set_rows("ranks", ["rank", "median ms", "mostly", "steps"], rank_rows)
        self._set_rows("steps-table", [c.header for c in self.columns], [])
        self._set_rows("ops", ["kernel / op", "total ms", "count", "max ms", "lane"], [])
        self._fill_findings()
        self._fill_units()
        self._fill_collectives()
        self._fill_stragglers()
        if not self.ranks:
            self.query_one("#step-detail", Static).update(
                Text("No steps in this report.", style="italic")
            )
        if not self.findings:
            failed = self.report.failed_detectors
            message = (
                f"No findings from the detectors that ran; {len(failed)} failed, so their "
                f"findings are missing: {', '.join(failed)} (see Summary › Warnings)."
                if failed
                else "No findings: nothing in the traces crossed a threshold."
            )
            self.query_one("#finding-detail", Static).update(Text(message, style="italic"))
        for selector, title in (
            ("#ranks", "Ranks"),
            ("#steps-table", "Steps of the rank"),
            ("#step-detail-box", "Step"),
            ("#ops", "Kernels and ops of the step"),
            ("#findings-table", "Findings (largest gain first)"),
            ("#finding-detail-box", "Finding"),
            ("#units-table", "FSDP units (root module: (root))"),
            ("#collectives-table", "Collectives per rank and kind (all steps)"),
            ("#stragglers-table", "Stragglers: last arrivals at matched collectives"),
        ):
            self.query_one(selector).border_title = title
        self.query_one("#filter", Input).display = False
        self._table("ranks").focus()

    def _fill_findings(self) -> None:
        rows = []
        for i, f in enumerate(self.findings):
            gain = f.expected_gain_ms
            rows.append(
                Row(
                    str(i),
                    (details.severity_text(f.severity), _num(gain), Text(f.id), Text(f.title)),
                    (f.severity, gain if gain is not None else -1.0, f.id, f.title),
                )
            )
        self._set_rows("findings-table", ["severity", "gain ms", "id", "finding"], rows)

    def _fill_units(self) -> None:
        units = sorted(self.report.fsdp_units, key=lambda u: (-u.exposed_wait_ms, u.rank))
        rows = []
        for i, u in enumerate(units):
            gathered = known_bytes(u.all_gather_bytes, u.all_gather_count)
            reduced = known_bytes(u.reduce_bytes, u.reduce_count)
            rows.append(
                Row(
                    str(i),
                    (
                        Text(str(u.rank), justify="right"),
                        Text(unit_label(u.name)),
                        _num(u.exposed_wait_ms),
                        _num(u.all_gather_ms),
                        _num(u.reduce_ms),
                        _num(u.gather_lead_ms),
                        _num(None, fmt_bytes(gathered)),
                        _num(None, fmt_bytes(reduced)),
                        Text(u.framework),
                    ),
                    (
                        u.rank,
                        unit_label(u.name),
                        u.exposed_wait_ms,
                        u.all_gather_ms,
                        u.reduce_ms,
                        u.gather_lead_ms if u.gather_lead_ms is not None else float("-inf"),
                        float(gathered if gathered is not None else -1),
                        float(reduced if reduced is not None else -1),
                        u.framework,
                    ),
                )
            )
        headers = [
            "rank",
            "unit",
            "exposed ms",
            "gather ms",
            "reduce ms",
            "lead ms",
            "gathered",
            "reduced",
            "kind",
        ]
        self._set_rows("units-table", headers, rows)

    def _fill_collectives(self) -> None:
        rows = []
        for i, c in enumerate(self.report.collectives):
            size = known_bytes(c.total_bytes, c.count)
            rows.append(
                Row(
                    str(i),
                    (
                        Text(str(c.rank), justify="right"),
                        Text(c.kind),
                        Text(str(c.count), justify="right"),
                        _num(None, fmt_bytes(size)),
                        _num(c.total_ms),
                        _num(c.exposed_ms),
                        Text(",".join(c.dtypes) or "-"),
                    ),
                    (
                        c.rank,
                        c.kind,
                        c.count,
                        float(size if size is not None else -1),
                        c.total_ms,
                        c.exposed_ms,
                        ",".join(c.dtypes),
                    ),
                )
            )
        headers = ["rank", "kind", "count", "bytes", "total ms", "exposed ms", "dtypes"]
        self._set_rows("collectives-table", headers, rows)

    def _fill_stragglers(self) -> None:
        ordered = sorted(self.report.stragglers, key=lambda s: -s.wait_caused_ms)
        rows = [
            Row(
                str(i),
                (
                    Text(str(s.rank), justify="right"),
                    Text(str(s.last_arrivals), justify="right"),
                    Text(str(s.matched_collectives), justify="right"),
                    _num(s.wait_caused_ms),
                    _num(s.mean_skew_ms),
                ),
                (s.rank, s.last_arrivals, s.matched_collectives, s.wait_caused_ms, s.mean_skew_ms),
            )
            for i, s in enumerate(ordered)
        ]
        headers = ["rank", "last", "matched", "wait caused ms", "mean late ms"]
        self._set_rows("stragglers-table", headers, rows)

    # --- drill-down -----------------------------------------------------------------------

    @on(DataTable.RowHighlighted, "#ranks")
    def _rank_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.row_key.value is None:
            return
        rank = self.ranks[int(event.row_key.value)]
        self.current_rank = rank
        rows = [
            Row(
                str(i),
                tuple(_step_cell(c, s) for c in self.columns),
                tuple(_sort_value(c.value(s)) for c in self.columns),
            )
            for i, s in enumerate(rank.steps)
        ]
        self._set_rows("steps-table", [c.header for c in self.columns], rows)
        if not rank.steps:
            self.query_one("#step-detail", Static).update(
                Text(f"Rank {rank.rank} has no steps.", style="italic")
            )
            self._set_rows("ops", self.headers["ops"], [])

    @on(DataTable.RowHighlighted, "#steps-table")
    def _step_highlighted(self, event: DataTable.RowHighlighted) -> None:
        rank = self.current_rank
        if rank is None or event.row_key.value is None:
            return
        step = rank.steps[int(event.row_key.value)]
        detail = details.step_detail(self.report, rank, step)
        timeline = self.timelines.get((rank.rank, step.step))
        rows: list[Row] = []
        if timeline is None:
            steps_with = sorted({t.step for t in self.report.timelines if t.rank == rank.rank})
            hint = (
                f"Kernels and ops: recorded for step {', '.join(map(str, steps_with))} "
                "of this rank (its typical step)."
                if steps_with
                else "Kernels and ops: no timeline recorded for this rank."
            )
            detail.append(hint + "\n", style="dim")
        else:
            ops = aggregate_ops(timeline)
            for i, op in enumerate(ops[:MAX_OP_ROWS]):
                rows.append(
                    Row(
                        str(i),
                        (
                            Text(_short(op.name)),
                            _num(op.total_ms),
                            Text(str(op.count), justify="right"),
                            _num(op.max_ms),
                            Text(op.lane),
                        ),
                        (op.name, op.total_ms, op.count, op.max_ms, op.lane),
                    )
                )
            cut = " (the analysis kept the longest spans)" if timeline.truncated else ""
            shown = f"{min(len(ops), MAX_OP_ROWS)} of {len(ops)}" if len(ops) > MAX_OP_ROWS else ""
            detail.append(
                f"Kernels and ops: {shown or len(ops)} names from {len(timeline.spans)} "
                f"spans{cut} →\n",
                style="dim",
            )
            if ops and step.duration_ms > 0:
                top = ops[0]
                detail.append(
                    f"Largest: {top.name[:60]} {fmt_share(top.total_ms, step.duration_ms)} "
                    "of the step\n",
                    style="dim",
                )
        self._set_rows("ops", self.headers["ops"], rows)
        self.query_one("#step-detail", Static).update(detail)

    @on(DataTable.RowHighlighted, "#findings-table")
    def _finding_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.row_key.value is not None:
            finding = self.findings[int(event.row_key.value)]
            self.query_one("#finding-detail", Static).update(details.finding_detail(finding))

    @on(DataTable.RowSelected, "#ranks")
    def _rank_selected(self, event: DataTable.RowSelected) -> None:
        self._table("steps-table").focus()

    @on(DataTable.RowSelected, "#steps-table")
    def _step_selected(self, event: DataTable.RowSelected) -> None:
        self._table("ops").focus()

    # --- actions --------------------------------------------------------------------------

    def action_help(self) -> None:
        """Show the keys."""
        self.app.push_screen(HelpScreen())

    def action_close(self) -> None:
        """`q`: quit the browser, or go back to the screen under it when an app pushed it."""
        if len(self.app.screen_stack) > 1:
            self.dismiss()
        else:
            self.app.exit()

    def action_show_tab(self, tab: str) -> None:
        """Switch to a tab and focus its main table."""
        if tab == "memory" and not self.memory_text:
            return
        self.query_one(TabbedContent).active = tab
        # focus a widget of the new tab, else focus falls back into the old tab and reopens it
        target = self.MAIN_TABLE.get(tab)
        boxes = {"memory": "#memory-box", "summary": "#summary-box"}
        self.query_one(f"#{target}" if target else boxes[tab]).focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Hide the Memory key when the report has no memory data."""
        if action == "show_tab" and parameters == ("memory",) and not self.memory_text:
            return False
        return True

    def _focused_table(self) -> str | None:
        focused = self.focused
        if isinstance(focused, DataTable) and focused.id in self.rows:
            return focused.id
        return self.MAIN_TABLE.get(self.query_one(TabbedContent).active)

    def action_sort(self, reverse: bool) -> None:
        """Sort the focused table by its next column (`reverse`: flip the current order)."""
        table_id = self._focused_table()
        if table_id is None or not self.headers.get(table_id):
            return
        col, rev = self.sort_state.get(table_id, (-1, False))
        if reverse:
            self.sort_state[table_id] = (max(col, 0), not rev)
        else:
            self.sort_state[table_id] = ((col + 1) % len(self.headers[table_id]), False)
        self._fill(table_id)

    def action_filter(self) -> None:
        """Open the filter box for the focused table."""
        self.filter_target = self._focused_table()
        if self.filter_target is None:
            return
        box = self.query_one("#filter", Input)
        box.value = self.queries.get(self.filter_target, "")
        box.display = True
        box.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        if self.filter_target is not None:
            self.queries[self.filter_target] = event.value
            self._fill(self.filter_target)

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        self._close_filter()

    def _close_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = False
        if self.filter_target is not None:
            self._table(self.filter_target).focus()

    def action_drill_out(self) -> None:
        """Close the filter box (clearing it), or move focus back (ops -> steps -> ranks), or
        clear the focused table's filter."""
        box = self.query_one("#filter", Input)
        if box.display:
            if self.filter_target is not None:
                self.queries[self.filter_target] = ""
                self._fill(self.filter_target)
            self._close_filter()
            return
        order = ["ranks", "steps-table", "ops"]
        focused = self.focused.id if self.focused else None
        if focused in order[1:]:
            self._table(order[order.index(focused) - 1]).focus()
        elif focused in self.rows and self.queries.get(focused):
            self.queries[focused] = ""
            self._fill(focused)


class ReportApp(App[None]):
    """The report browser as an app of its own: one `ReportScreen`."""

    CSS_PATH = "report_app.tcss"
    TITLE = "zdiag report"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit", show=False),  # the browser's own `q`, also over its help
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
    ]

    def __init__(self, report: Report) -> None:
        """Browse `report`."""
        super().__init__()
        self.report = report
        self.browser = ReportScreen(report)

    def get_default_screen(self) -> Screen[None]:
        """The browser is the app's only screen."""
        return self.browser

    @property
    def ranks(self) -> list[RankView]:
        """The Report's ranks, by rank (the browser's)."""
        return self.browser.ranks

    @property
    def findings(self) -> list[Finding]:
        """The Report's findings, largest gain first (the browser's)."""
        return self.browser.findings

    @property
    def current_rank(self) -> RankView | None:
        """The rank highlighted in the Steps tab."""
        return self.browser.current_rank


def browse(report: Report) -> None:
    """Run the report browser in the terminal until the user quits (names made `printable`:
    Rich keeps most terminal controls in a Text)."""
    ReportApp(printable_report(report)).run()
