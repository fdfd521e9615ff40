"""The view layer's shared parts: formatting, per-rank statistics, the step-column spec."""

from __future__ import annotations

import math

import pytest

from zdiag.analyzers.report import Finding, StepBreakdown
from zdiag.render._sample import empty_report, sample_report
from zdiag.render.columns import STEP_COLUMNS, step_cells, step_headers, step_values
from zdiag.render.format import (
    fmt_bytes,
    fmt_gain,
    fmt_ints,
    fmt_ms,
    fmt_number,
    fmt_ranks,
    fmt_share,
    fmt_value,
    known_bytes,
    unit_label,
)
from zdiag.render.stats import detailed_ranks, rank_stats, run_stats, worst_first


def _step(step: int, ms: float, verdict: str = "compute-bound", **kw: float) -> StepBreakdown:
    values = {
        "compute_ms": ms / 2,
        "comm_ms": ms / 4,
        "overlapped_ms": ms / 8,
        "exposed_comm_ms": ms / 8,
        "idle_ms": ms / 4,
        **kw,
    }
    return StepBreakdown(step=step, duration_ms=ms, verdict=verdict, **values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (1234.5, "1,234"),
        (123.4, "123"),
        (12.34, "12.3"),
        (4.567, "4.57"),
        (0.1234, "0.123"),
        (0.0, "0"),
        (-3.5, "-3.50"),
    ],
)
def test_numbers_keep_three_significant_digits(value: float, shown: str) -> None:
    assert fmt_number(value) == shown
    assert fmt_ms(value) == f"{shown} ms" and fmt_ms(value, unit=False) == shown


def test_unknown_values_never_print_as_zero() -> None:
    assert fmt_bytes(None) == "unknown"
    assert fmt_bytes(math.nan) == "unknown"
    assert fmt_bytes(0) == "0 B"  # a known zero stays a zero
    assert known_bytes(0, count=12) is None  # 12 collectives of unrecorded size
    assert known_bytes(0, count=0) == 0 and known_bytes(4096, count=2) == 4096
    assert fmt_bytes(known_bytes(0, 3)) == "unknown"
    assert fmt_ms(None) == "—"


def test_bytes_use_binary_units() -> None:
    assert [fmt_bytes(v) for v in (512, 1536, 3 * 2**20, 2**30 * 1.5, 2**40 * 5)] == [
        "512 B",
        "1.5 KiB",
        "3.0 MiB",
        "1.5 GiB",
        "5.0 TiB",
    ]


def test_shares_lists_and_values() -> None:
    assert fmt_share(1, 4) == "25%" and fmt_share(1, 0) == "-"
    assert fmt_ints([3, 0, 1, 2, 7, 9, 10]) == "0–3, 7, 9–10"
    assert fmt_ranks([5]) == "rank 5" and fmt_ranks([0, 1, 2, 4]) == "ranks 0–2, 4"
    assert unit_label("") == "(root)" and unit_label("layers.0") == "layers.0"
    assert fmt_value(0.004) == "0.004" and fmt_value(12.345) == "12.3"
    assert (
        fmt_value({"a": 1.0, "b": [1, 2, 3, 4, 5, 6, 7, 8]})
        == "{a: 1.00, b: [1, 2, 3, 4, 5, 6, …]}"
    )
    assert fmt_value(123456) == "123,456" and fmt_value(True) == "True"
    f = Finding(
        id="x", severity="info", title="t", expected_gain_ms=12.5, expected_gain_bytes=2**30
    )
    assert fmt_gain(f) == "12.5 ms per step and 1.0 GiB of peak memory"
    f.expected_gain_ms = -3.0  # a change that pays in memory and costs time (a finer wrap on CPU)
    assert fmt_gain(f) == "a cost of 3.00 ms per step and 1.0 GiB of peak memory"


def test_rank_stats_is_the_one_summary() -> None:
    report = sample_report(ranks=1, steps=1)
    rank = report.ranks[0]
    rank.steps = [_step(0, 100.0), _step(1, 300.0, "comm-bound"), _step(2, 200.0, "comm-bound")]
    stats = rank_stats(rank)
    assert (stats.step_count, stats.median_ms, stats.mean_ms, stats.min_ms, stats.max_ms) == (
        3,
        200.0,
        200.0,
        100.0,
        300.0,
    )
    assert stats.compute_share == pytest.approx(0.5) and stats.idle_share == pytest.approx(0.25)
    assert stats.overlapped_of_comm == pytest.approx(0.5)
    assert stats.dominant_verdict == "comm-bound" and stats.verdicts[0] == ("comm-bound", 2)
    rank.steps = []
    empty = rank_stats(rank)
    assert empty.median_ms is None and empty.compute_share is None and empty.dominant_verdict == ""


def test_run_stats_and_orderings() -> None:
    report = sample_report(ranks=12, steps=4)
    stats = run_stats(report)
    assert stats.rank_count == 12 and stats.row_count == 48
    assert sum(count for _, count in stats.verdicts) == 48
    assert run_stats(empty_report()).mean_step_ms is None
    chosen = detailed_ranks(report.ranks, 4)
    assert len(chosen) == 4 and chosen[0].rank == 0
    assert chosen == sorted(chosen, key=lambda r: r.rank)
    slowest = max(report.ranks[1:], key=lambda r: rank_stats(r).median_ms or 0.0)
    assert slowest in chosen
    findings = sorted(report.findings, key=worst_first)
    assert [f.severity for f in findings] == sorted(
        (f.severity for f in findings), key=lambda s: {"critical": 0, "warning": 1, "info": 2}[s]
    )


def test_every_step_field_that_is_a_number_is_a_column() -> None:
    """A new StepBreakdown field must be added to the spec (or deliberately left out here)."""
    not_columns = {"start_ms", "verdict_reason", "comm_by_dimension"}  # a list: own table
    assert {c.key for c in STEP_COLUMNS} == set(StepBreakdown.__struct_fields__) - not_columns
    step = _step(4, 12.345, host_launch_ms=1.5, kernel_count=7)
    assert step_headers()[:3] == ["step", "verdict", "dur ms"]
    cells = dict(zip(step_headers(), step_cells(step), strict=True))
    assert cells["dur ms"] == "12.3" and cells["launch"] == "1.50" and cells["kernels"] == "7"
    assert step_values(step)["host_launch_ms"] == 1.5
