"""The HTML report's "Communication by mesh dimension" figure (zdiag/render/dimensions.py)."""

from __future__ import annotations

import plotly.graph_objects as go

from zdiag.analyzers.report import Report
from zdiag.render._html_figures import (
    COMM_COLORS,
    MAX_BREAKDOWN_RANK_CHOICES,
    Notes,
    _layout,
    _ranks,
    esc,
)
from zdiag.render.dimensions import dimension_label, dimension_shares


def comm_by_dimension(report: Report) -> tuple[go.Figure | None, Notes]:
    """Stacked bars per rank: each dimension's exposed and overlapped communication, mean per
    step (ms); None when no rank's steps are split by dimension."""
    ranks = _ranks(report)
    shown = ranks[:MAX_BREAKDOWN_RANK_CHOICES]
    shares = dimension_shares(report, shown)
    if not shares:
        return None, []
    x = sorted({f"rank {s.rank}" for s in shares}, key=lambda v: int(v.split()[1]))
    names = list(dict.fromkeys(s.dimension for s in shares))
    traces = []
    for i, name in enumerate(names):
        mine = {f"rank {s.rank}": s for s in shares if s.dimension == name}
        label = esc(dimension_label(next(iter(mine.values()))))
        color = COMM_COLORS[i % len(COMM_COLORS)]
        for part, opacity in (("exposed", 1.0), ("overlapped", 0.45)):
            y = [
                (s.exposed_ms if part == "exposed" else s.comm_ms - s.exposed_ms)
                if (s := mine.get(r)) is not None
                else 0.0
                for r in x
            ]
            traces.append(
                go.Bar(
                    name=f"{label} {part}",
                    x=x,
                    y=y,
                    marker_color=color,
                    opacity=opacity,
                    hovertemplate="%{x}: %{y:.2f} ms %{fullData.name}<extra></extra>",
                )
            )
    fig = go.Figure(traces)
    fig.update_layout(barmode="stack")
    fig.update_xaxes(type="category")
    fig.update_yaxes(title_text="ms per step")
    notes: Notes = []
    if len(ranks) > len(shown):
        notes.append(
            f"Communication by mesh dimension: the first {len(shown)} of {len(ranks)} ranks."
        )
    title = "Communication by mesh dimension, mean per step (ms)"
    return _layout(fig, title, 420, top=100), notes
