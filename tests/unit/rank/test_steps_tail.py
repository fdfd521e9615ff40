"""The step the profiler stopped inside at the end of a run (teardown) is not a training step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.rank.steps import StepWindows, drop_unfinished_tail

TINY = ["--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "2"]
TINY += ["--vocab", "128", "--device", "cpu"]


def _windows(numbers: list[int], source: str = "ProfilerStep") -> StepWindows:
    start = np.arange(len(numbers), dtype=np.float64) * 10
    return StepWindows(np.array(numbers, np.int64), start, start + 10, start, start + 10, source)


def test_only_a_trailing_unfinished_step_is_dropped() -> None:
    kept, dropped = drop_unfinished_tail(_windows([2, 3, 4, 5]), completed=5)
    assert kept.step.tolist() == [2, 3, 4] and dropped == [5]
    assert kept.end_us.tolist() == [10, 20, 30]
    # Nothing to drop, everything would go, or the steps were not found by ProfilerStep.
    assert drop_unfinished_tail(_windows([2, 3, 4]), completed=5)[1] == []
    assert drop_unfinished_tail(_windows([6, 7]), completed=5)[1] == []
    assert drop_unfinished_tail(_windows([2, 3, 4, 5], "optimizer step"), completed=5)[1] == []
    assert drop_unfinished_tail(_windows([2, 3]), completed=0)[1] == []


def _run(tmp_path: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "zdiag", "run", "--out", str(out), "--profile-steps", "1:1:9",
         "--harness", *TINY, *extra],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.slow  # starts a program
def test_a_run_ending_inside_the_window_reports_only_its_training_steps(tmp_path: Path) -> None:
    run = _run(tmp_path, "tail", "--steps", "4")
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["ranks"][0]["steps"] == 4
    # The trace itself holds ProfilerStep#4: the teardown after the last optimizer step.
    report = analyze_paths([run])
    assert [s.step for s in report.ranks[0].steps] == [2, 3]
    assert any("step 4 left out" in w for w in report.ranks[0].warnings)
    # Without the manifest (a bare trace), the analyzer cannot know: the step stays.
    bare = analyze_paths([run / "traces" / "rank-0.json.gz"])
    assert [s.step for s in bare.ranks[0].steps] == [2, 3, 4]
