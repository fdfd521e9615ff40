"""`zdiag analyze` end to end: outputs, options, and every bad-input case (one line, exit 2)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.traces import TraceBuilder
from zdiag.analyzers.engine import summary_pipeline
from zdiag.analyzers.engine.summary_pipeline import SummaryRun
from zdiag.analyzers.report import Finding, Report, decode_report
from zdiag.cli import main


def _trace(path: Path, rank: int = 0) -> Path:
    b = TraceBuilder(rank=rank)
    for k in range(3):
        b.step(k, k * 1000, 1000)
        b.kernel("gemm", k * 1000 + 50, 500, launch_at=k * 1000 + 10)
        b.kernel(
            "ncclDevKernel_AllGather_RING_LL",
            k * 1000 + 400,
            300,
            stream=20,
            launch_at=k * 1000 + 20,
        )
    return b.write(path)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["analyze", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- good input ----------------------------------------------------------------------------


def test_text_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run([str(_trace(tmp_path / "rank-0.json"))], capsys)
    assert code == 0 and err == ""
    assert "Rank 0 (cuda)" in out
    assert "3 step(s)" in out and "verdict" in out
    assert "all_gather" in out  # collectives table
    assert "Findings" in out


def test_json_output_follows_the_contract(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _trace(tmp_path / "rank-0.json.gz", 0)
    _trace(tmp_path / "rank-1.json.gz", 1)
    code, out, _ = _run([str(tmp_path), "--json", "--quiet"], capsys)
    assert code == 0
    raw = json.loads(out)
    assert raw["schema"] == "zdiag.report/1"
    assert [r["rank"] for r in raw["ranks"]] == [0, 1]
    step = raw["ranks"][0]["steps"][0]
    for key in (
        "step",
        "duration_ms",
        "compute_ms",
        "comm_ms",
        "overlapped_ms",
        "exposed_comm_ms",
        "idle_ms",
        "verdict",
    ):
        assert key in step
    assert isinstance(raw["findings"], list)
    report = decode_report(out)
    assert report.ranks[1].steps[2].step == 2


def test_rank_filter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _trace(tmp_path / "rank-0.json", 0)
    _trace(tmp_path / "rank-1.json", 1)
    code, out, _ = _run([str(tmp_path), "--json", "--rank", "1"], capsys)
    assert code == 0 and [r["rank"] for r in json.loads(out)["ranks"]] == [1]
    code, _, err = _run([str(tmp_path), "--rank", "7"], capsys)
    assert code == 2 and "rank(s) 7 not found" in err and len(err.strip().splitlines()) == 1


def test_output_file_is_written_only_on_success(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "report.json"
    code, out, _ = _run([str(_trace(tmp_path / "t.json")), "--json", "-o", str(out_file)], capsys)
    assert code == 0 and out == ""
    assert decode_report(out_file.read_bytes()).ranks
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    out2 = tmp_path / "never.json"
    code, _, _ = _run([str(bad), "--json", "-o", str(out2)], capsys)
    assert code == 2
    assert not out2.exists()
    assert not list(tmp_path.glob(".never.json*"))


def test_fail_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _trace(tmp_path / "t.json")
    real = summary_pipeline.analyze_via_summaries

    def with_finding(paths: list[Path], *a: object, **kw: object) -> SummaryRun:
        run = real(paths, *a, **kw)  # type: ignore[arg-type]
        run.report.findings.append(Finding(id="missing-overlap", severity="warning", title="t"))
        return run

    monkeypatch.setattr(summary_pipeline, "analyze_via_summaries", with_finding)
    assert _run([str(path), "--quiet", "--fail-on", "warning"], capsys)[0] == 1
    assert _run([str(path), "--quiet", "--fail-on", "critical"], capsys)[0] == 0
    assert _run([str(path), "--quiet"], capsys)[0] == 0


def test_thin_traces_are_analyzed_with_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    b = TraceBuilder(rank=None, gpu_name=None)
    b.cpu_op("aten::mm", 0, 100)
    code, out, _ = _run([str(b.write(tmp_path / "thin.json"))], capsys)
    assert code == 0
    assert "no step markers" in out
    assert "assumed rank 0" in out
    assert "no GPU events" in out


# --- bad input -----------------------------------------------------------------------------


def _bad_inputs(tmp: Path) -> dict[str, tuple[Path, str]]:
    full = json.dumps(
        TraceBuilder(rank=0).to_dict()
        | {
            "traceEvents": [
                {"ph": "X", "cat": "cpu_op", "name": f"op{i}", "ts": i, "dur": 1} for i in range(50)
            ]
        }
    ).encode()
    cases: dict[str, tuple[bytes | None, str, str]] = {
        "missing": (None, "missing.json", "no such file"),
        "empty": (b"", "empty.json", "empty"),
        "not_json": (b"hello world", "text.json", "not JSON"),
        "truncated_json": (full[: len(full) // 2], "trunc.json", "truncated"),
        "truncated_gzip": (gzip.compress(full)[:60], "trunc.json.gz", "gzip"),
        "wrong_structure": (b'{"hello": [1, 2]}', "other.json", "no 'traceEvents'"),
        "events_not_objects": (b'{"traceEvents": [1, 2]}', "nums.json", "not a Kineto trace"),
        "nan_ts": (
            b'{"traceEvents": [{"ph": "X", "name": "a", "ts": NaN, "dur": 1}]}',
            "nan.json",
            "NaN",
        ),
        "nan_string": (
            b'{"traceEvents": [{"ph": "X", "name": "a", "ts": "nan", "dur": 1}]}',
            "nan2.json",
            "NaN",
        ),
        "no_events": (
            b'{"traceEvents": [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1}]}',
            "noev.json",
            "no timed events",
        ),
        "text_dur": (
            b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": "x"}]}',
            "dur.json",
            "non-numeric",
        ),
    }
    out: dict[str, tuple[Path, str]] = {}
    for key, (data, name, expect) in cases.items():
        path = tmp / name
        if data is not None:
            path.write_bytes(data)
        out[key] = (path, expect)
    empty_dir = tmp / "empty_dir"
    empty_dir.mkdir()
    (empty_dir / "readme.txt").write_text("no traces here")
    out["empty_folder"] = (empty_dir, "no trace files")
    return out


BAD_CASES = [
    "missing",
    "empty",
    "not_json",
    "truncated_json",
    "truncated_gzip",
    "wrong_structure",
    "events_not_objects",
    "nan_ts",
    "nan_string",
    "no_events",
    "text_dur",
    "empty_folder",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_one_line_naming_the_file(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, expect = _bad_inputs(tmp_path)[case]
    html = tmp_path / "out.html"
    code, out, err = _run([str(path), "--html", str(html)], capsys)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("zdiag analyze: error: ")
    assert str(path) in lines[0]
    assert expect.lower() in lines[0].lower()
    assert "Traceback" not in err
    assert not html.exists()


@pytest.mark.slow  # starts a program
def test_bad_input_in_a_real_process(tmp_path: Path) -> None:
    bad = tmp_path / "t.json.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00garbage")
    proc = subprocess.run(
        [sys.executable, "-m", "zdiag", "analyze", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr and str(bad) in proc.stderr


def test_no_path_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run([], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "no input given" in err


def test_unwritable_output_fails_before_the_analysis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _trace(tmp_path / "t.json")
    code, out, err = _run([str(path), "--html", str(tmp_path / "nope" / "r.html")], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--html" in err and "does not exist" in err


def test_progress_bar_draws_and_clears() -> None:
    import io

    from zdiag.commands.analyze import _ProgressBar

    stream = io.StringIO()
    bar = _ProgressBar(stream)
    bar(0, 2, "reading rank-0.json.gz")
    bar(1, 2, "rank-0.json.gz")
    bar.close()
    text = stream.getvalue()
    assert " 50% " in text and "rank-0.json.gz" in text
    assert text.endswith("\r")  # the line is wiped, leaving stderr clean


def test_text_for_many_ranks_and_for_an_empty_report() -> None:
    from zdiag.analyzers.report import (
        CollectiveKindStats,
        RankReport,
        StepBreakdown,
        StragglerStat,
    )
    from zdiag.render.text import MAX_DETAILED_RANKS, render_text

    def step(ms: float) -> StepBreakdown:
        return StepBreakdown(
            step=1,
            duration_ms=ms,
            compute_ms=ms / 2,
            comm_ms=0.0,
            overlapped_ms=0.0,
            exposed_comm_ms=0.0,
            idle_ms=ms / 2,
            verdict="host-bound",
        )

    ranks = [RankReport(rank=r, device="cuda", steps=[step(100.0 + r)]) for r in range(12)]
    for r in ranks:
        r.warnings.append("no step markers")
    collectives = [CollectiveKindStats(rank=r, kind="all_reduce", count=1) for r in range(12)]
    stragglers = [
        StragglerStat(
            rank=r, matched_collectives=5, last_arrivals=1, wait_caused_ms=r, mean_skew_ms=0.1
        )
        for r in range(12)
    ]
    text = render_text(Report(ranks=ranks, collectives=collectives, stragglers=stragglers))
    # bounded tables: collective totals for the detailed ranks, the 8 worst stragglers
    assert text.count(" all_reduce ") == MAX_DETAILED_RANKS
    assert f"the other {12 - MAX_DETAILED_RANKS} in --json" in text
    assert "4 ranks causing less wait" in text
    assert "Ranks" in text and f"Per-step detail for {MAX_DETAILED_RANKS} of 12 ranks" in text
    assert text.count("\nRank ") == MAX_DETAILED_RANKS
    assert "Rank 0 (cuda)" in text and "Rank 11 (cuda)" in text and "Rank 1 (cuda)" not in text
    assert "ranks 0–11: no step markers" in text
    empty = render_text(Report())
    assert "0 rank(s)" in empty and "Findings (0)" in empty


def test_text_labels_straggler_thresholds_apart_and_names_the_root_unit() -> None:
    from zdiag.analyzers.detectors import STRAGGLER_RULE
    from zdiag.analyzers.rank.verdict import thresholds as verdict_thresholds
    from zdiag.render.text import render_text

    report = Report(
        thresholds={**verdict_thresholds(), **STRAGGLER_RULE.report_thresholds()},
        findings=[
            Finding(
                id="whole-model-wrap",
                severity="warning",
                title="t",
                units=[""],
                evidence={"offsets": {}, "per_rank": {"1": {"chance_p": 0.0012, "wait_ms": 15.93}}},
            )
        ],
    )
    assert "Verdict thresholds: " not in render_text(report)  # the full list: --verbose only
    lines = render_text(report, verbose=True).splitlines()
    verdict = next(x for x in lines if x.startswith("Verdict thresholds: "))
    straggler = next(x for x in lines if x.startswith("Straggler thresholds: "))
    assert "host_bound_idle_fraction=" in verdict and "straggler" not in verdict
    assert "skew_noise_us=50" in straggler and "host_bound" not in straggler
    assert any(x.endswith("(unit (root))") for x in lines)
    evidence = lines[lines.index("    evidence:") + 1]
    assert evidence == "      per rank  {1: {chance_p: 0.0012, wait_ms: 15.9}}"


@pytest.mark.parametrize("width", [60, 80, 200])
def test_progress_line_stays_within_80_columns(width: int) -> None:
    import io

    from zdiag.commands.analyze import _ProgressBar

    stream = io.StringIO()
    bar = _ProgressBar(stream, width=width)
    bar(3, 1000, "reading " + "very-long-directory-name/" * 8 + "rank-3.json.gz")
    lines = [x for x in stream.getvalue().split("\r") if x]
    assert lines and all(len(x) < min(width, 80) for x in lines)
    assert lines[0].rstrip().endswith("s") and "rank-3.json.gz" in lines[0]
