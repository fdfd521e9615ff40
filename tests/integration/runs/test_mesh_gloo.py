"""A real 4-rank HSDP job on gloo (tests/support/hsdp_gloo.py), recorded and analyzed end to end:
the report names every process group with its true members, and matches nothing across groups
(gloo's calls name no group, so none is compared with another group's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.engine.summary_pipeline import analyze_paths

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def test_hsdp_on_four_gloo_ranks_names_its_groups_and_finds_no_straggler(tmp_path: Path) -> None:
    out = tmp_path / "run"
    script = REPO_ROOT / "tests" / "support" / "hsdp_gloo.py"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zdiag",
            "run",
            "--nproc-per-node",
            "4",
            "--out",
            str(out),
            str(script),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = analyze_paths([out])
    declared = {(g.name, g.description, tuple(g.ranks)) for g in report.process_groups if g.name}
    assert {(d, r) for _, d, r in declared} == {
        ("default_pg", (0, 1, 2, 3)),
        ("mesh_replicate", (0, 2)),
        ("mesh_replicate", (1, 3)),
        ("mesh_shard", (0, 1)),
        ("mesh_shard", (2, 3)),
    }
    assert not [f for f in report.findings if f.id == "straggler"]
    assert all(s.wait_caused_ms == 0.0 for s in report.stragglers)
    assert any("name no process group" in w for w in report.warnings)
