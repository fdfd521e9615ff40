"""Plain-text and JSON renderers of a `MonitorView` (headless mode, ssh without a TTY, tests).

No Textual here; the Textual app reuses the cell formatters. Durations and sizes are formatted
by the view layer's one formatting module (zdiag.render.format), like the report.

Host and job names, `hung_in` and finding titles come from the wire: every one that these
renderers put in a line goes through `shown` (zdiag.render.printable's `printable`, plus newline
and tab), so an escape sequence in a name reaches the terminal as text, never as a command.
The JSON output keeps the names exactly (JSON escapes them itself).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgspec

from zdiag.live.state import MonitorView, RankRow
from zdiag.render.format import fmt_bytes, fmt_ms
from zdiag.render.printable import printable

SPARK_CHARS = "▁▂▃▄▅▆▇█"
STATUS_ORDER = {  # worst first
    "hung": 0,
    "failed": 1,
    "gone": 2,
    "stale": 3,
    "straggler": 4,
    "ok": 5,
    "finished": 6,
}
NOT_REPORTING = ("stale", "gone", "hung", "finished", "failed")
"""Statuses of ranks that no longer send steps (the header counts the others as reporting)."""


def shown(text: str) -> str:
    """A name from the wire as one line of inert text: `printable` (C0/C1 controls, DEL and bidi
    overrides as visible escapes) with newline and tab escaped too, so a name cannot break or
    shift the table's lines."""
    text = printable(text)
    if "\n" in text or "\t" in text:
        text = text.replace("\n", "\\n").replace("\t", "\\t")
    return text


def fmt_age(seconds: float) -> str:
    """Time since the last record."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def spark(values: tuple[float, ...], scale: tuple[float, float] | None = None) -> str:
    """A one-line sparkline of `values` on the range `scale` (lo, hi; their own range by default).

    A range narrower than 2% of its top draws mid-height bars: equal values look equal.
    """
    if not values:
        return ""
    lo, hi = scale if scale is not None else (min(values), max(values))
    last = len(SPARK_CHARS) - 1
    # Halved, so that the span of absurd values (+-1.7e308) stays finite.
    half_lo, half_span = lo / 2, hi / 2 - lo / 2
    if not math.isfinite(half_span) or half_span <= 0.01 * abs(hi):
        return SPARK_CHARS[last // 2] * len(values)
    return "".join(SPARK_CHARS[_level(v / 2 - half_lo, half_span, last)] for v in values)


def _level(offset: float, span: float, top: int) -> int:
    """`offset` / `span` as a bar index in 0..top (the middle when it is not a number)."""
    level = offset / span * top
    return max(0, min(top, round(level))) if math.isfinite(level) else top // 2


def header_line(view: MonitorView, listen: str = "") -> str:
    """The one-line header: job, ranks reporting, step rate, problems, the listen address."""
    parts = [f"job {job_label(view.job)}"]
    if len(view.jobs) > 1:
        parts[-1] += f" ({view.jobs.index(view.job) + 1}/{len(view.jobs)})"
    counts = view.status_counts
    reporting = len(view.rows) - sum(counts.get(s, 0) for s in NOT_REPORTING)
    parts.append(f"{reporting} ranks")
    not_ok = [f"{counts[s]} {s}" for s in ("straggler", *NOT_REPORTING) if counts.get(s)]
    if not_ok:
        parts[-1] += f" ({', '.join(not_ok)})"
    rate = view.steps_per_s
    parts.append(f"{rate:.2f} steps/s" if rate is not None else "- steps/s")
    if view.lag_p50_ms is not None:
        parts.append(f"lag {view.lag_p50_ms:.0f} ms")
    if view.relays:
        parts.append(f"{view.relays} relays")
    parts.append(f"dropped {view.dropped}")
    parts.append(f"rejected {view.rejected}{_by_reason(view.rejections)}")
    if listen:
        parts.append(f"on {listen}")
    return " · ".join(parts)


def job_label(job: str) -> str:
    """A job id as shown (printable; "(no job id)" for records without one)."""
    return shown(job) if job else "(no job id)"


def _by_reason(rejections: dict[str, int]) -> str:
    """ " (3 oversize, 1 token)": the rejection counts by reason, most frequent first."""
    if not rejections:
        return ""
    ordered = sorted(rejections.items(), key=lambda kv: (-kv[1], kv[0]))
    return " (" + ", ".join(f"{n} {reason}" for reason, n in ordered) + ")"


def spark_scale(view: MonitorView) -> tuple[float, float] | None:
    """The range of all ranks' recent step times: the common scale of the per-rank sparklines."""
    values = [v for r in view.rows for v in r.recent_step_ms]
    return (min(values), max(values)) if values else None


def row_cells(row: RankRow, scale: tuple[float, float] | None = None) -> tuple[str, ...]:
    """The table cells of one rank (rank, host, step, step time, exposed, memory, status, recent).

    The recent step times are drawn on `scale` (see `spark_scale`), so ranks compare.
    """
    return (
        str(row.rank),
        shown(row.host),
        str(row.step),
        fmt_ms(row.step_time_ms),
        fmt_ms(row.exposed_comm_ms),
        fmt_bytes(row.mem_allocated_bytes),
        fmt_bytes(row.mem_peak_bytes),
        _status_cell(row),
        spark(row.recent_step_ms, scale),
    )


def _status_cell(row: RankRow) -> str:
    if row.status == "hung":
        return f"hung in {shown(row.hung_in or '?')}"
    if row.status in ("ok", "straggler", "finished", "failed"):
        return row.status
    return f"{row.status} {fmt_age(row.age_s)}"


COLUMNS = (
    "rank",
    "host",
    "step",
    "step time",
    "exposed comm",
    "mem alloc",
    "mem peak",
    "status",
    "recent",
)


def render_summary(view: MonitorView, *, source: str = "", max_rows: int = 64) -> str:
    """The headless summary: header, findings, then the rank table (worst ranks first)."""
    lines = [f"zdiag monitor{f' ({source})' if source else ''}", header_line(view)]
    if len(view.jobs) > 1:
        lines.append(f"jobs seen: {', '.join(job_label(j) for j in view.jobs)} (shown: the latest)")
    if view.lag_max_ms is not None:
        lines.append(
            f"records {view.records}, receive lag p50 {view.lag_p50_ms:.1f} ms, "
            f"p99 {view.lag_p99_ms:.1f} ms, max {view.lag_max_ms:.1f} ms"
        )
    lines.append("")
    if view.findings:
        lines.append("findings:")
        for f in view.findings:
            title = shown(f"[{f.severity}] {f.id}: {f.title}")
            lines.append(f"  {title} (ranks {_ranks(f.ranks)})")
    else:
        lines.append("findings: none")
    lines.append("")
    if not view.rows:
        lines.append("no rank has reported yet")
        return "\n".join(lines) + "\n"
    rows = sorted(view.rows, key=lambda r: (STATUS_ORDER.get(r.status, 9), r.rank))[:max_rows]
    scale = spark_scale(view)
    table = [COLUMNS, *(row_cells(r, scale) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    for cells in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    if len(view.rows) > max_rows:
        lines.append(f"... {len(view.rows) - max_rows} more ranks")
    return "\n".join(lines) + "\n"


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" +{len(ranks) - 8}" if len(ranks) > 8 else "")


def view_to_json(view: MonitorView) -> dict[str, Any]:
    """The view as plain JSON-able data (`zdiag monitor --headless --json`)."""
    out = dataclasses.asdict(view)
    out["findings"] = [msgspec.to_builtins(f) for f in view.findings]
    out["status_counts"] = view.status_counts
    return finite_json(out)


def finite_json(value: Any) -> Any:
    """`value` with every infinite or NaN float replaced by None (JSON has neither), so that
    `json.dumps(..., allow_nan=False)` never fails and never prints `Infinity`."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value
