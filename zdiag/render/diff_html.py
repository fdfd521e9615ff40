"""The diff page (`zdiag diff A B --html FILE`): two runs side by side on one self-contained page.

The headline and the warnings first; then the two runs side by side, each drawn by the HTML
report's own figure functions (step breakdown, FSDP units, memory) so a side looks as it does in
its report, with A and B on one scale per chart; then the breakdown's deltas and the tables of
every RunDiff section. plotly.js is inlined once and every figure script checked as in
render/html.py (whose helpers this module uses); every string from the data is escaped.
"""

from __future__ import annotations

from collections.abc import Callable

import plotly.graph_objects as go

from zdiag.analyzers.compare.model import RunDiff
from zdiag.analyzers.report import FsdpUnit, Report
from zdiag.render import _diff_html_tables as tables
from zdiag.render import _html_figures as figs
from zdiag.render._html_parts import e, memory_breakdowns
from zdiag.render.format import known_bytes
from zdiag.render.html import CSS, _Figures, _section, page

DIFF_CSS = """
.headline { font-size: 19px; font-weight: 600; background: var(--soft); border: 1px solid var(--line);
  border-left: 5px solid #0969da; border-radius: 6px; padding: 10px 16px; margin: 16px 0 8px;
  overflow-wrap: anywhere; }
.refused { border-left-color: #c62828; }
.runs { font-size: 14px; color: var(--muted); margin: 4px 0; overflow-wrap: anywhere; }
.runs b { color: var(--fg); }
.pair { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 14px; }
.pair > div { min-width: 0; }
.pair h3 { margin: 10px 0 0; font-size: 15px; overflow-wrap: anywhere; }
.side-a { color: #59636e; } .side-b { color: #0969da; }
@media (max-width: 900px) { .pair { grid-template-columns: minmax(0, 1fr); } }
.table-wrap, div[class^="num-from-"] { overflow-x: auto; }
.num-from-2 td:nth-child(n+2), .num-from-3 td:nth-child(n+3) { text-align: right; white-space: nowrap; }
.chg { color: #fff; border-radius: 10px; padding: 1px 8px; font-size: 12px; font-weight: 600;
  white-space: nowrap; }
.chg.chg-up { background: #c62828; } .chg.chg-down { background: #2e7d32; }
.chg.chg-same { background: #8c959f; } .chg.chg-unknown { background: #9a6700; }
.txt-up { color: #c62828; } .txt-down { color: #2e7d32; }
.keys td:first-child { white-space: nowrap; overflow-wrap: normal; }
details > summary { cursor: pointer; margin: 8px 0 4px; }
ul.warnings li { color: #8a4b00; }
"""

A_COLOR, B_COLOR = "#9aa5b1", "#4c78a8"
MIB = 1024 * 1024
HALF_TITLE_CHARS = 44
"""A title longer than this is broken in two lines on half the page."""
HALF_TOP = 120
"""The top margin (px) of a half-page figure: its title, then up to three legend rows."""
HEADROOM = 1.06
"""The shared y range of a pair of charts reaches this far above the larger side's top."""

FigureResult = tuple[go.Figure | None, list[str]]


def _runs_line(diff: RunDiff) -> str:
    """Which run is A and which is B, with their steps and ranks."""

    def one(side: str, label: str, steps: int, ranks: list[int]) -> str:
        return (
            f'<p class="runs"><b class="side-{side.lower()}">{side}</b> '
            f"{'baseline' if side == 'A' else 'candidate'}: <code>{e(label)}</code> "
            f"({steps} step(s) per rank, {len(ranks)} rank(s))</p>"
        )

    return one("A", diff.baseline, diff.steps_a, diff.ranks_a) + one(
        "B", diff.candidate, diff.steps_b, diff.ranks_b
    )


def _summary(diff: RunDiff) -> str:
    """The headline, the runs, the warnings, the step table and the shares."""
    refused = "" if diff.comparable else " refused"
    parts = [f'<section id="summary"><p class="headline{refused}">{e(diff.headline)}</p>']
    parts.append(_runs_line(diff))
    if diff.warnings:
        parts.append('<h3>Warnings</h3><ul class="warnings">')
        parts.extend(f"<li>{e(w)}</li>" for w in diff.warnings)
        parts.append("</ul>")
    parts.append("<h3>Step breakdown</h3>" + tables.step_table(diff))
    parts.append("<h3>Where the step-time change went</h3>" + tables.shares_table(diff))
    if diff.idle_causes:
        parts.append("<h3>Host waits (causes of idle)</h3>" + tables.idle_causes_table(diff))
    return "".join(parts) + "</section>"


def _same_y(results: list[FigureResult], top: float, row: int | None = None) -> None:
    """Put the pair's figures on one y range from 0 to `top` (in the figures' units)."""
    if top <= 0:
        return
    for fig, _ in results:
        if fig is not None:
            kwargs = {"row": row, "col": 1} if row is not None else {}
            fig.update_yaxes(range=[0, top * HEADROOM], autorange=False, **kwargs)


def _breakdowns(a: Report, b: Report) -> list[FigureResult]:
    """Both runs' step breakdowns, on the scale of the longest step of either."""
    pair = [figs.breakdown(a), figs.breakdown(b)]
    longest = max(
        (
            max(s.duration_ms, sum(figs._phases(s).values()))  # the bar's height
            for r in (*a.ranks, *b.ranks)
            for s in r.steps
        ),
        default=0.0,
    )
    _same_y(pair, longest)
    return pair


def _unit_max(reports: tuple[Report, Report], get: Callable[[FsdpUnit], float | None]) -> float:
    values = (get(u) for r in reports for u in r.fsdp_units)
    return max((v for v in values if v is not None), default=0.0)


def _units(a: Report, b: Report) -> list[FigureResult]:
    """Both runs' FSDP unit figures, each subplot on one scale for A and B."""
    pair = [figs.fsdp_units(a), figs.fsdp_units(b)]

    def mib(u: FsdpUnit) -> float | None:
        sizes = [
            known_bytes(u.all_gather_bytes, u.all_gather_count),
            known_bytes(u.reduce_bytes, u.reduce_count),
        ]
        return max((s / MIB for s in sizes if s is not None), default=None)

    _same_y(pair, _unit_max((a, b), mib), row=1)
    _same_y(pair, _unit_max((a, b), lambda u: u.exposed_wait_ms), row=2)
    return pair


def _memory(report: Report) -> FigureResult:
    """The memory figure of the rank with the highest peak (None without a timeline)."""
    if not report.memory:
        return None, []
    return figs.memory(max(report.memory, key=lambda m: (m.peak_bytes, -m.rank)))


def _fit_half(result: FigureResult) -> FigureResult:
    """A report figure made to fit half the page: its title on top (broken before its first
    parenthesis when long), room for the legend's extra rows below it, the peak label inside."""
    fig, notes = result
    if fig is None:
        return result
    title = str(fig.layout.title.text or "")
    if len(title) > HALF_TITLE_CHARS and " (" in title:
        title = title.replace(" (", "<br>(", 1)
    top = HALF_TOP + (20 if "<br>" in title else 0)
    extra = max(top - (fig.layout.margin.t or 0), 0)
    fig.update_layout(
        title={
            "text": title,
            "yref": "container",
            "y": 1.0,
            "yanchor": "top",
            "pad": {"t": 10 + (18 if "<br>" in title else 0)},
        },
        margin={"t": top},
        height=(fig.layout.height or 420) + extra,
    )
    fig.update_traces(textposition="top left", selector={"name": "peak"})
    return fig, notes


def _pair(
    figures: _Figures, name: str, results: list[FigureResult], diff: RunDiff, empty: str
) -> str:
    """Two columns, A | B, each a figure (or `empty`) under the run's label."""
    cols = []
    for side, label, result in zip("AB", (diff.baseline, diff.candidate), results, strict=True):
        body = figures.add(_fit_half(result), f"fig-{side.lower()}-{name}")
        inner = "".join(body) if body else f'<p class="empty">{e(empty)}</p>'
        cols.append(
            f'<div><h3><span class="side-{side.lower()}">{side}</span> '
            f"<code>{e(label)}</code></h3>{inner}</div>"
        )
    return f'<div class="pair">{"".join(cols)}</div>'


def delta_figure(diff: RunDiff) -> FigureResult:
    """Grouped bars per breakdown metric: A's and B's medians (ms/step), B's bar labeled with the
    delta and the hover saying its change and spread."""
    if not diff.step:
        return None, []
    x = [figs.esc(d.metric) for d in diff.step]
    fig = go.Figure(
        [
            go.Bar(
                name="A (baseline)",
                x=x,
                y=[d.a for d in diff.step],
                marker_color=A_COLOR,
                hovertemplate="%{x}: %{y:.2f} ms in A<extra></extra>",
            ),
            go.Bar(
                name="B (candidate)",
                x=x,
                y=[d.b for d in diff.step],
                marker_color=B_COLOR,
                text=[f"{tables.signed_ms(d.delta)} ms" for d in diff.step],
                textposition="outside",
                customdata=[
                    [figs.esc(d.change), f"{tables.signed_ms(d.delta)} ms", f"{d.spread:.2f}"]
                    for d in diff.step
                ],
                hovertemplate="%{x}: %{y:.2f} ms in B (%{customdata[1]}, %{customdata[0]}; "
                "spread ±%{customdata[2]} ms)<extra></extra>",
            ),
        ]
    )
    fig.update_layout(barmode="group")
    fig.update_xaxes(type="category")
    fig.update_yaxes(title_text="ms per step (median)")
    return figs._layout(fig, "Step breakdown: A vs B (ms per step)", 400), []


def _chart_sections(diff: RunDiff, a: Report, b: Report, figures: _Figures) -> list[str]:
    """The side-by-side section and the delta chart."""
    side = [
        "<h3>Where each step's time went</h3>",
        _pair(figures, "breakdown", _breakdowns(a, b), diff, "No steps to chart."),
        "<h3>FSDP units</h3>",
        _pair(figures, "fsdp-units", _units(a, b), diff, "No FSDP units were found."),
        "<h3>Memory</h3>",
        _pair(figures, "memory", [_memory(a), _memory(b)], diff, "No memory timeline."),
    ]
    snapshots = [memory_breakdowns(a), memory_breakdowns(b)]
    if any(snapshots):
        side.append(
            '<details><summary>Memory snapshots and what-ifs</summary><div class="pair">'
            + "".join(f"<div>{''.join(s)}</div>" for s in snapshots)
            + "</div></details>"
        )
    side.append('<p class="note">A and B share the y scale of the breakdown and unit charts.</p>')
    deltas = figures.add(delta_figure(diff), "fig-step-deltas")
    return [
        _section("side-by-side", "Side by side", side, ""),
        _section("deltas", "Breakdown deltas", deltas, "No steps to compare."),
    ]


def _table_sections(diff: RunDiff) -> list[str]:
    """One section per RunDiff table."""
    return [
        f'<section id="{anchor}"><h2>{e(title)}</h2>{body}</section>'
        for anchor, title, body in (
            ("ranks", "Per rank", tables.ranks_table(diff)),
            ("units", "FSDP units", tables.units_table(diff)),
            ("collectives", "Collectives", tables.collectives_table(diff)),
            ("groups", "Process groups", tables.groups_table(diff)),
            ("memory", "Peak memory", tables.memory_table(diff)),
            ("findings", "Findings appeared and gone", tables.findings_table(diff)),
            ("config", "Configuration differences", tables.config_table(diff)),
            ("operators", "Operators and kernels", tables.operators_tables(diff)),
        )
    ]


NAV = (
    ("summary", "Summary"),
    ("side-by-side", "Side by side"),
    ("deltas", "Deltas"),
    ("ranks", "Ranks"),
    ("units", "Units"),
    ("collectives", "Collectives"),
    ("groups", "Groups"),
    ("memory", "Memory"),
    ("findings", "Findings"),
    ("config", "Config"),
    ("operators", "Operators"),
)


def render_diff_html(diff: RunDiff, a: Report, b: Report) -> str:
    """The complete diff page of runs `a` (baseline) and `b` (candidate) as a string."""
    figures = _Figures()
    sections = [_summary(diff), *_chart_sections(diff, a, b, figures), *_table_sections(diff)]
    if figures.notes:
        notes = "".join(f"<li>{e(n)}</li>" for n in figures.notes)
        sections.insert(
            1, f'<section id="notes"><h2>Notes</h2><ul class="notes">{notes}</ul></section>'
        )
    nav = "".join(f'<a href="#{anchor}">{title}</a>' for anchor, title in NAV)
    subtitle = f"A: {diff.baseline} — B: {diff.candidate}"
    return page("zdiag diff", subtitle, "".join(sections), figures, nav=nav, css=CSS + DIFF_CSS)
