"""In-job summaries through a real `zdiag run` (2 gloo ranks): written beside each trace by the
background process, then used by `zdiag analyze` with the same Report as decoding the traces."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.engine.summary_pipeline import (
    SummaryOptions,
    analyze_paths,
    analyze_via_summaries,
)
from zdiag.analyzers.report import encode_report
from zdiag.collectors.rundir import summary_path_for
from zdiag.collectors.summary_job import summary_command

pytestmark = pytest.mark.dist


def test_summary_command_is_niced_and_names_the_module(tmp_path: Path) -> None:
    cmd = summary_command(tmp_path / "traces" / "rank-3.json.gz")
    assert cmd[-3:] == [
        "zdiag.analyzers.engine.summarize_trace",
        str(tmp_path / "traces" / "rank-3.json.gz"),
        str(tmp_path / "traces" / "rank-3.summary.zds"),
    ]
    nice = shutil.which("nice")
    assert cmd[:5] == ([nice, "-n", "19"] if nice else []) + [sys.executable, "-m"]


def test_zdiag_run_writes_summaries_that_analyze_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZDIAG_INJOB_SUMMARY", "1")
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, "-m", "zdiag", "run", "--nproc-per-node", "2", "--out", str(run),
         "--harness", "--steps", "6", "--layers", "2", "--dim", "64", "--device", "cpu"],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    summaries = [summary_path_for(run / "traces" / f"rank-{r}.json.gz") for r in (0, 1)]
    deadline = time.monotonic() + 60
    while not all(s.exists() for s in summaries) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(s.exists() for s in summaries)
    got = analyze_via_summaries([run], SummaryOptions(write_cache=False))
    assert (got.sources.in_job, got.sources.mapped) == (2, 0)
    assert encode_report(got.report) == encode_report(analyze_paths([run]))
