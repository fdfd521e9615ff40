"""A run that ran out of memory before the profiler wrote a trace is still diagnosed."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import REPO_ROOT
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.cli import main


def _oom_run_without_traces(tmp_path: Path) -> Path:
    run = tmp_path / "oom-run"
    shutil.copytree(REPO_ROOT / "sample_traces" / "activation-oom", run)
    for trace in (run / "traces").iterdir():
        trace.unlink()
    return run


def test_oom_records_alone_give_the_activation_oom_finding(tmp_path: Path) -> None:
    report = analyze_paths([_oom_run_without_traces(tmp_path)])
    assert report.ranks == []
    assert "activation-oom" in {f.id for f in report.findings}
    assert any("no trace was written" in w for w in report.warnings)


def test_a_run_dir_without_traces_or_oom_records_is_an_input_error(tmp_path: Path) -> None:
    run = _oom_run_without_traces(tmp_path)
    for record in (run / "memory").glob("*.oom.json"):
        record.unlink()
    assert main(["analyze", str(run)]) == 2
