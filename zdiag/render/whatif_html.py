"""The what-if page (`zdiag whatif --html FILE`): the replayed step against the measured one.

One self-contained page: the headline, a timeline figure of the representative step (the
training lane's waits and each comm lane's collectives, as measured and as replayed with the
change, one row each), and the per-rank table. plotly.js is inlined once and the figure script
checked as in render/html.py (whose helpers this uses); every string from the data is escaped.
"""

from __future__ import annotations

import plotly.graph_objects as go

from zdiag.analyzers.rank.step_model import StepModel
from zdiag.analyzers.whatif.replay import Replay
from zdiag.analyzers.whatif.run_whatif import WhatIfResult
from zdiag.render._html_parts import _table, e
from zdiag.render.format import fmt_bytes, fmt_ms
from zdiag.render.html import _Figures, page
from zdiag.render.whatif_text import lane_label, render_whatif_text

MEASURED_COLOR, CHANGED_COLOR, WAIT_COLOR = "#9aa5b1", "#4c78a8", "#c62828"
MAX_BARS = 4000
"""Bars drawn per side (a step with more ops draws its first ones; a note says so)."""


def _bars(
    model: StepModel, rep: Replay, side: str
) -> tuple[list[str], list[float], list[float], list[str], list[str]]:
    rows, bases, widths, colors, texts = [], [], [], [], []
    for op, t in list(zip(model.ops, rep.ops, strict=True))[:MAX_BARS]:
        rows.append(f"{side} · {lane_label(op.lane)}")
        bases.append(t.start_us / 1e3)
        widths.append(max(t.end_us - t.start_us, 0.0) / 1e3)
        colors.append(MEASURED_COLOR if side == "measured" else CHANGED_COLOR)
        texts.append(f"{op.kind} {op.unit}".strip())
        if t.waited_us > 0:
            rows.append(f"{side} · training lane waits")
            bases.append((t.end_us - t.waited_us) / 1e3)
            widths.append(t.waited_us / 1e3)
            colors.append(WAIT_COLOR)
            texts.append(f"wait {op.kind} {op.unit}".strip())
    rows.append(f"{side} · step")
    bases.append(0.0)
    widths.append(rep.duration_us / 1e3)
    colors.append(MEASURED_COLOR if side == "measured" else CHANGED_COLOR)
    texts.append(f"step {fmt_ms(rep.duration_us / 1e3)}")
    return rows, bases, widths, colors, texts


def _timeline(result: WhatIfResult) -> tuple[go.Figure | None, list[str]]:
    tl = result.timeline
    if tl is None:
        return None, ["no step was replayed: nothing to draw"]
    notes = []
    if len(tl.model.ops) > MAX_BARS:
        notes.append(f"the timeline draws the first {MAX_BARS} of {len(tl.model.ops)} collectives")
    fig = go.Figure()
    for side, model, rep in (
        ("measured", tl.model, tl.measured),
        ("what-if", tl.changed_model, tl.changed),
    ):
        rows, bases, widths, colors, texts = _bars(model, rep, side)
        fig.add_trace(
            go.Bar(
                y=rows,
                x=widths,
                base=bases,
                orientation="h",
                marker_color=colors,
                hovertext=texts,
                hoverinfo="text+x",
                name=side,
            )
        )
    n_rows = len({r for d in fig.data for r in d.y})
    fig.update_layout(
        title=f"rank {tl.rank}, step {tl.model.step}: as measured and with {result.change.label()}",
        xaxis_title="ms from the step's start",
        barmode="overlay",
        height=max(320, 28 * n_rows + 140),
        yaxis={"autorange": "reversed"},
    )
    return fig, notes


def render_whatif_html(result: WhatIfResult) -> str:
    """The complete page as a string."""
    figures = _Figures()
    body = figures.add(_timeline(result), "fig-whatif-timeline")
    rows = [
        [
            e(x.rank),
            e(x.steps),
            e(fmt_ms(x.measured_ms)),
            e(fmt_ms(x.replayed_ms)),
            e(fmt_ms(x.predicted_ms)),
            e(fmt_bytes(x.peak_bytes)),
            e(fmt_bytes(x.predicted_peak_bytes)),
        ]
        for x in result.ranks
    ]
    headers = ["rank", "steps", "measured", "replayed", "predicted", "peak", "predicted peak"]
    notes = "".join(f"<li>{e(n)}</li>" for n in figures.notes)
    main = (
        f'<section id="summary"><pre>{e(render_whatif_text(result, 200))}</pre></section>'
        f'<section id="timeline"><h2>The replayed step</h2>{"".join(body)}'
        f'<ul class="notes">{notes}</ul></section>'
        f'<section id="ranks"><h2>Per rank</h2>{_table(headers, rows)}</section>'
    )
    return page("zdiag what-if", result.change.label(), main, figures)
