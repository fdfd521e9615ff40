"""The live monitor's extra screens: one rank's detail (Enter on a row), the step-time history
(`h`) and the keys (`?`). The capture list is in `monitor_captures`."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Static

from zdiag.live.state import (
    GONE_AFTER_S,
    GONE_STEPS,
    STALE_AFTER_S,
    STALE_STEPS,
    JobHistory,
    RankDetail,
)

from .monitor_detail import detail_lines, detail_title, step_chart
from .monitor_history import CaptureMark, history_lines, steps_that_fit
from .monitor_text import job_label

DetailSource = Callable[[int, str], RankDetail | None]
"""(rank, job) -> the rank's detail now, None when it is no longer tracked."""
HistorySource = Callable[[int], tuple[JobHistory, list[CaptureMark]]]
"""steps -> the shown job's history over that many steps, and its captures' marks."""

CHART_ROWS = 8
LEGEND = "bars: median of the ranks · •: slowest rank · ▼ cK: steps capture K recorded"

HELP_TEXT = f"""\
zdiag monitor: keys

  Enter  open the selected rank: step history, compute/comm/idle
         split, memory, last collective (Esc back)
  h      step time over steps: job median, slowest rank, each rank;
         ▼ marks the steps a capture recorded (Esc back)
  l      the captures taken: Enter opens one in the report browser
  c      ask every rank for a capture now
  s      sort by the next column      r  reverse the order
  w      worst first: hung, failed, gone, stale, stragglers on top
  j      next job (one job is shown at a time; the header says which)
  f      show/hide findings           p  pause the display
  ?      this help                    q, Ctrl-C  quit

Click a column header to sort by it. Statuses: ok, straggler,
stale (no record for {STALE_AFTER_S:g} s or {STALE_STEPS:g} steps), gone ({GONE_AFTER_S:g} s or {GONE_STEPS:g} steps),
hung (the rank's watchdog says where), finished / failed (it ended).
Esc, q or ? closes this help."""


class HelpScreen(ModalScreen[None]):
    """The keys and statuses."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,question_mark", "dismiss", "close"),
    ]

    def compose(self) -> ComposeResult:
        """The help text in a box."""
        yield Static(HELP_TEXT, id="help")


class RankScreen(Screen[None]):
    """One rank of one job, redrawn from the app's state on the app's refresh timer."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,backspace", "app.pop_screen", "back"),
        Binding("question_mark", "app.help", "help"),
    ]

    def __init__(self, rank: int, job: str, detail_of: DetailSource) -> None:
        """Show `rank` of `job`, whose figures `detail_of` gives at each redraw."""
        super().__init__()
        self.rank = rank
        self.job = job
        self.detail_of = detail_of

    def compose(self) -> ComposeResult:
        """Title, chart, figures, footer."""
        with VerticalScroll():
            yield Static(id="rank-title")
            yield Static(id="rank-chart")
            yield Static(id="rank-figures")
        yield Footer()

    def on_mount(self) -> None:
        """Draw at once."""
        self.redraw()

    def redraw(self) -> None:
        """Take the rank's figures from the source now."""
        detail = self.detail_of(self.rank, self.job)
        title = self.query_one("#rank-title", Static)
        if detail is None:
            title.update(f"rank {self.rank}: no longer tracked (Esc back)")
            return
        title.update(Text(detail_title(detail)))
        width = max(20, self.size.width - 2)
        chart = [f"step time, last {len(detail.history)} steps", ""]
        chart += step_chart(detail.history, width, CHART_ROWS)
        self.query_one("#rank-chart", Static).update("\n".join(chart))
        self.query_one("#rank-figures", Static).update(Text("\n".join(detail_lines(detail))))

    def on_resize(self) -> None:
        """The chart's width follows the terminal."""
        self.redraw()


class HistoryScreen(Screen[None]):
    """The shown job's step time over steps (`monitor_history`), redrawn on the app's refresh
    timer; as many steps as the width holds."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,backspace,h", "app.pop_screen", "back"),
        Binding("question_mark", "app.help", "help"),
    ]

    def __init__(self, history_of: HistorySource) -> None:
        """Show what `history_of` gives at each redraw."""
        super().__init__()
        self.history_of = history_of
        self.history: JobHistory | None = None  # the last one drawn

    def compose(self) -> ComposeResult:
        """Title, the chart and rank lines (scrolling), footer."""
        yield Static(id="history-title")
        with VerticalScroll(id="history-box"):
            yield Static(id="history-chart")
        yield Footer()

    def on_mount(self) -> None:
        """Draw at once."""
        self.redraw()

    def redraw(self) -> None:
        """Take the history now, for the steps that fit the width."""
        history, marks = self.history_of(steps_that_fit(self.size.width))
        self.history = history
        shown = f"steps {history.steps[0]}-{history.steps[-1]}" if history.steps else "no steps"
        captures = ", ".join(f"c{m.id} {m.first}-{m.last}" for m in marks) or "none"
        title = f"step time · job {job_label(history.job)} · {shown} · captures: {captures}"
        self.query_one("#history-title", Static).update(Text(title))
        lines = [Text(LEGEND, style="dim"), *history_lines(history, marks, CHART_ROWS)]
        self.query_one("#history-chart", Static).update(Text("\n").join(lines))

    def on_resize(self) -> None:
        """The number of steps follows the terminal's width."""
        self.redraw()
