"""The terminal report browser (`zdiag analyze PATH --tui`).

`ReportApp(report)` takes the Report as its data source. Tabs:

- Steps: the ranks table; highlighting a rank fills its step table; highlighting a step shows its
  breakdown, verdict, the findings that concern it and its timeline spans (when the Report holds a
  timeline for that rank and step). Enter moves right (rank -> steps -> spans), Escape moves back.
- Findings: worst first; the highlighted finding's evidence, recommendation, code and gain.
- Summary: verdict counts, warnings, run facts, thresholds and inputs.
- Memory (only when the Report has memory data, key `y`): per rank the peak by category, top
  allocation sites, what-if predictions and the timeline with the peak marked
  (render/memory_view.py, the text report's section).

Cells and texts built from trace names are Rich `Text` objects (never parsed as markup).
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import DataTable, Footer, Header, Static, TabbedContent, TabPane

from zdiag.analyzers.report import Finding, Report, StepBreakdown, StepTimeline
from zdiag.errors import ConfigError
from zdiag.render import _details as details
from zdiag.render.columns import STEP_COLUMNS, StepColumn
from zdiag.render.format import fmt_ms
from zdiag.render.memory_view import memory_lines
from zdiag.render.renderer import Destination, Renderer
from zdiag.render.stats import RankView, rank_stats, worst_first

MAX_SPAN_ROWS = 2000


def _ms(value: float | None) -> Text:
    """A right-aligned ms cell ("—" when there is no value)."""
    return Text(fmt_ms(value, unit=False), justify="right")


def _step_cell(column: StepColumn, step: StepBreakdown) -> Text:
    """One cell of the step table, from the shared step-column spec."""
    if column.kind == "verdict":
        return details.verdict_text(step.verdict)
    return Text(column.cell(step), justify="right")


class ReportApp(App[None]):
    """Browse a Report: steps per rank with drill-down, findings, summary."""

    CSS_PATH = "report_app.tcss"
    TITLE = "zdiag report"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("s", "show_tab('steps')", "Steps"),
        Binding("f", "show_tab('findings')", "Findings"),
        Binding("m", "show_tab('summary')", "Summary"),
        Binding("y", "show_tab('memory')", "Memory"),
        Binding("escape", "drill_out", "Back"),
    ]

    def __init__(self, report: Report) -> None:
        """Browse `report` (ranks by rank, findings worst first)."""
        super().__init__()
        self.report = report
        self.ranks: list[RankView] = sorted(report.ranks, key=lambda r: r.rank)
        self.findings: list[Finding] = sorted(report.findings, key=worst_first)
        self.timelines: dict[tuple[int, int], StepTimeline] = {
            (t.rank, t.step): t for t in report.timelines
        }
        self.current_rank: RankView | None = None
        self.memory_text = memory_lines(report, max_ranks=16)[2:]  # without the heading
        nranks, nfindings = len(self.ranks), len(self.findings)
        self.sub_title = (
            f"{nranks} rank{'' if nranks == 1 else 's'}"
            f" · {nfindings} finding{'' if nfindings == 1 else 's'}"
        )

    def compose(self) -> ComposeResult:
        """Tabs for steps, findings and summary, with the key footer."""
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
                            yield DataTable(id="spans", cursor_type="row")
            with TabPane("Findings", id="findings"):
                with Horizontal():
                    yield DataTable(id="findings-table", cursor_type="row", zebra_stripes=True)
                    with VerticalScroll(id="finding-detail-box"):
                        yield Static(id="finding-detail")
            with TabPane("Summary", id="summary"):
                with VerticalScroll(id="summary-box"):
                    yield Static(details.summary(self.report), id="summary-text")
            if self.memory_text:
                with TabPane("Memory", id="memory"), VerticalScroll(id="memory-box"):
                    yield Static(Text("\n".join(self.memory_text)), id="memory-text")
        yield Footer()

    def on_mount(self) -> None:
        """Fill the tables; the first rank and finding are shown."""
        ranks = self.query_one("#ranks", DataTable)
        ranks.add_columns("rank", "steps", "median ms", "mostly")
        for r in self.ranks:
            stats = rank_stats(r)
            ranks.add_row(
                Text(str(r.rank), justify="right"),
                Text(str(stats.step_count), justify="right"),
                _ms(stats.median_ms),
                details.verdict_text(stats.dominant_verdict),
                # no row keys: rank and step numbers may repeat in odd inputs
            )
        steps = self.query_one("#steps-table", DataTable)
        steps.add_columns(*(c.header for c in STEP_COLUMNS))
        spans = self.query_one("#spans", DataTable)
        spans.add_columns("start ms", "ms", "lane", "name")
        findings = self.query_one("#findings-table", DataTable)
        findings.add_columns("severity", "gain ms", "finding")
        for i, f in enumerate(self.findings):
            findings.add_row(
                details.severity_text(f.severity),
                _ms(f.expected_gain_ms) if f.expected_gain_ms is not None else Text("—"),
                Text(f.title),
                key=str(i),
            )
        if not self.ranks:
            self.query_one("#step-detail", Static).update(
                Text("No steps in this report.", style="italic")
            )
        if not self.findings:
            self.query_one("#finding-detail", Static).update(
                Text("No findings: nothing in the traces crossed a threshold.", style="italic")
            )
        for selector, title in (
            ("#ranks", "Ranks"),
            ("#steps-table", "Steps of the rank"),
            ("#step-detail-box", "Step"),
            ("#spans", "Timeline spans"),
            ("#findings-table", "Findings (worst first)"),
            ("#finding-detail-box", "Finding"),
        ):
            self.query_one(selector).border_title = title
        ranks.border_subtitle = "Enter → steps"
        self.query_one("#steps-table").border_subtitle = "Enter → spans · Esc ← ranks"
        ranks.focus()

    @on(DataTable.RowHighlighted, "#ranks")
    def _rank_highlighted(self, event: DataTable.RowHighlighted) -> None:
        rank = self.ranks[event.cursor_row]
        self.current_rank = rank
        table = self.query_one("#steps-table", DataTable)
        table.clear()
        for s in rank.steps:
            table.add_row(*(_step_cell(c, s) for c in STEP_COLUMNS))
        if not rank.steps:
            self.query_one("#step-detail", Static).update(
                Text(f"Rank {rank.rank} has no steps.", style="italic")
            )
            self.query_one("#spans", DataTable).clear()

    @on(DataTable.RowHighlighted, "#steps-table")
    def _step_highlighted(self, event: DataTable.RowHighlighted) -> None:
        rank = self.current_rank
        if rank is None or not 0 <= event.cursor_row < len(rank.steps):
            return
        step = rank.steps[event.cursor_row]
        detail = details.step_detail(self.report, rank, step)
        spans = self.query_one("#spans", DataTable)
        spans.clear()
        timeline = self.timelines.get((rank.rank, step.step))
        if timeline is None:
            steps_with = sorted({t.step for t in self.report.timelines if t.rank == rank.rank})
            hint = (
                f"Timeline spans: recorded for step {', '.join(map(str, steps_with))} of this rank."
                if steps_with
                else "Timeline spans: none recorded for this rank."
            )
            detail.append(hint + "\n", style="dim")
        else:
            for span in timeline.spans[:MAX_SPAN_ROWS]:
                spans.add_row(
                    _ms(span.start_ms), _ms(span.dur_ms), Text(span.lane), Text(span.name)
                )
            shown = min(len(timeline.spans), MAX_SPAN_ROWS)
            cut = timeline.truncated or len(timeline.spans) > MAX_SPAN_ROWS
            detail.append(
                f"Timeline spans: {shown} shown{' (truncated)' if cut else ''} →\n", style="dim"
            )
        self.query_one("#step-detail", Static).update(detail)

    @on(DataTable.RowHighlighted, "#findings-table")
    def _finding_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if 0 <= event.cursor_row < len(self.findings):
            finding = self.findings[event.cursor_row]
            self.query_one("#finding-detail", Static).update(details.finding_detail(finding))

    @on(DataTable.RowSelected, "#ranks")
    def _rank_selected(self, event: DataTable.RowSelected) -> None:
        self.query_one("#steps-table", DataTable).focus()

    @on(DataTable.RowSelected, "#steps-table")
    def _step_selected(self, event: DataTable.RowSelected) -> None:
        self.query_one("#spans", DataTable).focus()

    def action_show_tab(self, tab: str) -> None:
        """Switch to a tab and focus its main table."""
        self.query_one(TabbedContent).active = tab
        # focus a widget of the new tab, else focus falls back into the old tab and reopens it
        if tab == "memory" and not self.memory_text:
            return
        target = {
            "steps": "#ranks",
            "findings": "#findings-table",
            "summary": "#summary-box",
            "memory": "#memory-box",
        }[tab]
        self.query_one(target).focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Hide the Memory key when the report has no memory data."""
        if action == "show_tab" and parameters == ("memory",) and not self.memory_text:
            return False
        return True

    def action_drill_out(self) -> None:
        """Move focus one level back (spans -> steps -> ranks)."""
        order = ["ranks", "steps-table", "spans"]
        focused = self.focused.id if self.focused else None
        if focused in order[1:]:
            self.query_one(f"#{order[order.index(focused) - 1]}", DataTable).focus()


def browse(report: Report) -> None:
    """Run the report browser in the terminal until the user quits."""
    ReportApp(report).run()


class TuiRenderer(Renderer):
    """The report browser as a renderer: it draws on the terminal (standard output only)."""

    name = "tui"

    def render(self, report: Report, destination: Destination) -> None:
        """Browse `report` until the user quits; a file destination is refused."""
        if not destination.is_stdout:
            raise ConfigError(
                f"the terminal UI draws on the terminal; it cannot be written to {destination.path}."
            )
        browse(report)
