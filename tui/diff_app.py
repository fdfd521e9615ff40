"""The terminal diff browser (`zdiag diff A B --tui`): a RunDiff in tabs, one table per section.

A viewer like tui/report_app.py: every number comes from the RunDiff (A the baseline, B the
candidate, every delta B - A), formatted by render/format.py as in the other views. Tabs (key in
brackets): Summary [s] (headline, warnings, the step breakdown and where its change went),
Ranks [r], Units [u], Collectives [c], Memory [y], Findings [f], Config [g], Operators [o].
`q` or Ctrl-C quits. Cells are Rich `Text` objects (never parsed as markup), and
`run_diff_app` makes every string `printable` first (names come from traces).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Footer, Header, Static, TabbedContent, TabPane

from zdiag.render._diff_html_tables import (
    OPERATOR_CLASSES,
    collective_size,
    gbps,
    pct,
    signed_ms,
)
from zdiag.render.format import NONE_SHOWN, fmt_bytes, fmt_ms, fmt_number, unit_label
from zdiag.render.printable import printable_report

from ..analyzers.compare.model import Delta, RunDiff, UnitDelta
from ..analyzers.report import Report

Cells = tuple[Text, ...]
Table = tuple[list[str], Sequence[Cells]]
"""A table's headers and rows."""

TABS: tuple[tuple[str, str, str], ...] = (
    # id, title, key
    ("summary", "Summary", "s"),
    ("ranks", "Ranks", "r"),
    ("units", "Units", "u"),
    ("collectives", "Collectives", "c"),
    ("memory", "Memory", "y"),
    ("findings", "Findings", "f"),
    ("config", "Config", "g"),
    ("operators", "Operators", "o"),
)
"""The tabs in order, with the key that shows each."""

MAX_NAME_CELL = 72
"""Characters of an operator or kernel name shown in its cell."""

CHANGE_STYLE = {
    "up": "bold red",
    "down": "bold green",
    "undetermined": "yellow",
    "no change": "dim",
    "appeared": "bold red",
    "gone": "bold green",
}
"""How a change word is colored (more time is red)."""


def _num(text: str) -> Text:
    """A right-aligned number cell."""
    return Text(text, justify="right")


def _ms(value: float) -> Text:
    return _num(fmt_ms(value, unit=False))


def _change(word: str) -> Text:
    return Text(word, style=CHANGE_STYLE.get(word, ""))


def _delta_cells(d: Delta) -> Cells:
    return (
        Text(d.metric),
        _ms(d.a),
        _ms(d.b),
        _num(signed_ms(d.delta)),
        _num(pct(d.pct)),
        _num(f"±{fmt_number(d.spread)}"),
        _change(d.change),
    )


def step_rows(diff: RunDiff) -> Table:
    """The run's breakdown per step: A, B, delta, pct, spread, change."""
    headers = ["metric (ms/step)", "A", "B", "Δ", "Δ %", "spread", "change"]
    return headers, [_delta_cells(d) for d in diff.step]


def share_rows(diff: RunDiff) -> Table:
    """Where the mean step-time change went."""
    rows = [
        (Text(s.component), _num(signed_ms(s.delta_ms)), _num(f"{100 * s.share + 0.0:.0f}%"))
        for s in diff.shares
    ]
    return ["part", "Δ ms/step", "share"], rows


def rank_rows(diff: RunDiff) -> Table:
    """Each rank in both runs: step time A, B, its change, then each metric's delta."""
    names = [m.metric for m in diff.ranks[0].metrics[1:]] if diff.ranks else []
    headers = ["rank", "step A", "step B", "Δ step", "change", *(f"Δ {n}" for n in names)]
    rows = []
    for r in diff.ranks:
        step, rest = r.metrics[0], r.metrics[1:]
        rows.append(
            (
                _num(str(r.rank)),
                _ms(step.a),
                _ms(step.b),
                _num(signed_ms(step.delta)),
                _change(step.change),
                *(
                    Text(signed_ms(m.delta), justify="right", style=CHANGE_STYLE.get(m.change, ""))
                    for m in rest
                ),
            )
        )
    return headers, rows


def _side_ms(u: UnitDelta, side: str, value: float) -> Text:
    """A unit's time on one side ("—" when the unit is not in that run)."""
    return _ms(value) if u.only_in in ("", side) else _num(NONE_SHOWN)


def _side_bytes(u: UnitDelta, side: str, value: float) -> Text:
    """A unit's bytes on one side ("—" when the unit is not in that run)."""
    return _num(fmt_bytes(value) if u.only_in in ("", side) else NONE_SHOWN)


def unit_rows(diff: RunDiff) -> Table:
    """FSDP units, the largest exposed-wait change first."""
    headers = ["unit", "only in", "wait A", "wait B", "Δ wait", "gather A", "gather B"]
    headers += ["reduce A", "reduce B", "gathered A", "gathered B"]
    rows = [
        (
            Text(unit_label(u.unit)),
            Text(u.only_in or "both"),
            _side_ms(u, "A", u.exposed_wait_ms_a),
            _side_ms(u, "B", u.exposed_wait_ms_b),
            _num(signed_ms(u.exposed_wait_ms_b - u.exposed_wait_ms_a)),
            _side_ms(u, "A", u.gather_ms_a),
            _side_ms(u, "B", u.gather_ms_b),
            _side_ms(u, "A", u.reduce_ms_a),
            _side_ms(u, "B", u.reduce_ms_b),
            _side_bytes(u, "A", u.gathered_bytes_a),
            _side_bytes(u, "B", u.gathered_bytes_b),
        )
        for u in diff.units
    ]
    return headers, rows


def collective_rows(diff: RunDiff) -> Table:
    """Collectives by kind, the largest time change first, with their bandwidth."""
    headers = ["kind", "calls A", "calls B", "bytes A", "bytes B", "ms A", "ms B", "Δ ms"]
    headers += ["exposed A", "exposed B", "GB/s A", "GB/s B"]
    rows = [
        (
            Text(c.kind),
            _num(fmt_number(c.count_a)),
            _num(fmt_number(c.count_b)),
            _num(collective_size(c.bytes_a, c.count_a)),
            _num(collective_size(c.bytes_b, c.count_b)),
            _ms(c.ms_a),
            _ms(c.ms_b),
            _num(signed_ms(c.ms_b - c.ms_a)),
            _ms(c.exposed_ms_a),
            _ms(c.exposed_ms_b),
            _num(gbps(c.gbps_a)),
            _num(gbps(c.gbps_b)),
        )
        for c in diff.collectives
    ]
    return headers, rows


def memory_rows(diff: RunDiff) -> Table:
    """Peak memory by category, the largest over ranks."""
    rows = []
    for m in diff.memory:
        both = m.a_bytes is not None and m.b_bytes is not None
        d = (m.b_bytes or 0) - (m.a_bytes or 0)
        rows.append(
            (
                Text(m.category),
                _num(fmt_bytes(m.a_bytes) if m.a_bytes is not None else "not recorded"),
                _num(fmt_bytes(m.b_bytes) if m.b_bytes is not None else "not recorded"),
                _num(("+" if d > 0 else "") + fmt_bytes(d) if both else NONE_SHOWN),
            )
        )
    return ["category", "peak A", "peak B", "Δ"], rows


def finding_rows(diff: RunDiff) -> Table:
    """Findings raised in one run only."""
    rows = [(_change(f.change), Text(f.severity), Text(f.id), Text(f.title)) for f in diff.findings]
    return ["change", "severity", "id", "finding"], rows


def _value(value: object) -> Text:
    return Text("not recorded", style="dim italic") if value is None else Text(str(value))


def config_rows(diff: RunDiff) -> Table:
    """The configuration keys whose values differ."""
    return ["key", "A", "B"], [(Text(c.key), _value(c.a), _value(c.b)) for c in diff.config]


def operator_rows(diff: RunDiff) -> Table:
    """The changed operators and kernels, by change class, the largest time change first (the
    numbers before the name, which can be long)."""
    order = {c: i for i, c in enumerate(OPERATOR_CLASSES)}
    ops = sorted(diff.operators, key=lambda o: order.get(o.change, len(order)))
    rows = [
        (
            Text(o.change),
            Text(o.device),
            _num(signed_ms(o.ms_b - o.ms_a)),
            _ms(o.ms_a),
            _ms(o.ms_b),
            _num(fmt_number(o.count_a)),
            _num(fmt_number(o.count_b)),
            Text(o.name if len(o.name) <= MAX_NAME_CELL else o.name[: MAX_NAME_CELL - 1] + "…"),
        )
        for o in ops
    ]
    return ["change", "device", "Δ ms", "ms A", "ms B", "calls A", "calls B", "name"], rows


TABLES = {
    "step-table": step_rows,
    "shares-table": share_rows,
    "ranks-table": rank_rows,
    "units-table": unit_rows,
    "collectives-table": collective_rows,
    "memory-table": memory_rows,
    "findings-table": finding_rows,
    "config-table": config_rows,
    "operators-table": operator_rows,
}
"""Each DataTable's id and the function giving its headers and rows."""


def summary_text(diff: RunDiff) -> Text:
    """The headline, the two runs and the warnings."""
    text = Text()
    text.append(diff.headline + "\n\n", style="bold")
    if not diff.comparable:
        text.append("The runs were compared although they are not comparable.\n", style="red")
    for side, label, steps, ranks in (
        ("A", diff.baseline, diff.steps_a, diff.ranks_a),
        ("B", diff.candidate, diff.steps_b, diff.ranks_b),
    ):
        text.append(f"{side} ", style="bold")
        text.append(f"{label} ({steps} step(s) per rank, {len(ranks)} rank(s))\n")
    for w in diff.warnings:
        text.append(f"! {w}\n", style="yellow")
    return text


class DiffApp(App[None]):
    """Browse a RunDiff of runs A (baseline) and B (candidate), one tab per section."""

    TITLE = "zdiag diff"
    CSS = """
    #summary-box DataTable { height: auto; max-height: 16; margin-top: 1; }
    #summary-text { padding: 0 1; }
    TabPane > DataTable { height: 1fr; }
    DataTable { border: round $primary; border-title-align: left; }
    DataTable:focus { border: round $accent; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
        *(Binding(key, f"show_tab('{tab}')", title) for tab, title, key in TABS),
    ]

    def __init__(self, diff: RunDiff, a: Report, b: Report) -> None:
        """Browse `diff`, the diff of runs `a` and `b`."""
        super().__init__()
        self.diff, self.a, self.b = diff, a, b
        self.sub_title = f"A: {diff.baseline} · B: {diff.candidate}"

    def compose(self) -> ComposeResult:
        """The tabs and the key footer."""
        yield Header()
        with TabbedContent(initial="summary"):
            with TabPane("Summary", id="summary"), VerticalScroll(id="summary-box"):
                yield Static(summary_text(self.diff), id="summary-text")
                yield DataTable(id="step-table", zebra_stripes=True)
                yield DataTable(id="shares-table", zebra_stripes=True)
            for tab, title, _ in TABS[1:]:
                with TabPane(title, id=tab):
                    yield DataTable(id=f"{tab}-table", cursor_type="row", zebra_stripes=True)
        yield Footer()

    EMPTY: ClassVar[dict[str, str]] = {
        "ranks-table": "no rank is in both runs",
        "units-table": "neither run has FSDP units",
        "collectives-table": "neither run has collectives",
        "memory-table": "neither run recorded memory",
        "findings-table": "both runs raised the same findings",
        "config-table": "the recorded configurations are the same",
        "operators-table": "no operator or kernel changed",
    }

    TITLES: ClassVar[dict[str, str]] = {
        "step-table": "Step breakdown (medians over steps)",
        "shares-table": "Where the mean step-time change went",
        "ranks-table": "Per rank (ms per step)",
        "units-table": "FSDP units (ms per rank and step), largest wait change first",
        "collectives-table": "Collectives (per rank and step)",
        "memory-table": "Peak memory (largest over ranks)",
        "findings-table": "Findings appeared (B only) and gone (A only)",
        "config-table": "Configuration differences",
        "operators-table": "Operators and kernels that changed",
    }

    def on_mount(self) -> None:
        """Fill every table."""
        for table_id, rows_of in TABLES.items():
            headers, rows = rows_of(self.diff)
            table = self.query_one(f"#{table_id}", DataTable)
            table.add_columns(*headers)
            for row in rows:
                table.add_row(*row)
            table.border_title = self.TITLES[table_id]
            if not rows:
                table.border_subtitle = self.EMPTY.get(table_id, "none")
        notes = [f"{self.diff.operators_unchanged} unchanged, not listed"]
        if not self.diff.operators_complete:
            notes.append("a run's table was cut: absent names may have run below the cut")
        operators = self.query_one("#operators-table", DataTable)
        operators.border_subtitle = " · ".join([operators.border_subtitle or "", *notes]).strip(
            " ·"
        )

    def action_show_tab(self, tab: str) -> None:
        """Switch to a tab and focus its table."""
        self.query_one(TabbedContent).active = tab
        target = "#summary-box" if tab == "summary" else f"#{tab}-table"
        self.query_one(target).focus()


def run_diff_app(diff: RunDiff, a: Report, b: Report) -> None:
    """Run the diff browser in the terminal until the user quits (names made `printable`)."""
    DiffApp(printable_report(diff), printable_report(a), printable_report(b)).run()
