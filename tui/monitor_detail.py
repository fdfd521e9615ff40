"""One rank's detail as plain text lines: a step-time chart with labelled axes, the
compute/comm/idle split, memory and the last collective (the TUI's rank screen shows them).

No Textual here; durations and sizes go through the view layer's formatters.
"""

from __future__ import annotations

import math

from zdiag.live.findings import PROCESS_MEMORY
from zdiag.live.history import WINDOW_STEPS
from zdiag.live.state import RankDetail
from zdiag.render.format import fmt_bytes, fmt_ms

from .monitor_text import fmt_age, job_label, shown

BLOCKS = " ▁▂▃▄▅▆▇█"


def step_chart(history: tuple[tuple[int, float, float], ...], width: int, height: int) -> list[str]:
    """A bar chart of (step, ts, step_time_ms): one column per step (the last that fit in `width`
    beside the labels), `height` rows between the labelled min and max, then an axis with the
    first and last step numbers and the time they span."""
    columns = max(1, width - len("max 1,000 ms") - 2)
    shown = history[-columns:]
    if not shown:
        return ["no step times yet"]
    values = [v for _, _, v in shown]
    lo, hi = min(values), max(values)
    span = hi - lo
    levels = height * 8
    heights = [
        levels
        if not (span > 0 and math.isfinite(span))
        else max(1, round((v - lo) / span * levels))
        for v in values
    ]
    labels = {0: f"max {fmt_ms(hi)}", height - 1: f"min {fmt_ms(lo)}"}
    pad = max(len(text) for text in labels.values())
    rows = []
    for row in range(height):  # top row first
        floor = (height - 1 - row) * 8
        bars = "".join(BLOCKS[max(0, min(8, h - floor))] for h in heights)
        label = labels.get(row, "")
        rows.append(f"{label:>{pad}} {'┤' if label else '│'}{bars}")
    first, last = shown[0], shown[-1]
    rows.append(" " * (pad + 1) + "└" + "─" * len(shown))
    left, right = f"step {first[0]}", f"step {last[0]}"
    gap = max(1, len(shown) + 1 - len(left) - len(right))
    rows.append(" " * (pad + 1) + f"{left}{' ' * gap}{right}  ({last[1] - first[1]:.0f} s)")
    return rows


def detail_title(d: RankDetail) -> str:
    """The detail's first line: who the rank is and how it stands."""
    parts = [
        f"rank {d.rank}",
        shown(d.host),
        f"job {job_label(d.job)}",
        f"pid {d.pid if d.pid is not None else '?'}",
        f"{d.status} (last record {fmt_age(d.age_s)} ago)",
    ]
    if d.restarts:
        parts.append(f"restarted {d.restarts}x")
    parts.append(f"dropped {d.dropped}")
    return " · ".join(parts)


def detail_lines(d: RankDetail) -> list[str]:
    """The split, memory and last collective lines under the chart."""
    lines = [
        f"median of the last {WINDOW_STEPS} steps:",
        f"  step {fmt_ms(d.step_time_ms)}: compute {fmt_ms(d.compute_ms)}, "
        f"exposed comm {fmt_ms(d.exposed_comm_ms)}, idle {fmt_ms(d.idle_ms)}",
        f"  comm in flight {fmt_ms(d.comm_ms)}: overlapped {fmt_ms(d.overlapped_comm_ms)}, "
        f"exposed {fmt_ms(d.exposed_comm_ms)}",
        f"memory: allocated {fmt_bytes(d.mem_allocated_bytes)} · reserved "
        f"{fmt_bytes(d.mem_reserved_bytes)} · peak {fmt_bytes(d.mem_peak_bytes)} · " + _creep(d),
        f"last collective: {shown(d.last_collective or '-')}",
    ]
    if d.comm_by_dim:
        lines.insert(3, "  by mesh dimension, last step: " + _by_dim(d.comm_by_dim))
    if d.hung_in:
        lines.append(f"hung in {shown(d.hung_in)}")
    return lines


def _by_dim(comm_by_dim: dict[str, tuple[float, float]]) -> str:
    """ "dp 12.0 ms (exposed 3.0 ms) · tp ...": each dimension's comm, largest first."""
    ordered = sorted(comm_by_dim.items(), key=lambda kv: -kv[1][0])
    return " · ".join(
        f"{shown(label)} {fmt_ms(comm)} (exposed {fmt_ms(exposed)})"
        for label, (comm, exposed) in ordered
    )


def _creep(d: RankDetail) -> str:
    """What the memory-creep rule says of the rank."""
    if d.mem_source == PROCESS_MEMORY:
        return "process RSS: creep not judged"
    if d.mem_creep_bytes_per_step is None:
        return "not creeping"
    return f"creeping {fmt_bytes(d.mem_creep_bytes_per_step)}/step"
