"""The HTML report in real headless Chromium: its figures render and trace names cannot inject.

Skipped (with the reason) when Chromium is absent; install it with `apt-get install -y chromium`.
The page is loaded from a file with networking disabled, and the DOM after scripts ran is dumped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.browser import dump_dom
from support.rendering import render_file
from zdiag.render._sample import HOSTILE, sample_report

pytestmark = pytest.mark.browser


def _title(dom: str) -> str:
    found = re.search(r"<title>(.*?)</title>", dom, re.S)
    return found.group(1) if found else ""


def test_the_detector_sees_an_injection(tmp_path: Path) -> None:
    """Control: the same payload, unescaped, does change the title (so the next test can tell)."""
    page = tmp_path / "unsafe.html"
    page.write_text(f"<!DOCTYPE html><html><head><title>zdiag report</title></head><body>{HOSTILE}")
    dom = dump_dom(page, tmp_path / "profile")
    assert _title(dom) == "pwned"


def test_figures_render_and_hostile_names_stay_text(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    render_file("html", sample_report(hostile=True), page)
    source = page.read_text()
    dom = dump_dom(page, tmp_path / "profile")

    # every figure was drawn by plotly: its div became a plot with SVG inside
    figures = re.findall(r'<div id="(fig-[a-z0-9-]+)" class="plotly-graph-div', source)
    assert len(figures) >= 7
    assert dom.count("js-plotly-plot") >= len(figures)
    assert dom.count('class="main-svg"') >= len(figures)
    assert dom.count('<g class="hm"') == 2  # both heatmaps were painted (as images)
    assert dom.count('class="trace bars"') >= 10  # breakdown, timeline and unit bars

    # nothing from the names ran or became an element
    assert _title(dom) == "zdiag report"
    assert not re.search(r"<img[^>]*src=\"?x", dom)
    assert dom.count("<script") == source.count("<script")
    assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom  # shown as text


PROBE = """<pre id="probe"></pre><script>
setTimeout(function () {
  var out = {};
  document.querySelectorAll('[id^="fig-timeline-"]').forEach(function (gd) {
    out[gd.id] = {
      range: gd._fullLayout.xaxis.range,
      bars: gd.data.map(function (t) { return [t.y, t.base, t.x]; })
    };
  });
  document.getElementById("probe").textContent = JSON.stringify(out);
}, 2500);
</script>"""


def test_timeline_draws_every_lane_of_every_rank_across_the_whole_step(tmp_path: Path) -> None:
    import json

    report = sample_report(ranks=8, steps=4, timeline_spans=1200)  # more spans than drawn
    page = tmp_path / "report.html"
    render_file("html", report, page)
    page.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    dom = dump_dom(page, tmp_path / "profile")
    probe = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1))
    assert probe, "no timeline figure was drawn"
    drawn = next(iter(probe.values()))
    ends: dict[str, float] = {}
    starts: dict[str, float] = {}
    for ys, bases, widths in drawn["bars"]:
        for y, base, width in zip(ys, bases, widths, strict=True):
            ends[y] = max(ends.get(y, 0.0), base + width)
            starts[y] = min(starts.get(y, float("inf")), base)
    for t in report.timelines[:8]:
        for lane in {s.lane for s in t.spans}:
            spans = [s for s in t.spans if s.lane == lane]
            row = f"rank {t.rank} · {lane}"
            assert row in ends, f"{row} not drawn"
            assert starts[row] <= min(s.start_ms for s in spans) + 1e-6
            assert ends[row] >= max(s.start_ms + s.dur_ms for s in spans) - 1e-6
    step_end = max(s.start_ms + s.dur_ms for t in report.timelines[:8] for s in t.spans)
    assert drawn["range"][1] >= step_end  # the axis shows the whole step
