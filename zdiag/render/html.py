"""The HTML report (`zdiag analyze PATH --html FILE`): one self-contained, interactive page.

plotly's JavaScript is inlined once, so the page loads nothing from the network. Names read from
traces are untrusted: HTML text goes through `html.escape`, plotly labels are escaped too, and the
figures' JSON comes from plotly's serializer (which writes `<`, `>` and `/` as `\\u003c`, ...);
every script block is checked before it is written. Large runs are aggregated or truncated
(limits in `_html_figures`), and the page says so under "Notes".
"""

from __future__ import annotations

import base64
import functools
import gzip
import re

import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

from zdiag.analyzers.report import Report
from zdiag.render import _html_figures as figs
from zdiag.render import _html_parts as parts
from zdiag.render._html_dimensions import comm_by_dimension
from zdiag.render._html_large_run import large_run_section
from zdiag.render._html_parts import e
from zdiag.render.renderer import Destination, Rendered, Renderer
from zdiag.render.stats import LARGE_RUN_RANKS

PLOTLY_CONFIG = {"displaylogo": False, "responsive": True, "scrollZoom": False}

CSS = """
:root { --fg:#1f2328; --muted:#59636e; --line:#d1d9e0; --bg:#ffffff; --soft:#f6f8fa; }
* { box-sizing: border-box; }
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
  background: var(--bg); margin: 0; line-height: 1.45; }
header { background: #24292f; color: #fff; padding: 14px 24px; }
header h1 { margin: 0; font-size: 20px; } header p { margin: 4px 0 0; color: #c9d1d9; font-size: 13px; }
nav { position: sticky; top: 0; background: var(--soft); border-bottom: 1px solid var(--line);
  padding: 6px 24px; z-index: 10; font-size: 14px; }
nav a { margin-right: 14px; color: #0969da; text-decoration: none; }
main { max-width: 1280px; margin: 0 auto; padding: 8px 24px 48px; }
section { margin-top: 28px; } h2 { border-bottom: 1px solid var(--line); padding-bottom: 4px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 14px; }
th, td { border: 1px solid var(--line); padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: var(--soft); } td { font-variant-numeric: tabular-nums; overflow-wrap: anywhere; }
.facts { display: flex; flex-wrap: wrap; gap: 10px; margin: 8px 0; }
.facts div { background: var(--soft); border: 1px solid var(--line); border-radius: 6px; padding: 6px 12px; }
.facts dt { font-size: 12px; color: var(--muted); } .facts dd { margin: 0; font-size: 18px; font-weight: 600; }
.chip, .sev { color: #fff; border-radius: 10px; padding: 1px 8px; font-size: 12px; font-weight: 600;
  white-space: nowrap; }
.sev-critical { background: #c62828; } .sev-warning { background: #ef6c00; } .sev-info { background: #1565c0; }
.finding { border: 1px solid var(--line); border-left: 5px solid #888; border-radius: 6px;
  padding: 4px 16px 10px; margin: 14px 0; }
.sev-border-critical { border-left-color: #c62828; } .sev-border-warning { border-left-color: #ef6c00; }
.sev-border-info { border-left-color: #1565c0; }
.finding h3 { font-size: 16px; overflow-wrap: anywhere; } .where, .gain, .note { color: var(--muted); font-size: 14px; }
pre { background: var(--soft); border: 1px solid var(--line); border-radius: 6px; padding: 10px;
  overflow-x: auto; font-size: 13px; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; overflow-wrap: anywhere; }
td.num { text-align: right; }
.empty { color: var(--muted); font-style: italic; }
.figure { border: 1px solid var(--line); border-radius: 6px; margin: 12px 0; padding: 4px; }
.notes li { color: #8a4b00; }
"""


def _figure_html(fig: go.Figure, div_id: str) -> str:
    """One figure as a <div> plus its script, after checking the script cannot be broken out of."""
    fragment = pio.to_html(
        fig,
        full_html=False,
        include_plotlyjs=False,
        div_id=div_id,
        config=PLOTLY_CONFIG,
        default_width="100%",
        default_height=f"{fig.layout.height or 420}px",
    )
    lowered = fragment.lower()
    if lowered.count("</script") != lowered.count("<script") or "<!--" in lowered:
        raise RuntimeError(f"plotly produced an unsafe script block for {div_id}; not writing it")
    # run after plotly.js is unpacked (see PLOTLY_LOADER), in page order
    deferred = re.sub(
        r'<script(?: type="text/javascript")?>', f'<script type="{FIGURE_SCRIPT_TYPE}">', fragment
    )
    if deferred.count(FIGURE_SCRIPT_TYPE) != lowered.count("<script"):
        raise RuntimeError(f"plotly wrote an unexpected script tag for {div_id}; not writing it")
    return f'<div class="figure">{deferred}</div>'


FIGURE_SCRIPT_TYPE = "text/x-zdiag-figure"

PLOTLY_LOADER = """
(async function () {
  var packed = document.getElementById("zdiag-plotly-gz").textContent;
  var bytes = Uint8Array.from(atob(packed), function (c) { return c.charCodeAt(0); });
  var stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  var code = await new Response(stream).text();
  (0, eval)(code);
  document.querySelectorAll('script[type="FIGURE_SCRIPT_TYPE"]').forEach(function (s) { (0, eval)(s.textContent); });
})().catch(function (err) {
  var p = document.createElement("p");
  p.className = "notes";
  p.textContent = "The charts could not be drawn: this browser cannot unpack them (" + err + ").";
  document.body.insertBefore(p, document.body.firstChild);
});
""".replace("FIGURE_SCRIPT_TYPE", FIGURE_SCRIPT_TYPE)
"""Unpacks the inlined, gzipped plotly.js with the browser's DecompressionStream (Chrome 80,
Firefox 113, Safari 16.4), then runs the figures' scripts: 1.4 MB of gzip (1.9 MB as base64)
instead of 4.6 MB of JavaScript, and still nothing loaded from the network."""


@functools.lru_cache(maxsize=1)
def packed_plotlyjs() -> str:
    """plotly.js from the installed plotly package, gzipped and base64-encoded (computed once)."""
    return base64.b64encode(gzip.compress(get_plotlyjs().encode("utf-8"), 9, mtime=0)).decode()


def _section(anchor: str, title: str, body: list[str], empty: str) -> str:
    inner = "".join(body) if body else f'<p class="empty">{e(empty)}</p>'
    return f'<section id="{anchor}"><h2>{e(title)}</h2>{inner}</section>'


class _Figures:
    """The page's figures as they are added: how many, and the notes on what was cut."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.count = 0

    def add(self, result: tuple[go.Figure | None, list[str]], div_id: str) -> list[str]:
        """The figure's HTML (none when there is nothing to draw); its notes are kept."""
        fig, fig_notes = result
        self.notes.extend(fig_notes)
        if fig is None:
            return []
        self.count += 1
        return [_figure_html(fig, div_id)]


def _chart_sections(report: Report, figures: _Figures) -> list[str]:
    """The Steps, Timeline, FSDP units and Memory sections."""
    add = figures.add
    steps_body = add(
        figs.heatmap(
            report, lambda s: s.duration_ms, "Step time per rank and step (ms)", "Step time"
        ),
        "fig-step-time",
    )
    steps_body += add(
        figs.heatmap(
            report,
            lambda s: s.exposed_comm_ms,
            "Exposed communication per rank and step (ms)",
            "Exposed communication",
        ),
        "fig-exposed-comm",
    )
    steps_body += add(figs.breakdown(report), "fig-breakdown")
    steps_body += add(comm_by_dimension(report), "fig-comm-by-dimension")
    steps_body += parts.step_tables(report)
    timeline_body: list[str] = []
    timeline_groups, timeline_notes = figs.timelines_by_step(report)
    figures.notes.extend(timeline_notes)
    for i, (step, timelines) in enumerate(timeline_groups):
        timeline_body += add(figs.timeline(step, timelines), f"fig-timeline-{i}")
    units_body = add(figs.fsdp_units(report), "fig-fsdp-units")
    memory_body: list[str] = []
    for i, mem in enumerate(sorted(report.memory, key=lambda m: m.rank)[: figs.MAX_MEMORY_RANKS]):
        memory_body += add(figs.memory(mem), f"fig-memory-{i}")
    if len(report.memory) > figs.MAX_MEMORY_RANKS:
        figures.notes.append(
            f"Memory: the first {figs.MAX_MEMORY_RANKS} of {len(report.memory)} ranks are shown."
        )
    memory_body += parts.memory_breakdowns(report)
    return [
        _section("steps", "Steps", steps_body, "No steps to chart."),
        _section("timeline", "Timeline", timeline_body, "The report holds no step timeline."),
        _section("fsdp", "FSDP units", units_body, "No FSDP units were found in the traces."),
        _section("memory", "Memory", memory_body, "The run has no memory timeline."),
    ]


def _nav(report: Report) -> str:
    """The links to the sections."""
    return "".join(
        f'<a href="#{a}">{t}</a>'
        for a, t in (
            ("summary", "Summary"),
            ("findings", "Findings"),
            *([("large-run", "Large run")] if len(report.ranks) >= LARGE_RUN_RANKS else []),
            ("steps", "Steps"),
            ("timeline", "Timeline"),
            ("fsdp", "FSDP units"),
            ("memory", "Memory"),
            ("collectives", "Collectives"),
            ("run", "Run"),
        )
    )


def _subtitle(report: Report) -> str:
    subtitle = f"{len(report.ranks)} rank(s), {len(report.findings)} finding(s)"
    if report.inputs:
        subtitle += f" — from {report.inputs[0]}" + (
            f" and {len(report.inputs) - 1} more" if len(report.inputs) > 1 else ""
        )
    return subtitle


def render_html(report: Report) -> str:
    """The complete page as a string (see the module docstring)."""
    figures = _Figures()
    sections = [
        parts.summary(report),
        parts.findings(report),
        *_chart_sections(report, figures),
        parts.collectives(report),
        parts.captures(report),
        parts.run_facts(report),
    ]
    sections = [s for s in sections if s]
    if len(report.ranks) >= LARGE_RUN_RANKS:  # large runs: a summarizing section (issue 16.4)
        sections.insert(2, large_run_section(report))
    if figures.notes:
        sections.insert(
            1,
            '<section id="notes"><h2>Notes</h2><p>Parts of this report are aggregated or truncated to keep the page responsive:</p>'
            '<ul class="notes">'
            + "".join(f"<li>{e(n)}</li>" for n in figures.notes)
            + "</ul></section>",
        )
    return page("zdiag report", _subtitle(report), "".join(sections), figures, nav=_nav(report))


def page(
    title: str,
    subtitle: str,
    main: str,
    figures: _Figures,
    *,
    nav: str | None = None,
    css: str = CSS,
) -> str:
    """A complete zdiag page: its head and style, a header with `title` and the escaped
    `subtitle`, the `nav` links (already HTML), `main` (already HTML), and plotly.js (inlined
    once, packed) when `figures` drew any."""
    script = (
        f'<script id="zdiag-plotly-gz" type="application/gzip;base64">{packed_plotlyjs()}</script>'
        f"<script>{PLOTLY_LOADER}</script>"
        if figures.count
        else ""
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{e(title)}</title>"
        f"<style>{css}</style></head><body>"
        f"<header><h1>{e(title)}</h1><p>{e(subtitle)}</p></header>"
        + (f"<nav>{nav}</nav>" if nav is not None else "")
        + f"<main>{main}</main>{script}</body></html>"
    )


class HtmlRenderer(Renderer):
    """The self-contained interactive HTML page."""

    name = "html"

    def render(self, report: Report, destination: Destination) -> Rendered:
        """The page as UTF-8."""
        return Rendered.one(destination, render_html(report).encode("utf-8"))
