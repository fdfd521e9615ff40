"""What zdiag's collectors reported during a run reaches the analysis as rank warnings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import REPO_ROOT
from zdiag.analyzers.engine.pipeline import MAX_COLLECTOR_ERRORS_SHOWN
from zdiag.analyzers.engine.summary_pipeline import analyze_paths


def test_collector_errors_become_rank_warnings(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(REPO_ROOT / "sample_traces" / "none", run)
    manifest = json.loads((run / "manifest.json").read_text())
    errors = [f"memory timeline failed: problem {i}" for i in range(MAX_COLLECTOR_ERRORS_SHOWN + 2)]
    manifest["ranks"][1]["collector_errors"] = errors
    (run / "manifest.json").write_text(json.dumps(manifest))
    report = analyze_paths([run])
    by_rank = {r.rank: r.warnings for r in report.ranks}
    shown = [w for w in by_rank[1] if w.startswith("zdiag run: ")]
    assert shown == [f"zdiag run: {e}" for e in errors[:MAX_COLLECTOR_ERRORS_SHOWN]]
    assert not [w for w in by_rank[0] if w.startswith("zdiag run: ")]
