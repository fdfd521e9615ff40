"""The plotly figures of the HTML report, built only from what the Report holds.

Every figure function returns `(figure or None, notes)`: `None` when the Report has nothing to
show, and notes (plain text, escaped by the page) saying what was aggregated, downsampled or
truncated to keep large runs responsive. Every string read from a trace goes through `esc` before
it reaches plotly: plotly interprets a subset of HTML in labels and decodes entities, so escaped
names are shown literally and never interpreted.
"""

from __future__ import annotations

import html
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from zdiag.analyzers.report import (
    FsdpUnit,
    MemoryTimeline,
    Report,
    StepBreakdown,
    StepTimeline,
    TimelineSpan,
)
from zdiag.render.format import known_bytes, unit_label
from zdiag.render.stats import RankView

# Limits that keep the page responsive; beyond them the page aggregates and says so.
MAX_HEATMAP_RANKS = 256
MAX_HEATMAP_STEPS = 500
MAX_BREAKDOWN_RANK_CHOICES = 32
MAX_TIMELINE_STEPS = 3
MAX_TIMELINE_RANKS = 16
MAX_TIMELINE_SPANS = 4000  # per figure, over all its ranks
MAX_UNITS = 120
MAX_MEMORY_RANKS = 4
MAX_MEMORY_POINTS = 2000

VERDICT_COLORS = {
    "compute-bound": "#2e7d32",
    "exposed-comm": "#ef6c00",
    "comm-bound": "#c62828",
    "host-bound": "#6a1b9a",
}
PHASE_COLORS = {
    "compute (not overlapped)": "#4c78a8",
    "overlapped comm": "#72b7b2",
    "exposed comm": "#e45756",
    "memcpy": "#b279a2",
    "idle": "#bab0ac",
}
LANE_COLORS = {"compute": "#4c78a8", "memcpy": "#b279a2", "fsdp": "#9d755d"}
COMM_COLORS = ["#e45756", "#f58518", "#eeca3b", "#54a24b", "#ff9da6", "#79706e"]
MIB = 1024 * 1024
GIB = 1024 * MIB

Notes = list[str]


def esc(text: object) -> str:
    """Escape a value for plotly text (labels, hover): shown literally, never interpreted."""
    return html.escape(str(text), quote=True)


def _layout(fig: go.Figure, title: str, height: int, top: int = 70) -> go.Figure:
    fig.update_layout(
        title={"text": esc(title), "x": 0.01, "font": {"size": 15}},
        template="plotly_white",
        height=height,
        margin={"l": 70, "r": 20, "t": top, "b": 50},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.01, "xanchor": "right", "x": 1},
        hoverlabel={"namelength": -1},
    )
    return fig


def _ranks(report: Report) -> list[RankView]:
    return sorted(report.ranks, key=lambda r: r.rank)


def _step_ids(ranks: Sequence[RankView]) -> list[int]:
    return sorted({s.step for r in ranks for s in r.steps})


def _blocks(n: int, limit: int) -> int:
    """How many consecutive items go into one displayed cell so that at most `limit` remain."""
    return max(1, math.ceil(n / limit))


def _span_label(items: Sequence[int], start: int, size: int) -> str:
    chunk = items[start : start + size]
    return str(chunk[0]) if len(chunk) == 1 else f"{chunk[0]}–{chunk[-1]}"


def heatmap(
    report: Report, value: Callable[[StepBreakdown], float], title: str, what: str
) -> tuple[go.Figure | None, Notes]:
    """A ranks x steps heatmap of `value` (ms); blocks of ranks/steps show their maximum."""
    ranks = _ranks(report)
    steps = _step_ids(ranks)
    if not ranks or not steps:
        return None, []
    rank_ids = [r.rank for r in ranks]
    rb = _blocks(len(ranks), MAX_HEATMAP_RANKS)
    sb = _blocks(len(steps), MAX_HEATMAP_STEPS)
    col_of = {s: i // sb for i, s in enumerate(steps)}
    ncols = math.ceil(len(steps) / sb)
    z: list[list[float | None]] = []
    verdict_rows: list[list[str]] = []
    y_labels: list[str] = []
    for row_start in range(0, len(ranks), rb):
        row: list[float | None] = [None] * ncols
        verdicts: list[str] = [""] * ncols
        for r in ranks[row_start : row_start + rb]:
            for s in r.steps:
                c = col_of[s.step]
                v = value(s)
                if row[c] is None or v > (row[c] or 0.0):
                    row[c] = v
                    verdicts[c] = s.verdict
        label = _span_label(rank_ids, row_start, rb)
        y_labels.append(f"rank {label}" if rb == 1 else f"ranks {label}")
        z.append([None if v is None else round(v, 3) for v in row])
        verdict_rows.append([esc(v) for v in verdicts])
    x_labels = [_span_label(steps, c * sb, sb) for c in range(ncols)]
    # Colours anchored at 0 ms: 408 vs 412 ms differ by 1% and look alike; an autoscaled
    # 408..412 ms range would paint the noise as the whole scale, red against yellow.
    zmax = max((v for row in z for v in row if v is not None), default=0.0)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=x_labels,
            y=y_labels,
            customdata=verdict_rows,
            hovertemplate="%{y}, step %{x}: %{z:.2f} ms (%{customdata})<extra></extra>",
            colorscale="YlOrRd",
            zmin=0.0,
            zmax=zmax if zmax > 0 else 1.0,
            colorbar={"title": {"text": "ms"}},
            hoverongaps=False,
        )
    )
    fig.update_xaxes(title_text="step", type="category")
    fig.update_yaxes(title_text="rank", type="category", autorange="reversed")
    notes: Notes = []
    if rb > 1 or sb > 1:
        notes.append(
            f"{what}: {len(ranks)} ranks x {len(steps)} steps aggregated into blocks of "
            f"{rb} rank(s) x {sb} step(s); each cell shows the block's maximum."
        )
    height = min(900, max(260, 60 + 18 * len(y_labels)))
    return _layout(fig, title, height), notes


def _phases(s: StepBreakdown) -> dict[str, float]:
    return {
        "compute (not overlapped)": max(s.compute_ms - s.overlapped_ms, 0.0),
        "overlapped comm": s.overlapped_ms,
        "exposed comm": s.exposed_comm_ms,
        "memcpy": s.memcpy_ms,
        "idle": s.idle_ms,
    }


def _phase_series(rows: Sequence[RankView], steps: list[int], sb: int) -> dict[str, list[float]]:
    """Mean per phase over the given ranks and each block of `sb` steps."""
    sums: dict[str, list[float]] = {p: [0.0] * math.ceil(len(steps) / sb) for p in PHASE_COLORS}
    counts = [0] * math.ceil(len(steps) / sb)
    col_of = {s: i // sb for i, s in enumerate(steps)}
    for r in rows:
        for s in r.steps:
            c = col_of[s.step]
            counts[c] += 1
            for phase, v in _phases(s).items():
                sums[phase][c] += v
    return {
        p: [round(v / n, 3) if n else 0.0 for v, n in zip(vs, counts, strict=True)]
        for p, vs in sums.items()
    }


def breakdown(report: Report) -> tuple[go.Figure | None, Notes]:
    """Stacked bars per step: compute, overlapped comm, exposed comm, memcpy, idle (ms).

    Shows the mean over ranks, with a menu to pick one rank (the first ranks, up to a limit).
    """
    ranks = _ranks(report)
    steps = _step_ids(ranks)
    if not steps:
        return None, []
    sb = _blocks(len(steps), MAX_HEATMAP_STEPS)
    x = [_span_label(steps, c * sb, sb) for c in range(math.ceil(len(steps) / sb))]
    choices: list[tuple[str, Sequence[RankView]]] = [
        (f"mean of {len(ranks)} ranks" if len(ranks) > 1 else f"rank {ranks[0].rank}", ranks)
    ]
    if len(ranks) > 1:
        choices += [(f"rank {r.rank}", [r]) for r in ranks[:MAX_BREAKDOWN_RANK_CHOICES]]
    series = [(label, _phase_series(rows, steps, sb)) for label, rows in choices]
    fig = go.Figure(
        [
            go.Bar(
                name=phase,
                x=x,
                y=series[0][1][phase],
                marker_color=color,
                hovertemplate=f"step %{{x}}: %{{y:.2f}} ms {phase}<extra></extra>",
            )
            for phase, color in PHASE_COLORS.items()
        ]
    )
    fig.update_layout(barmode="stack")
    if len(series) > 1:
        buttons = [
            {"label": esc(label), "method": "restyle", "args": [{"y": list(data.values())}]}
            for label, data in series
        ]
        fig.update_layout(
            updatemenus=[
                {"buttons": buttons, "x": 0, "xanchor": "left", "y": 1.01, "yanchor": "bottom"}
            ],
        )
    fig.update_xaxes(title_text="step", type="category")
    fig.update_yaxes(title_text="ms")
    notes: Notes = []
    if sb > 1:
        notes.append(f"Breakdown: each bar is the mean over a block of {sb} steps.")
    if len(ranks) > MAX_BREAKDOWN_RANK_CHOICES:
        notes.append(
            f"Breakdown: the menu lists the first {MAX_BREAKDOWN_RANK_CHOICES} of {len(ranks)} ranks."
        )
    return _layout(fig, "Where each step's time went (ms)", 440, top=100), notes


def _lane_order(lane: str) -> tuple[int, str]:
    if lane == "compute":
        return (0, lane)
    if lane.startswith("comm:"):
        return (1, lane)
    return (2, lane) if lane == "memcpy" else (3, lane)


@dataclass(frozen=True)
class Bar:
    """One drawn bar of a timeline lane: `count` spans merged (1: the span itself)."""

    lane: str
    name: str  # the first span's name
    start_ms: float
    dur_ms: float
    busy_ms: float  # summed duration of the merged spans
    count: int


def _merge(spans: Sequence[TimelineSpan], gap_ms: float) -> list[Bar]:
    bars: list[Bar] = []
    by_lane: dict[str, list[TimelineSpan]] = defaultdict(list)
    for s in spans:
        by_lane[s.lane].append(s)
    for lane, items in by_lane.items():
        items = sorted(items, key=lambda s: s.start_ms)
        cur: list[TimelineSpan] = []
        end = -math.inf
        pending: list[TimelineSpan | None] = [*items, None]  # None flushes the last bar
        for nxt in pending:
            if nxt is not None and cur and nxt.start_ms - end <= gap_ms:
                cur.append(nxt)
                end = max(end, nxt.start_ms + nxt.dur_ms)
                continue
            if cur:
                start = cur[0].start_ms
                bars.append(
                    Bar(lane, cur[0].name, start, end - start, sum(c.dur_ms for c in cur), len(cur))
                )
            if nxt is not None:
                cur, end = [nxt], nxt.start_ms + nxt.dur_ms
    return sorted(bars, key=lambda b: b.start_ms)


def coalesce_spans(spans: Sequence[TimelineSpan], limit: int) -> tuple[list[Bar], float]:
    """At most `limit` bars covering every span of every lane across the whole step, and the
    gap (ms) under which neighbouring spans of a lane were merged (0: none merged).

    Spans of one lane closer than the gap become one bar; the gap starts at 1/4000 of the
    step's extent and doubles until the bars fit. A lane never loses its late spans, unlike
    drawing the first `limit` spans.
    """
    if len(spans) <= limit:
        return _merge(spans, -1.0), 0.0
    extent = max(s.start_ms + s.dur_ms for s in spans) - min(s.start_ms for s in spans)
    gap = max(extent / 4000.0, 1e-6)
    bars = _merge(spans, gap)
    while len(bars) > limit and gap < extent:
        gap *= 2
        bars = _merge(spans, gap)
    return bars, gap


def timeline(step: int, timelines: Sequence[StepTimeline]) -> tuple[go.Figure | None, Notes]:
    """Gantt-style bars of one step: a row per rank and lane, colored by lane kind."""
    chosen = sorted(timelines, key=lambda t: t.rank)[:MAX_TIMELINE_RANKS]
    total = sum(len(t.spans) for t in chosen)
    if total == 0:
        return None, []
    notes: Notes = []
    if len(timelines) > len(chosen):
        notes.append(
            f"Timeline of step {step}: the first {len(chosen)} of {len(timelines)} ranks are shown."
        )
    per_rank = max(1, MAX_TIMELINE_SPANS // len(chosen))
    drawn = [coalesce_spans(t.spans, per_rank) for t in chosen]
    gaps = [gap for _, gap in drawn if gap > 0]
    if gaps:
        notes.append(
            f"Timeline of step {step}: {total} spans; to draw every lane across the whole step, "
            f"spans of a lane less than {max(gaps):.3g} ms apart are drawn as one bar "
            "(its tooltip says how many)."
        )
    if any(t.truncated for t in chosen):
        cut = ", ".join(str(t.rank) for t in chosen if t.truncated)
        notes.append(
            f"Timeline of step {step}: the analysis kept only part of the spans (rank {cut})."
        )
    lanes_seen = sorted({s.lane for t in chosen for s in t.spans}, key=_lane_order)
    comm_color = {
        lane: COMM_COLORS[i % len(COMM_COLORS)]
        for i, lane in enumerate(lane for lane in lanes_seen if lane.startswith("comm:"))
    }
    rows: list[str] = []
    by_lane: dict[str, dict[str, list]] = defaultdict(
        lambda: {"y": [], "x": [], "base": [], "text": []}
    )
    for t, (bars, _) in zip(chosen, drawn, strict=True):
        for lane in sorted({s.lane for s in t.spans}, key=_lane_order):
            rows.append(f"rank {t.rank} · {esc(lane)}")
        for bar in bars:
            d = by_lane[bar.lane]
            d["y"].append(f"rank {t.rank} · {esc(bar.lane)}")
            d["x"].append(max(bar.dur_ms, 0.0))
            d["base"].append(bar.start_ms)
            what = esc(bar.name) if bar.count == 1 else f"{bar.count} spans, first {esc(bar.name)}"
            d["text"].append(
                f"{what}<br>start {bar.start_ms:.3f} ms, {bar.dur_ms:.3f} ms"
                + (f" (busy {bar.busy_ms:.3f} ms)" if bar.count > 1 else "")
                + f" (rank {t.rank})"
            )
    fig = go.Figure()
    for lane in lanes_seen:
        if lane not in by_lane:
            continue
        d = by_lane[lane]
        color = LANE_COLORS.get(lane) or comm_color.get(lane, "#888888")
        fig.add_trace(
            go.Bar(
                name=esc(lane),
                orientation="h",
                y=d["y"],
                x=d["x"],
                base=d["base"],
                hovertext=d["text"],
                hovertemplate="%{hovertext}<extra></extra>",
                marker={"color": color, "line": {"width": 0}},
                opacity=0.8,
                width=0.8,
            )
        )
    fig.update_layout(barmode="overlay")
    fig.update_yaxes(
        type="category",
        categoryorder="array",
        categoryarray=rows,
        autorange="reversed",
    )
    fig.update_xaxes(title_text=f"ms from the start of step {step}")
    height = min(1200, max(260, 90 + 24 * len(rows)))
    return _layout(fig, f"Timeline of step {step} per rank", height), notes


def timelines_by_step(report: Report) -> tuple[list[tuple[int, list[StepTimeline]]], Notes]:
    """The timelines grouped by step (at most MAX_TIMELINE_STEPS steps, in step order)."""
    groups: dict[int, list[StepTimeline]] = defaultdict(list)
    for t in report.timelines:
        groups[t.step].append(t)
    notes: Notes = []
    if len(groups) > MAX_TIMELINE_STEPS:
        notes.append(
            f"Timeline: the rank timelines cover {len(groups)} different steps; "
            f"the first {MAX_TIMELINE_STEPS} are drawn."
        )
    return sorted(groups.items())[:MAX_TIMELINE_STEPS], notes


def _shown_units(grouped: dict[str, list[FsdpUnit]]) -> tuple[list[str], Notes]:
    """The unit names drawn: all, or the MAX_UNITS with the largest exposed wait (noted)."""
    names = list(grouped)
    if len(names) <= MAX_UNITS:
        return names, []
    keep = set(
        sorted(names, key=lambda n: max(u.exposed_wait_ms for u in grouped[n]), reverse=True)[
            :MAX_UNITS
        ]
    )
    note = f"FSDP units: the {MAX_UNITS} of {len(names)} units with the largest exposed wait are shown."
    return [n for n in names if n in keep], [note]


def _unknown_sizes(grouped: dict[str, list[FsdpUnit]], names: list[str]) -> Notes:
    """A note naming the units some of whose collectives have no recorded size."""
    unknown = [
        unit_label(n)
        for n in names
        if any(
            known_bytes(u.all_gather_bytes, u.all_gather_count) is None
            or known_bytes(u.reduce_bytes, u.reduce_count) is None
            for u in grouped[n]
        )
    ]
    if not unknown:
        return []
    return [
        f"FSDP units: the traces did not record the size of some collectives of "
        f"{len(unknown)} unit(s) ({', '.join(unknown[:5])}{', …' if len(unknown) > 5 else ''}); "
        "their bytes are unknown and left out of the byte bars."
    ]


def _mib(total: int, count: int) -> float | None:
    known = known_bytes(total, count)
    return None if known is None else known / MIB


UNIT_BARS: list[tuple[str, Callable[[FsdpUnit], float | None], str, str, int]] = [
    # name, value per unit (MiB or ms), color, hover text, subplot row
    (
        "all-gather (MiB)",
        lambda u: _mib(u.all_gather_bytes, u.all_gather_count),
        "#4c78a8",
        "MiB gathered",
        1,
    ),
    ("reduce (MiB)", lambda u: _mib(u.reduce_bytes, u.reduce_count), "#72b7b2", "MiB reduced", 1),
    (
        "exposed wait (ms, mean over ranks)",
        lambda u: u.exposed_wait_ms,
        "#e45756",
        "ms exposed wait (mean)",
        2,
    ),
]
"""The bars of the FSDP units figure (each the mean over ranks)."""


def fsdp_units(report: Report) -> tuple[go.Figure | None, Notes]:
    """Per FSDP unit: bytes gathered and reduced (mean over ranks), exposed wait (mean and max)."""
    if not report.fsdp_units:
        return None, []
    grouped: dict[str, list[FsdpUnit]] = {}
    for u in report.fsdp_units:
        grouped.setdefault(u.name, []).append(u)
    names, notes = _shown_units(grouped)
    notes += _unknown_sizes(grouped, names)

    def mean(n: str, get: Callable[[FsdpUnit], float | None]) -> float | None:
        known = [v for v in (get(u) for u in grouped[n]) if v is not None]
        return sum(known) / len(known) if known else None  # None: a gap, not a 0 bar

    labels = [esc(unit_label(n)) for n in names]
    nranks = len({u.rank for u in report.fsdp_units})
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    for name, get, color, hover, row in UNIT_BARS:
        fig.add_trace(
            go.Bar(
                name=name,
                x=labels,
                y=[mean(n, get) for n in names],
                marker_color=color,
                hovertemplate=f"%{{x}}: %{{y:.{1 if row == 1 else 2}f}} {hover}<extra></extra>",
            ),
            row=row,
            col=1,
        )
    if nranks > 1:
        fig.add_trace(
            go.Scatter(
                name="exposed wait (ms, worst rank)",
                x=labels,
                y=[max(u.exposed_wait_ms for u in grouped[n]) for n in names],
                mode="markers",
                marker={"color": "#222222", "symbol": "line-ew-open", "size": 14},
                hovertemplate="%{x}: %{y:.2f} ms exposed wait (worst rank)<extra></extra>",
            ),
            row=2,
            col=1,
        )
    fig.update_layout(barmode="group")
    fig.update_xaxes(type="category", row=1, col=1)
    fig.update_xaxes(type="category", title_text="FSDP unit", row=2, col=1)
    fig.update_yaxes(title_text="MiB (mean)", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=2, col=1)
    title = f"FSDP units: bytes moved and exposed wait ({nranks} rank{'s' if nranks != 1 else ''})"
    return _layout(fig, title, 560), notes


def memory(timeline_: MemoryTimeline) -> tuple[go.Figure | None, Notes]:
    """Stacked memory by category over time, capacity as a line, the peak marked; in GiB, or MiB
    when the data stays under 1 GiB; max per bucket if long."""
    n = len(timeline_.times_ms)
    if n == 0 or not timeline_.bytes_by_category:
        return None, []
    stride = _blocks(n, MAX_MEMORY_POINTS)
    notes: Notes = []
    if stride > 1:
        notes.append(
            f"Memory of rank {timeline_.rank}: {n} samples downsampled to buckets of {stride} "
            "(each bucket shows its maximum)."
        )
    capacity = timeline_.capacity_bytes
    show_capacity = bool(capacity) and timeline_.peak_bytes >= 0.5 * (capacity or 0)
    top = max(timeline_.peak_bytes, capacity if show_capacity and capacity else 0)
    unit, scale = ("GiB", GIB) if top >= GIB else ("MiB", 1024**2)
    origin = timeline_.times_ms[0]
    times = [round(t - origin, 3) for t in timeline_.times_ms[::stride]]
    fig = go.Figure()
    for category, values in timeline_.bytes_by_category.items():
        ys = [max(values[i : i + stride], default=0) / scale for i in range(0, n, stride)]
        fig.add_trace(
            go.Scatter(
                name=esc(category),
                x=times,
                y=ys,
                stackgroup="memory",
                mode="lines",
                hovertemplate=f"{esc(category)}: %{{y:.3f}} {unit} at %{{x:.1f}} ms<extra></extra>",
            )
        )
    # the capacity line only where it is near the data; else it would flatten the chart
    if show_capacity and capacity:
        fig.add_hline(
            y=capacity / scale,
            line_dash="dash",
            line_color="#c62828",
            annotation_text="device capacity",
        )
    totals = [
        sum(v[i] for v in timeline_.bytes_by_category.values() if i < len(v)) for i in range(n)
    ]
    peak_i = max(range(n), key=totals.__getitem__)
    fig.add_trace(
        go.Scatter(
            name="peak",
            x=[round(timeline_.times_ms[peak_i] - origin, 3)],
            y=[totals[peak_i] / scale],
            mode="markers+text",
            marker={"symbol": "triangle-down", "size": 12, "color": "#c62828"},
            text=[f"peak {totals[peak_i] / scale:.2f} {unit}"],
            textposition="top center",
            hovertemplate=f"peak: %{{y:.3f}} {unit} at %{{x:.1f}} ms<extra></extra>",
        )
    )
    fig.update_xaxes(title_text="ms from the first memory sample")
    fig.update_yaxes(title_text=unit)
    of = f" of {capacity / GIB:.1f} GiB" if capacity else ""
    title = (
        f"Memory of rank {timeline_.rank} by category (peak {timeline_.peak_bytes / GIB:.2f} GiB"
        f"{of}{', OOM' if timeline_.oom else ''}; source: {timeline_.source})"
    )
    return _layout(fig, title, 380), notes
