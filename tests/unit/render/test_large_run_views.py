"""Views of 1000+ ranks (issue 16.4): summarized text and HTML, bounded in size."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from support.rendering import render_file
from zdiag.analyzers.report import ProcessGroupStats, Report
from zdiag.render._sample import sample_report
from zdiag.render.html import render_html
from zdiag.render.stats import HEATMAP_GROUPS, LARGE_RUN_RANKS, large_run_stats
from zdiag.render.text import render_text
from zdiag.render.text_large_run import MAX_LINES

SLOW_HOST = "node17"  # ranks 136-143: their collectives take 3x longer
HUNG_RANK = 1000
TP_GROUPS = 128  # 8-rank tensor-parallel groups, one per host; the one of ranks 136-143 waits


def _big_report(ranks: int = 1024, steps: int = 20) -> Report:
    """sample_report's run (rank 3 computes 25 ms more per step) at `ranks` ranks, with the
    ranks of one host communicating 3x longer."""
    report = sample_report(ranks=ranks, steps=steps, timeline_spans=10)
    ranks_out = []
    for r in report.ranks:
        if r.rank == HUNG_RANK:  # its trace stops after 12 of the 20 steps
            r = msgspec.structs.replace(r, steps=r.steps[:12])
        if r.host == SLOW_HOST:
            r = msgspec.structs.replace(
                r, steps=[msgspec.structs.replace(s, comm_ms=s.comm_ms * 3) for s in r.steps]
            )
        ranks_out.append(r)
    return msgspec.structs.replace(report, ranks=ranks_out, process_groups=_groups(ranks))


def _groups(ranks: int) -> list[ProcessGroupStats]:
    """The world group and one tensor-parallel group per host (the slow host's makes its
    ranks wait for rank 139), as the reduce reports them: most communication first."""
    tp = [
        ProcessGroupStats(
            name=str(1 + g),
            description=f"tp{g}",
            declared_size=8,
            ranks=list(range(8 * g, 8 * g + 8)),
            kinds=["all_gather", "reduce_scatter"],
            calls_per_rank=240.0,
            comm_ms_per_step=60.0 if g == 17 else 20.0,
            matched_collectives=240,
            median_skew_ms=4.0 if g == 17 else 0.02,
            max_skew_ms=9.0 if g == 17 else 0.05,
            wait_caused_ms=6_700.0 if g == 17 else 0.0,
            top_waiter=139 if g == 17 else None,
            top_waiter_ms=6_700.0 if g == 17 else 0.0,
        )
        for g in range(ranks // 8)
    ]
    world = ProcessGroupStats(
        name="0",
        description="default_pg",
        declared_size=ranks,
        ranks=list(range(ranks)),
        kinds=["all_reduce"],
        calls_per_rank=20.0,
        comm_ms_per_step=30.0,
        matched_collectives=20,
        median_skew_ms=0.4,
        max_skew_ms=1.5,
        wait_caused_ms=120.0,
        top_waiter=3,
        top_waiter_ms=80.0,
    )
    return sorted([world, *tp], key=lambda g: -g.comm_ms_per_step)


@pytest.fixture(scope="module")
def big() -> Report:
    return _big_report()


def test_large_run_stats_find_the_slow_rank_and_host(big: Report) -> None:
    st = large_run_stats(big)
    assert st.rank_count == 1024 and len(st.steps) == 20
    assert st.slowest_ranks[0].rank == 3
    assert st.slowest_ranks[0].robust_z is not None and st.slowest_ranks[0].robust_z > 5
    assert st.nodes[0].host == SLOW_HOST and st.node_outliers[0].label == SLOW_HOST
    assert len(st.nodes) == 128
    assert len(st.heatmap) == HEATMAP_GROUPS
    assert (st.heatmap[0].first_rank, st.heatmap[-1].last_rank) == (0, 1023)
    assert st.step_ms is not None and st.step_ms.max > st.step_ms.p99 >= st.step_ms.p50
    assert st.usual_step_count == 20 and st.short_ranks == ((HUNG_RANK, 12),)


def test_text_of_1024_ranks_is_short_and_names_the_outliers(big: Report) -> None:
    text = render_text(big)
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES
    assert "Large run: 1024 ranks on 128 host(s)" in text
    slowest = lines.index(next(x for x in lines if x.startswith("Slowest ranks")))
    assert lines[slowest + 3].split()[:2] == ["rank", "3"]
    hosts = lines.index(next(x for x in lines if x.startswith("Hosts by communication")))
    assert lines[hosts + 3].split()[0] == SLOW_HOST
    # the heatmap shades the group holding rank 3 (its step time is above the run's median)
    heat = [x for x in lines if re.match(r"\s+0-63\s+\|", x)]
    assert heat and set(heat[0].split("|")[1]) - {" "}
    assert not any(x.startswith("Rank ") for x in lines)  # no per-rank block
    assert (
        f"fewer steps than the usual 20 (trace ended early: hung, crashed or killed?): rank {HUNG_RANK} (12)"
        in text
    )
    # process groups: the slow host's tensor-parallel group first, waiting for rank 139; the
    # world group next; the other 127 groups counted, not listed
    groups = lines.index(next(x for x in lines if x.startswith("Process groups")))
    assert lines[groups].startswith(f"Process groups ({TP_GROUPS + 1}; the top 8)")
    assert lines[groups + 3].split() == [
        "18",
        "(tp17)",
        "8/8",
        "136–143",
        "60.0",
        "4.00",
        "6,700",
        "139",
    ]
    assert lines[groups + 4].split()[:3] == ["0", "(default_pg)", "1024/1024"]
    assert len([x for x in lines[groups + 3 :] if re.match(r"\s+\d+ \(tp", x)]) == 7
    assert max(len(x) for x in lines[groups : groups + 11]) <= 100


def test_runs_below_the_threshold_keep_the_per_rank_layout() -> None:
    small = sample_report(ranks=LARGE_RUN_RANKS - 1, steps=3)
    text = render_text(small)
    assert "Large run" not in text
    assert "\nRanks\n" in text


def test_html_of_1024_ranks_is_bounded_and_summarized(big: Report) -> None:
    page = render_html(big)
    assert len(page.encode()) <= 10 * 1024 * 1024
    assert 'id="large-run"' in page and SLOW_HOST in page
    assert f"<h3>Process groups ({TP_GROUPS + 1})</h3>" in page
    assert "18 (tp17)" in page and "rank 139 (6,700 ms)" in page
    assert "65 more groups communicate less" in page  # 64 rows of 129
    assert 'href="#large-run"' in page
    assert 'id="large-run"' not in render_html(sample_report(ranks=8, steps=3))


@pytest.mark.browser
def test_html_of_1024_ranks_renders_in_chromium(big: Report, tmp_path: Path) -> None:
    from support.browser import dump_dom

    page = tmp_path / "big.html"
    render_file("html", big, page)
    source = page.read_text()
    dom = dump_dom(page, tmp_path / "profile")
    figures = re.findall(r'<div id="(fig-[a-z0-9-]+)" class="plotly-graph-div', source)
    assert len(figures) >= 4
    assert dom.count("js-plotly-plot") >= len(figures)
    assert dom.count('<g class="hm"') == 2  # both rank x step heatmaps painted
    assert 'id="large-run"' in dom
