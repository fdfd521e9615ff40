"""Detectors that know the mesh, on a real FSDP2 + TP job (issue 26, item 4).

examples/mesh/fsdp_tp_root_only.py shards only its root over "dp" of a (2, 2) ("dp", "tp") mesh,
beside tensor parallelism over "tp": 4 gloo ranks under `zdiag run`. Tensor-parallel collectives
are not FSDP gathers: every collective the FSDP ledger holds ran in the rank's dp group (by the
gloo threads the collectors recorded), whole-model-wrap counts the dp gathers only, and
comm-bound judges the FSDP collectives alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.rank.rank_analysis import RankContext, analyze_rank

pytestmark = [pytest.mark.slow, pytest.mark.dist]

SCRIPT = REPO_ROOT / "examples" / "mesh" / "fsdp_tp_root_only.py"


def test_tp_collectives_never_count_as_fsdp_traffic(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "zdiag", "run", "--nproc-per-node", "4", "--out", str(out)]
    proc = subprocess.run(
        [*cmd, str(SCRIPT)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    tp_calls = 0
    for rank in range(4):
        part = json.loads((out / "manifest.d" / f"rank-{rank}.json").read_text())
        threads = {int(t): g for g, tids in part["group_threads"].items() for t in tids}
        ra = analyze_rank(
            load_rank_trace(out / "traces" / f"rank-{rank}.json.gz"),
            RankContext(thread_groups=threads),
        )
        members = {g.name: tuple(g.ranks or ()) for g in ra.facts.process_groups}
        desc = {g.name: g.description for g in ra.facts.process_groups}
        dp = next(m for g, m in members.items() if desc[g] == "mesh_dp")
        cols = ra.collectives
        group_at = {float(s): g for s, g in zip(cols.start_us, cols.process_group, strict=True)}
        tp_calls += sum(desc.get(g) == "mesh_tp" for g in cols.process_group)
        assert ra.ledger.records
        for r in ra.ledger.records:  # every FSDP record ran in this rank's dp group
            assert members[group_at[r.start_us]] == dp, (rank, r)
    assert tp_calls > 0  # the TP all-reduces are there, in the trace, beside them

    report = analyze_paths([out])
    findings = {f.id: f for f in report.findings}
    wrap = findings["whole-model-wrap"]
    assert wrap.evidence["gathers_per_step"] == 1.0  # the root's one dp gather, no TP call
    if "comm-bound" in findings:  # load-dependent on a shared CPU; FSDP's comm only if it fires
        assert findings["comm-bound"].evidence["tensor_parallel_left_out"] is True
