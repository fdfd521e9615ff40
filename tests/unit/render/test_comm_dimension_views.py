"""Communication by mesh dimension in the text report, the HTML page and the TUI's step detail:
shown for a run whose ranks use several dimensions (a 4-rank HSDP job), absent otherwise."""

from __future__ import annotations

import pytest

from support.mesh_traces import hsdp_job
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.report import Report
from zdiag.render._details import step_detail
from zdiag.render._html_dimensions import comm_by_dimension
from zdiag.render._sample import sample_report
from zdiag.render.html import render_html
from zdiag.render.text import render_text


@pytest.fixture(scope="module")
def hsdp_report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    return analyze_paths([hsdp_job(tmp_path_factory.mktemp("mesh") / "run")])


def test_text_table_per_rank_and_dimension(hsdp_report: Report) -> None:
    text = render_text(hsdp_report, width=100)
    head = "Communication by mesh dimension (mean per step)"
    assert head in text
    table = text.split(head)[1].split("\n\n")[0].splitlines()
    rows = [line.split() for line in table if line.strip()[:1].isdigit()]
    assert ["0", "shard", "dp-shard", "2", "3", "5.40", "5.40"] in rows
    assert ["3", "replicate", "dp-replicate", "2", "1", "1.10", "1.10"] in rows
    assert len(rows) == 8  # 4 ranks x 2 dimensions


def test_html_figure_stacks_each_dimension_per_rank(hsdp_report: Report) -> None:
    fig, notes = comm_by_dimension(hsdp_report)
    assert fig is not None and notes == []
    bars = {bar.name: bar for bar in fig.data}
    assert set(bars) == {
        "shard (dp-shard, 2 ranks) exposed",
        "shard (dp-shard, 2 ranks) overlapped",
        "replicate (dp-replicate, 2 ranks) exposed",
        "replicate (dp-replicate, 2 ranks) overlapped",
    }
    exposed = bars["shard (dp-shard, 2 ranks) exposed"]
    assert list(exposed.x) == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert list(exposed.y) == pytest.approx([5.4, 5.4, 5.0, 5.0])
    assert 'id="fig-comm-by-dimension"' in render_html(hsdp_report)


def test_tui_step_detail_lists_the_dimensions(hsdp_report: Report) -> None:
    rank = hsdp_report.ranks[0]
    text = step_detail(hsdp_report, rank, rank.steps[0]).plain
    assert "Comm by dimension" in text
    assert "shard (dp-shard)" in text and "5.40 ms comm, 5.40 ms exposed, 3 calls" in text


def test_nothing_is_shown_without_a_split() -> None:
    report = sample_report()
    assert "mesh dimension" not in render_text(report)
    assert comm_by_dimension(report) == (None, [])
    rank = report.ranks[0]
    assert "Comm by dimension" not in step_detail(report, rank, rank.steps[0]).plain
