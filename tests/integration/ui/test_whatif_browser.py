"""The what-if page in real headless Chromium: its timeline figure renders and unit names from
the traces stay text. Skipped (with the reason) when Chromium is absent."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import msgspec
import pytest

from conftest import REPO_ROOT
from support.browser import dump_dom
from zdiag.analyzers.engine.summary_pipeline import SummaryOptions, analyze_via_summaries
from zdiag.analyzers.whatif.run_whatif import Change, run_whatif
from zdiag.render._sample import HOSTILE
from zdiag.render.whatif_html import render_whatif_html

pytestmark = pytest.mark.browser


def test_the_replayed_timeline_renders_and_names_stay_text(tmp_path: Path) -> None:
    run = analyze_via_summaries(
        [REPO_ROOT / "sample_traces" / "tiny-layer-wrap"],
        SummaryOptions(use_stored=False, write_cache=False),
    )
    result = run_whatif(run.summaries, Change(prefetch=2))
    tl = result.timeline
    assert tl is not None
    hostile = [msgspec.structs.replace(op, unit=HOSTILE) for op in tl.changed_model.ops]
    tl = dataclasses.replace(
        tl, changed_model=msgspec.structs.replace(tl.changed_model, ops=hostile)
    )
    page = tmp_path / "whatif.html"
    page.write_text(render_whatif_html(dataclasses.replace(result, timeline=tl)))
    source = page.read_text()
    dom = dump_dom(page, tmp_path / "profile")
    assert 'id="fig-whatif-timeline"' in source
    assert dom.count("js-plotly-plot") >= 1 and dom.count('class="main-svg"') >= 1
    assert dom.count('class="trace bars"') >= 2  # as measured, and with the change
    title = re.search(r"<title>(.*?)</title>", dom, re.S)
    assert title is not None and title.group(1) == "zdiag what-if"
    assert dom.count("<script") == source.count("<script")
