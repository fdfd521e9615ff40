"""The text report's building blocks, shared by the report (text.py) and the large-run report
(text_large_run.py): a width-aware line buffer with colour (`TextOut`), the fitted table, a
finding with its evidence, code and gain, and the thresholds; and the same as plain lines.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable

from zdiag.analyzers.report import Finding
from zdiag.render.format import (
    evidence_item,
    fmt_bytes,
    fmt_ints,
    fmt_list,
    fmt_ms,
    fmt_ranks,
    unit_label,
)
from zdiag.render.terminal import DEFAULT_WIDTH, SEVERITY_STYLE, VERDICT_STYLE, paint

CellPainter = Callable[[int, str, str], str]
"""(column index, plain cell, padded cell) -> the padded cell, maybe coloured."""

MAX_EVIDENCE_ITEMS = 10
MIN_TEXT_CELL = 12
"""A table's text column (unit names) is cut to no fewer characters than this to fit."""


class TextOut:
    """Lines being written, at a width, with or without colour."""

    def __init__(self, width: int, color: bool) -> None:
        self.width = width
        self.color = color
        self.lines: list[str] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def wrap(self, text: str, indent: str = "", hang: str = "    ") -> None:
        """`text` word-wrapped at the width; continuation lines indented by indent + hang."""
        self.lines.extend(
            textwrap.wrap(
                text,
                width=self.width,
                initial_indent=indent,
                subsequent_indent=indent + hang,
                break_long_words=True,
                break_on_hyphens=False,
            )
            or [indent.rstrip()]
        )

    def heading(self, title: str) -> None:
        self.lines += ["", paint(title, "bold", self.color)]

    def verdict(self, verdict: str) -> str:
        return paint(verdict, VERDICT_STYLE.get(verdict, ""), self.color)

    def badge(self, severity: str) -> str:
        return paint(f"[{severity.upper()}]", SEVERITY_STYLE.get(severity, "bold"), self.color)


def fit_table(
    out: TextOut,
    header: list[str],
    rows: list[list[str]],
    right: set[int],
    *,
    indent: str = "  ",
    shrink: int | None = None,
    painter: CellPainter | None = None,
) -> list[str]:
    """Append an aligned table fitting the width; returns the headers of columns it dropped.

    Column `shrink` (a text column such as unit names) is cut first, with "…"; then trailing
    columns are dropped until the table fits.
    """
    header, rows = list(header), [list(r) for r in rows]
    room = out.width - len(indent)

    def widths() -> list[int]:
        return [
            max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
            for i, h in enumerate(header)
        ]

    def total(ws: list[int]) -> int:
        return sum(ws) + 2 * (len(ws) - 1)

    ws = widths()
    if shrink is not None and total(ws) > room:
        cut = max(MIN_TEXT_CELL, ws[shrink] - (total(ws) - room), len(header[shrink]))
        for r in rows:
            if len(r[shrink]) > cut:
                r[shrink] = r[shrink][: cut - 1] + "…"
        ws = widths()
    dropped: list[str] = []
    while len(header) > 2 and total(ws) > room:
        dropped.insert(0, header.pop())
        for r in rows:
            r.pop()
        ws = ws[:-1]

    def line(cells: list[str], paint_cells: bool) -> str:
        shown = []
        for i, c in enumerate(cells):
            padded = c.rjust(ws[i]) if i in right else c.ljust(ws[i])
            shown.append(painter(i, c, padded) if painter and paint_cells else padded)
        return (indent + "  ".join(shown)).rstrip()

    out.add(line(header, False), line(["-" * w for w in ws], False))
    out.add(*(line(r, True) for r in rows))
    if dropped:
        out.add(f"{indent}({', '.join(dropped)} not shown at {out.width} columns; --json has them)")
    return dropped


def add_finding(out: TextOut, f: Finding, *, verbose: bool = False) -> None:
    """One finding: its head, evidence (the first MAX_EVIDENCE_ITEMS, all when `verbose`), what
    to change, the code and the gain."""
    where = []
    if f.ranks:
        where.append(fmt_ranks(f.ranks))
    if f.steps:
        where.append(("step " if len(set(f.steps)) == 1 else "steps ") + fmt_ints(f.steps, 16))
    if f.units:
        where.append(
            ("unit " if len(f.units) == 1 else "units ")
            + fmt_list([unit_label(u) for u in f.units], 8)
        )
    badge = f"[{f.severity.upper()}]"
    head = f"{badge} {f.id}: {f.title}" + (f" ({'; '.join(where)})" if where else "")
    lines = textwrap.wrap(
        head, out.width, initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False
    )
    lines[0] = lines[0].replace(badge, out.badge(f.severity), 1)
    out.add("", *lines)
    shown = [(k, v) for k, v in f.evidence.items() if v not in (None, {}, [])]
    if shown:
        out.add("    evidence:")
        limit = len(shown) if verbose else MAX_EVIDENCE_ITEMS
        items = [evidence_item(k, v) for k, v in shown[:limit]]
        pad = min(max(len(label) for label, _ in items), 28)
        for label, value in items:
            out.wrap(f"{label:<{pad}}  {value}", "      ", " " * (pad + 2))
        if len(shown) > limit:
            out.add(f"      (+{len(shown) - limit} more: --verbose, or --json)")
    if f.recommendation:
        out.wrap(f"do: {f.recommendation}", "    ", "    ")
    if f.code:
        out.add(*(f"      {line}".rstrip() for line in f.code.splitlines()))
    if f.expected_gain_ms is not None:
        how = f" ({f.gain_method})" if f.gain_method else ""
        if f.expected_gain_ms < 0:
            said = f"expected cost: {fmt_ms(-f.expected_gain_ms)} per step slower{how}"
        else:
            said = f"expected gain: {fmt_ms(f.expected_gain_ms)} per step{how}"
        out.wrap(said, "    ", "    ")
    if f.expected_gain_bytes is not None:
        # how, when the step-time line above did not say it already
        how = f" ({f.gain_method})" if f.gain_method and f.expected_gain_ms is None else ""
        out.wrap(
            f"expected saving: {fmt_bytes(f.expected_gain_bytes)} peak memory{how}", "    ", "    "
        )


STRAGGLER_PREFIX = "straggler_"
"""Report.thresholds keys that belong to the cross-rank straggler ranking (run/stragglers.py); the
others are the per-step verdict's (verdict.py)."""


def add_thresholds(out: TextOut, thresholds: dict[str, float]) -> None:
    """The verdict thresholds and the straggler thresholds, each labelled."""
    verdict = {k: v for k, v in thresholds.items() if not k.startswith(STRAGGLER_PREFIX)}
    straggler = {
        k.removeprefix(STRAGGLER_PREFIX): v
        for k, v in thresholds.items()
        if k.startswith(STRAGGLER_PREFIX)
    }
    if verdict or straggler:
        out.add("")
    for label, values in (("Verdict", verdict), ("Straggler", straggler)):
        if values:
            out.wrap(f"{label} thresholds: " + ", ".join(f"{k}={v:g}" for k, v in values.items()))


# Line builders for the large-run text (text_large_run.py): plain, unwrapped lines.


def table_lines(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """An aligned table as lines (no width limit, no indent)."""
    out = TextOut(1 << 30, False)
    fit_table(out, header, rows, right, indent="")
    return out.lines


def finding_lines(f: Finding) -> list[str]:
    """One finding as lines (head, evidence, what to change, code, gain), indented from 0."""
    out = TextOut(DEFAULT_WIDTH, False)
    add_finding(out, f)
    return [line[2:] for line in out.lines[1:]]


def threshold_lines(thresholds: dict[str, float]) -> list[str]:
    """The verdict and straggler thresholds, a blank line first."""
    out = TextOut(DEFAULT_WIDTH, False)
    add_thresholds(out, thresholds)
    return out.lines
