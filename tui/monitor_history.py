"""The history view's text: a job's step time over steps with the triggered captures marked.

No Textual here (the screen is `monitor_screens.HistoryScreen`). From a `JobHistory` (one column
per step, the last steps that fit the width) it draws:

- a marker row: `▼` over each step a capture recorded, then `cK` (capture K);
- a chart of the job per step: bars for the median over the ranks, `•` for the slowest rank
  where it stands above the bar, on a y axis labelled with the min and max;
- the step axis (first and last step numbers);
- one line per rank on the same scale, slowest first (median over the steps shown), the
  captured steps underlined.

Everything lines up in columns after a common gutter, so a capture's `▼` stands over the steps
it recorded in the chart and in every rank's line.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Text

from zdiag.live.state import JobHistory
from zdiag.render.format import fmt_ms

from .monitor_detail import BLOCKS
from .monitor_text import SPARK_CHARS

MAX_RANK_LINES = 256
"""Rank lines drawn (the slowest first); the others are counted under them."""
LABEL_WIDTH = 19
"""Columns of the labels before the plot ("rank 65535 1,234 ms"; a longer one is cut)."""
GUTTER = LABEL_WIDTH + 2
"""Columns before the first step: the label, a space and the axis."""
MARK = "▼"
SLOWEST = "•"
MARK_STYLE = "bold magenta"
SLOWEST_STYLE = "bold dark_orange"
CAPTURED_STYLE = "underline magenta"


@dataclass(frozen=True)
class CaptureMark:
    """The steps one triggered capture recorded: `first` to `last` (the start step + 1 to the
    start step + its number of steps: the rank warms the profiler up for the start step,
    collectors/capture_window.py)."""

    id: int
    first: int
    last: int

    @classmethod
    def of(cls, capture: dict[str, object]) -> CaptureMark | None:
        """The mark of a capture as `CaptureController.to_json` lists it (None when unusable)."""
        try:
            start, steps = int(capture["start_step"]), int(capture["steps"])  # type: ignore[call-overload]
            return cls(int(capture["id"]), start + 1, start + max(1, steps))  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError):
            return None


def steps_that_fit(width: int) -> int:
    """Steps (one column each) a view `width` columns wide shows beside the labels."""
    return max(1, width - GUTTER - 1)


def history_lines(history: JobHistory, marks: Sequence[CaptureMark], height: int = 8) -> list[Text]:
    """The whole view as lines (see the module docstring); `height` rows for the job chart."""
    if not history.steps:
        return [Text("no step times yet", style="dim")]
    pad = LABEL_WIDTH
    values = [v for series in history.ranks.values() for v in series if v is not None]
    values += [v for v in history.slowest_ms if v is not None]
    lo, hi = min(values), max(values)
    captured = _captured_columns(history.steps, marks)
    lines = [_mark_row(history.steps, marks, pad)]
    lines += _job_chart(history, lo, hi, pad, height)
    lines += _axis(history.steps, pad)
    lines.append(Text(""))
    lines += _rank_lines(history, lo, hi, pad, captured)
    return lines


def _mark_row(steps: tuple[int, ...], marks: Sequence[CaptureMark], pad: int) -> Text:
    """`▼` over each captured step, `cK` after a capture's last step (where it fits)."""
    row = [" "] * len(steps)
    first = steps[0]
    for mark in marks:
        columns = [s - first for s in range(mark.first, mark.last + 1) if first <= s <= steps[-1]]
        for col in columns:
            row[col] = MARK
        if columns:
            label = f"c{mark.id}"
            end = columns[-1] + 1
            for i, ch in enumerate(label[: max(0, len(row) - end)]):
                if row[end + i] == " ":
                    row[end + i] = ch
    text = Text(" " * (pad + 2))
    text.append("".join(row).rstrip(), style=MARK_STYLE)
    return text


def _level(value: float, lo: float, hi: float, levels: int) -> int:
    """`value` as a bar height in 1..levels on the range lo..hi (all `levels` when flat)."""
    span = hi - lo
    if not (span > 0 and math.isfinite(span)):
        return levels
    return max(1, min(levels, round((value - lo) / span * levels)))


def _job_chart(history: JobHistory, lo: float, hi: float, pad: int, height: int) -> list[Text]:
    """Median bars and slowest-rank dots, `height` rows, the y axis labelled with max and min."""
    levels = height * 8
    bars = [_level(v, lo, hi, levels) if v is not None else 0 for v in history.median_ms]
    dots = [
        (_level(v, lo, hi, levels) - 1) // 8 if v is not None else -1 for v in history.slowest_ms
    ]
    labels = {0: f"max {fmt_ms(hi)}", height - 1: f"min {fmt_ms(lo)}"}
    rows = []
    for row in range(height):  # top row first
        cell_row = height - 1 - row
        floor = cell_row * 8
        text = Text(f"{_fit(labels.get(row, ''), pad)} {'┤' if row in labels else '│'}")
        for bar, dot in zip(bars, dots, strict=True):
            if dot == cell_row and bar <= floor:
                text.append(SLOWEST, style=SLOWEST_STYLE)
            else:
                text.append(BLOCKS[max(0, min(8, bar - floor))])
        rows.append(text)
    return rows


def _axis(steps: tuple[int, ...], pad: int) -> list[Text]:
    """The step axis: a rule, then the first and last step numbers at its ends."""
    left, right = f"step {steps[0]}", f"step {steps[-1]}"
    gap = max(1, len(steps) + 1 - len(left) - len(right))
    return [
        Text(" " * (pad + 1) + "└" + "─" * len(steps)),
        Text(" " * (pad + 1) + f"{left}{' ' * gap}{right}"),
    ]


def _captured_columns(steps: tuple[int, ...], marks: Sequence[CaptureMark]) -> set[int]:
    first, last = steps[0], steps[-1]
    return {s - first for m in marks for s in range(max(m.first, first), min(m.last, last) + 1)}


def _fit(label: str, pad: int) -> str:
    """`label` right-aligned in `pad` columns (its end cut when longer)."""
    return f"{label[:pad]:>{pad}}"


def _rank_label(rank: int, median: float | None) -> str:
    return f"rank {rank}" + (f" {fmt_ms(median)}" if median is not None else "")


def _rank_lines(
    history: JobHistory, lo: float, hi: float, pad: int, captured: set[int]
) -> list[Text]:
    """One line per rank on the chart's scale, slowest first (its median over these steps)."""
    medians = {
        rank: statistics.median(vs) if (vs := [v for v in series if v is not None]) else None
        for rank, series in history.ranks.items()
    }
    order = sorted(medians, key=lambda r: (-(medians[r] or -math.inf), r))
    top = len(SPARK_CHARS) - 1
    lines = [Text(f"{'rank, median':>{pad}}  slowest first", style="dim")]
    for rank in order[:MAX_RANK_LINES]:
        text = Text(f"{_fit(_rank_label(rank, medians[rank]), pad)} │")
        if medians[rank] is None:
            text.append("no step time in these steps", style="dim")
        for col, v in enumerate(history.ranks[rank] if medians[rank] is not None else ()):
            ch = " " if v is None else SPARK_CHARS[(_level(v, lo, hi, top + 1) - 1)]
            text.append(ch, style=CAPTURED_STYLE if col in captured else "")
        lines.append(text)
    if len(order) > MAX_RANK_LINES:
        lines.append(Text(f"... {len(order) - MAX_RANK_LINES} more ranks", style="dim"))
    return lines
