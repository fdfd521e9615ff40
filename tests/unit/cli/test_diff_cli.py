"""`zdiag diff A B`: sides as saved reports or traces, the CI gates, refusals in one sentence,
outputs that never overwrite an input."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.report import Report, encode_report
from zdiag.cli import main
from zdiag.render._sample import sample_report

SAMPLES = REPO_ROOT / "sample_traces"


def _diff(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["diff", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _slower(report: Report, factor: float) -> Report:
    """The report with every step's compute (and so its duration) times `factor`."""
    ranks = []
    for r in report.ranks:
        steps = [
            msgspec.structs.replace(
                s,
                compute_ms=s.compute_ms * factor,
                duration_ms=s.duration_ms + s.compute_ms * (factor - 1),
            )
            for s in r.steps
        ]
        ranks.append(msgspec.structs.replace(r, steps=steps))
    return msgspec.structs.replace(report, ranks=ranks)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, Path]:
    base = sample_report(ranks=2, steps=6)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_bytes(encode_report(base))
    b.write_bytes(encode_report(_slower(base, 1.5)))
    return a, b


def test_a_run_against_itself_passes_the_gate(
    saved: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = saved
    code, out, err = _diff([str(a), str(a), "--fail-on-regression", "1"], capsys)
    assert code == 0, err
    assert out.splitlines()[0].startswith("no change")


def test_a_regression_fails_the_gate_with_the_attribution(
    saved: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = saved
    code, out, err = _diff([str(a), str(b), "--fail-on-regression", "5"], capsys)
    assert code == 1
    first = out.splitlines()[0]
    assert "of it compute" in first and first.startswith("+")
    assert err.startswith("zdiag diff: regression: median step time +") and first in err
    code, _, _ = _diff([str(b), str(a), "--fail-on-regression", "5"], capsys)
    assert code == 0  # faster is no regression


def test_json_is_the_versioned_diff(
    saved: tuple[Path, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    a, b = saved
    code, out, _ = _diff([str(a), str(b), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["schema"] == "zdiag.diff/1" and data["step"][0]["metric"] == "step time"
    page = tmp_path / "diff.html"
    code, _, err = _diff(
        [str(a), str(b), "--html", str(page), "-o", str(tmp_path / "d.txt")], capsys
    )
    assert code == 0, err
    assert page.read_text().startswith("<!DOCTYPE html>")
    assert (tmp_path / "d.txt").read_text().splitlines()[0].startswith("+")


def test_the_memory_gate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = sample_report(ranks=2, steps=6)
    assert base.memory, "the sample report records memory"
    bigger = msgspec.structs.replace(
        base,
        memory=[msgspec.structs.replace(m, peak_bytes=m.peak_bytes * 2) for m in base.memory],
    )
    a, b, none = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "none.json"
    a.write_bytes(encode_report(base))
    b.write_bytes(encode_report(bigger))
    none.write_bytes(encode_report(msgspec.structs.replace(base, memory=[], memory_breakdowns=[])))
    code, _, err = _diff([str(a), str(b), "--fail-on-memory", "10"], capsys)
    assert code == 1 and "peak memory +100.0% (limit 10%)" in err
    assert _diff([str(b), str(a), "--fail-on-memory", "10"], capsys)[0] == 0
    code, out, err = _diff([str(a), str(none), "--fail-on-memory", "5"], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--profile-memory" in err


def test_a_cpu_run_against_a_gpu_run_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _diff([str(SAMPLES / "none"), str(SAMPLES / "gpu" / "healthy-nccl")], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "different kinds of device" in err and "Traceback" not in err


def test_a_missing_side_is_one_sentence(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, saved: tuple[Path, Path]
) -> None:
    code, out, err = _diff([str(saved[0]), str(tmp_path / "nowhere")], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "does not exist" in err and "Traceback" not in err
    code, out, err = _diff([], capsys)
    assert code == 2 and "give two runs" in err


def test_a_bad_percentage_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["diff", "a", "b", "--fail-on-regression", "x"])
    assert exc.value.code == 2
    assert "not a percentage" in capsys.readouterr().err


def test_an_output_never_overwrites_an_input(
    saved: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = saved
    before = b.read_bytes()
    code, _, err = _diff([str(a), str(b), "--json", "-o", str(b)], capsys)
    assert code == 2 and "Traceback" not in err
    assert b.read_bytes() == before


def test_zdiag_cache_off_writes_no_cache_beside_the_traces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    run = tmp_path / "run"
    # a cache a developer's own `zdiag analyze` of the samples left there is not this run's
    shutil.copytree(SAMPLES / "none", run, ignore=shutil.ignore_patterns(".zdiag-cache"))
    assert _diff([str(run), str(run)], capsys)[0] == 0  # conftest sets ZDIAG_CACHE=off
    assert not any(p.name == ".zdiag-cache" for p in run.rglob("*"))
