"""A real 4-rank HSDP job on gloo (tests/support/hsdp_gloo.py), recorded and analyzed end to end:
gloo's calls name no process group, so each rank's manifest part says which threads each gloo
group started (`group_threads`), and the report matches every call within its true group: every
group named with its true members, no false skew on a healthy run, and a slow rank named inside
its shard group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.report import Report

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def _record(out: Path, *args: str) -> None:
    script = REPO_ROOT / "tests" / "support" / "hsdp_gloo.py"
    cmd = [sys.executable, "-m", "zdiag", "run", "--nproc-per-node", "4", "--out", str(out)]
    proc = subprocess.run(
        [*cmd, str(script), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _groups(report: Report) -> dict[tuple[str, tuple[int, ...]], int]:
    """(description, members) -> matched collectives, of every declared group instance."""
    return {(g.description, tuple(g.ranks)): g.matched_collectives for g in report.process_groups}


def test_hsdp_on_four_gloo_ranks_matches_calls_within_their_groups(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _record(out)
    for rank in range(4):
        part = json.loads((out / "manifest.d" / f"rank-{rank}.json").read_text())
        threads = part["group_threads"]  # the world group, its replicate and its shard group
        assert len(threads) == 3 and all(len(t) == 2 for t in threads.values()), threads
        assert not part["collector_errors"]
    report = analyze_paths([out])
    groups = _groups(report)
    assert set(groups) == {
        ("default_pg", (0, 1, 2, 3)),
        ("mesh_replicate", (0, 2)),
        ("mesh_replicate", (1, 3)),
        ("mesh_shard", (0, 1)),
        ("mesh_shard", (2, 3)),
    }
    assert groups["default_pg", (0, 1, 2, 3)] == 0
    assert all(n > 0 for key, n in groups.items() if key[0] != "default_pg"), groups
    assert not [w for w in report.warnings if "name no process group" in w]
    assert not [f for f in report.findings if f.id == "straggler"]
    # calls matched across groups showed 73 ms of skew here; within them, a few ms of noise
    assert all(g.max_skew_ms is None or g.max_skew_ms < 100 for g in report.process_groups)


def test_a_slow_gloo_rank_is_named_inside_its_shard_group(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _record(out, "--slow-rank", "1")
    report = analyze_paths([out])
    (finding,) = [f for f in report.findings if f.id == "straggler"]
    assert finding.ranks == [1]
    assert "[0, 1]" in finding.title and "[1, 3]" in finding.title  # its shard, replicate group
    shard = {tuple(g.ranks): g for g in report.process_groups if g.description == "mesh_shard"}
    assert shard[0, 1].top_waiter == 1
    assert shard[2, 3].wait_caused_ms < shard[0, 1].wait_caused_ms / 3
