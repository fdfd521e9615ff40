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


def _crashed_before_a_trace(tmp_path: Path, error: str | None) -> Path:
    """A run directory whose ranks ended before the profiler wrote a trace: rank 0 raised
    `error` (None: exited 0) in its setup, rank 1 was torn down by torchrun."""
    import json

    run = tmp_path / "crash-run"
    run.mkdir()
    ranks = [
        {"rank": 0, "exit_code": 1 if error else 0, "error": error, "steps": 0,
         "error_source": {"file": "/u/train.py", "line": 24, "function": "main",
                          "code": "model = FSDP(model)"} if error else None},
        {"rank": 1, "exit_code": None if error else 0, "steps": 0,
         **({"ended_by": "SIGTERM"} if error else {})},
    ]  # fmt: skip
    manifest = {"schema": "zdiag.manifest/1", "world_size": 2, "ranks": ranks}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_a_script_that_raises_before_its_first_trace_is_diagnosed_from_the_manifest(
    tmp_path: Path,
) -> None:
    """A script that fails in its setup (no accelerator for FSDP1, a bad import) leaves no
    trace: the manifest's record of what each rank raised is the diagnosis."""
    run = _crashed_before_a_trace(tmp_path, "RuntimeError: FSDP needs a non-CPU accelerator")
    report = analyze_paths([run])
    (crash,) = [f for f in report.findings if f.id == "crash"]
    assert crash.ranks == [0] and "train.py:24 `model = FSDP(model)`" in crash.title
    # it finished no step: set-up or its first step, which the manifest does not tell apart
    assert "RuntimeError before its first step ended" in crash.title, crash.title
    assert any("no rank finished a step before the run failed" in w for w in report.warnings)
    assert main(["analyze", str(run)]) == 0


def test_a_run_that_ended_well_without_traces_is_still_an_input_error(tmp_path: Path) -> None:
    assert main(["analyze", str(_crashed_before_a_trace(tmp_path, None))]) == 2
