"""The monitor's triggered captures as a list, and each one opened in the report browser.

`CapturesScreen` (key `l` in the monitor) lists the captures the monitor asked for: their id,
job, the steps they recorded, why, how the ranks answered, and the verdict of the capture's
analysis in the job (its findings and the ranks they name). `Enter` or `o` on one opens its Report in
the report browser (`report_app.ReportScreen`, the screen `zdiag analyze --tui` shows), pushed
over the monitor: `q` or `Esc` comes back.

A capture opens only when its folder, `RUN_DIR/captures/capture-<K>/`, is on the monitor's
machine (one node, or a shared file system): `where_to_open` says which folders are here, or
why none is. The Report is made as `zdiag analyze RUN_DIR/captures/capture-<K>/` makes it
(the loader the command injects, `zdiag.commands.monitor.load_capture_report`: the in-job summaries first), in a worker thread.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from zdiag.analyzers.report import Report

from .monitor_text import shown
from .report_app import HelpScreen, ReportScreen

ReportLoader = Callable[[list[Path]], Report]
"""Capture folders -> their Report (the command injects `load_capture_report`; a fake in tests)."""
CaptureList = Callable[[], list[dict[str, Any]]]
"""The captures now, as `CaptureController.to_json` lists them (oldest first)."""

COLUMNS = ("capture", "job", "steps", "reason", "ranks", "verdict", "traces")
TRACE_SUFFIXES = (".json.gz", ".json")


def recorded_steps(capture: dict[str, Any]) -> str:
    """ "45-47": the steps a capture recorded (its start step warms the profiler up)."""
    try:
        start, steps = int(capture["start_step"]), max(1, int(capture["steps"]))
    except (KeyError, TypeError, ValueError):
        return "?"
    return f"{start + 1}-{start + steps}" if steps > 1 else str(start + 1)


def verdict(capture: dict[str, Any]) -> str:
    """What the capture's analysis found (its findings and their ranks), or where it stands."""
    if capture.get("error"):
        return f"error: {capture['error']}"
    findings = capture.get("findings")
    if findings is None:
        states = set((capture.get("states") or {}).values())
        if states and states <= {"done", "skipped", "failed"}:
            return "analyzing..."
        return ", ".join(sorted(states)) if states else "asked"
    if not findings:
        return "no findings"
    return "; ".join(
        f"{f.get('id')} (ranks {', '.join(map(str, (f.get('ranks') or [])[:8]))})" for f in findings
    )


@dataclass(frozen=True)
class Where:
    """Where a capture's traces are: the folders here, or why there is none."""

    folders: tuple[Path, ...]
    traces_here: int  # rank traces in those folders
    ranks: int  # ranks asked
    reason: str  # when `folders` is empty: why, in one sentence


def _is_capture_folder(folder: Path, capture_id: int) -> bool:
    """A real folder named as the collectors name capture `capture_id`'s
    (collectors/rundir.py: captures/capture-<K>/), not a link."""
    if folder.name != f"capture-{capture_id}" or folder.parent.name != "captures":
        return False
    try:
        return stat.S_ISDIR(os.lstat(folder).st_mode)
    except OSError:
        return False


def _traces_in(folder: Path) -> int:
    try:
        return sum(1 for e in os.scandir(folder) if e.name.endswith(TRACE_SUFFIXES))
    except OSError:
        return 0


def where_to_open(capture: dict[str, Any]) -> Where:
    """The capture's folders on this machine (those of the trace paths its ranks sent)."""
    cid, ranks = capture.get("id"), len(capture.get("ranks") or [])
    traces = [str(t) for t in capture.get("traces") or []]
    if not traces:
        return Where((), 0, ranks, f"capture {cid} has no trace yet ({verdict(capture)})")
    parents = sorted({Path(t).parent for t in traces})
    here = [f for f in parents if isinstance(cid, int) and _is_capture_folder(f, cid)]
    counts = {f: _traces_in(f) for f in here}
    here = [f for f in here if counts[f]]
    if not here:
        return Where(
            (),
            0,
            ranks,
            f"capture {cid}'s traces are not on this machine ({shown(str(parents[0]))} is "
            "on the ranks' machines); copy that folder here and run "
            "`zdiag analyze FOLDER --tui`",
        )
    return Where(tuple(here), sum(counts.values()), ranks, "")


def capture_cells(capture: dict[str, Any]) -> tuple[str, ...]:
    """One capture's row of the list (names from the wire made printable)."""
    where = where_to_open(capture)
    traces = (
        f"{where.traces_here} here"
        if where.folders
        else ("none yet" if not capture.get("traces") else "not here")
    )
    return (
        str(capture.get("id")),
        shown(str(capture.get("job") or "")) or "-",
        recorded_steps(capture),
        shown(str(capture.get("reason") or "")),
        str(len(capture.get("ranks") or [])),
        shown(verdict(capture)),
        traces,
    )


class CaptureHelpScreen(HelpScreen):
    """The report browser's keys, over the monitor: `q` closes them (the monitor's own `q`
    would quit the monitor)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("q", "dismiss", "Close", show=False)]


class CaptureReportScreen(ReportScreen):
    """The report browser over the monitor: `q` or `Esc` (at the top level) goes back."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("q", "close", "Back to the monitor")]

    def action_help(self) -> None:
        """The browser's keys (`q` there closes them)."""
        self.app.push_screen(CaptureHelpScreen())

    def action_drill_out(self) -> None:
        """Escape: back one level in the browser; at its top level, back to the monitor."""
        focused = self.focused.id if self.focused else None
        filtering = self.query_one("#filter").display
        if (
            not filtering
            and focused not in ("steps-table", "ops")
            and not self.queries.get(focused or "")
        ):
            self.dismiss()
            return
        super().action_drill_out()


class CapturesScreen(Screen[None]):
    """The captures taken, redrawn from the app's capture controller on its refresh timer."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("o", "open", "open in the report browser"),
        Binding("escape,backspace,l", "app.pop_screen", "back"),
        Binding("question_mark", "app.help", "help"),
    ]

    def __init__(self, captures: CaptureList, open_capture: Callable[[dict[str, Any]], None]):
        """List what `captures` returns; `open_capture` opens one (the app's
        `MonitorApp.open_capture`)."""
        super().__init__()
        self.captures = captures
        self.open_capture = open_capture
        self._shown: list[tuple[str, ...]] = []
        self._entries: list[dict[str, Any]] = []

    def compose(self) -> ComposeResult:
        """Title, the list, a hint, the footer."""
        yield Static(id="captures-title")
        yield DataTable(id="captures", cursor_type="row", zebra_stripes=True)
        yield Static(id="captures-hint")
        yield Footer()

    def on_mount(self) -> None:
        """Columns, then the rows."""
        table: DataTable[str] = self.query_one("#captures", DataTable)
        for name in COLUMNS:
            table.add_column(name, key=name)
        self.redraw()
        table.focus()

    def redraw(self) -> None:
        """Take the captures now (the table is rebuilt only when a cell changed)."""
        self._entries = self.captures()
        rows = [capture_cells(c) for c in self._entries]
        n = len(rows)
        self.query_one("#captures-title", Static).update(
            Text(f"triggered captures: {n}" + ("" if n else " (c asks for one)"), style="bold")
        )
        hint = (
            "Enter or o opens the selected capture's traces in the report browser "
            "(q or Esc there comes back). Only captures whose folder is on this machine open."
        )
        self.query_one("#captures-hint", Static).update(Text(hint, style="dim"))
        if rows == self._shown:
            return
        table: DataTable[str] = self.query_one("#captures", DataTable)
        cursor = table.cursor_row
        table.clear()
        for cells in rows:
            table.add_row(*cells, key=cells[0])
        if rows:
            table.move_cursor(row=min(cursor, n - 1), animate=False)
        self._shown = rows

    def selected(self) -> dict[str, Any] | None:
        """The capture under the cursor."""
        table: DataTable[str] = self.query_one("#captures", DataTable)
        row = table.cursor_row
        return self._entries[row] if 0 <= row < len(self._entries) else None

    def action_open(self) -> None:
        """Open the selected capture."""
        capture = self.selected()
        if capture is not None:
            self.open_capture(capture)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter (or a click) on a row opens it."""
        event.stop()
        self.action_open()


def report_title(capture: dict[str, Any], where: Where) -> tuple[str, str]:
    """The report browser's title and subtitle for a capture."""
    title = f"capture {capture.get('id')} · steps {recorded_steps(capture)}"
    part = (
        f"{where.traces_here} of {where.ranks} ranks' traces on this machine"
        if where.ranks and where.traces_here < where.ranks
        else f"{where.traces_here} rank traces"
    )
    return title, f"{shown(str(capture.get('reason') or ''))} · {part}"


def capture_entries(captures: Any) -> Sequence[dict[str, Any]]:
    """The controller's captures as dicts (none without a controller)."""
    return captures.to_json() if captures is not None else []
