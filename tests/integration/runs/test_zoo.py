"""The misconfiguration zoo: the harness under `zdiag run` (2 CPU ranks, gloo) with each
`--misconfig` and with `none`; each misconfiguration must be reported under its id (warning or
critical) and nothing else of the four; the healthy run must raise none of them.

Grid: two model shapes, one per `--zero` mode (shape A with ZeRO-3, shape B with ZeRO-2), every
scenario on both: 10 runs. Run with `pytest -m dist tests/integration/runs/test_zoo.py -n 2` (about 2-3 minutes on
2 cores). bench/zoo_precision.py runs a larger grid and prints precision and recall.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.misconfigs import MISCONFIGS, SCENARIOS

# Small enough for 2 shared CPU cores; different depth, width, vocabulary and ZeRO mode.
SHAPES: dict[str, list[str]] = {
    "A-zero3": ["--layers", "3", "--dim", "64", "--heads", "4", "--vocab", "512", "--zero", "3"],
    "B-zero2": ["--layers", "4", "--dim", "96", "--heads", "4", "--vocab", "256", "--zero", "2"],
}
SMALL_BATCH = ["--seq", "64", "--batch", "2"]
# activation-oom keeps its preset's long sequences (seq 1024, batch 8, no checkpointing); the
# emulated capacity is sized to these small models: their sharded state needs < 4 MiB, the
# preset's activations > 30 MiB.
OOM_BUDGET = ["--memory-budget-gb", "0.03"]


def zoo_command(out: Path, shape: list[str], misconfig: str, steps: int = 4) -> list[str]:
    """The `zdiag run` command for one zoo cell (the OOM cell profiles from step 1: it fails there)."""
    profile = "0:0:2" if misconfig == "activation-oom" else "1:1:2"
    extra = OOM_BUDGET if misconfig == "activation-oom" else SMALL_BATCH
    return [
        sys.executable, "-m", "zdiag", "run", "--nproc-per-node", "2", "--out", str(out),
        "--profile-steps", profile, "--harness", *shape, *extra,
        "--steps", str(steps), "--misconfig", misconfig,
    ]  # fmt: skip


def run_zoo_cell(out: Path, shape: list[str], misconfig: str) -> subprocess.CompletedProcess[str]:
    """Run one zoo cell; the run dir is `out`."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        zoo_command(out, shape, misconfig), capture_output=True, text=True, timeout=240, env=env
    )


@pytest.mark.dist
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("misconfig", SCENARIOS)
def test_zoo_cell(tmp_path: Path, shape: str, misconfig: str) -> None:
    out = tmp_path / "run"
    proc = run_zoo_cell(out, SHAPES[shape], misconfig)
    expect_oom = misconfig == "activation-oom"
    assert (proc.returncode != 0) == expect_oom, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = analyze_paths([out])
    found = {f.id: f for f in report.findings if f.id in MISCONFIGS}
    detector_errors = [w for w in report.warnings if w.startswith("detector ")]
    assert not detector_errors
    if misconfig == "none":
        assert not found, {k: f.title for k, f in found.items()}
        return
    assert misconfig in found, [f"{f.id}: {f.title}" for f in report.findings]
    finding = found[misconfig]
    assert finding.severity in ("warning", "critical")
    assert finding.code and finding.recommendation
    assert finding.expected_gain_ms is not None or finding.expected_gain_bytes is not None
    assert set(found) == {misconfig}, {k: f.title for k, f in found.items()}
