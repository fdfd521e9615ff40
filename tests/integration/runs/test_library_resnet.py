"""ResNet-18 under FSDP1 without a wrap policy (issue 30): the whole-model-wrap code runs pasted.

tests/data/library_models/resnet18_fsdp1.py wraps torchvision's ResNet-18 whole in FSDP1 on
CPU/gloo (its own copy of the model when torchvision does not load against the pinned CPU torch:
the only torchvision wheels at hand are CUDA builds). The finding's saving comes from the captured
per-block sizes (the two largest blocks, layer4's, hold ~33.6 MB of the 46.8 MB model: ~11 MB
saved, not the 33.6 MB equal blocks would give), and its code carries the run's
`device_id=torch.device("cpu")`: pasted into the script (`--paste`) it trains on 2 gloo ranks with
one unit per BasicBlock, and recorded again it no longer raises whole-model-wrap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.slow  # real processes: about a minute (make integration)

TIMEOUT_S = 300
SCRIPT = REPO_ROOT / "tests" / "data" / "library_models" / "resnet18_fsdp1.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False
    )


def _record(out: Path, *script_args: str) -> tuple[str, list[dict[str, Any]]]:
    """Record the script on 2 gloo ranks; (its stdout, the findings of `zdiag analyze --json`)."""
    zdiag = (sys.executable, "-m", "zdiag")
    proc = _run(
        *zdiag, "run", "--nproc-per-node", "2", "--out", str(out), str(SCRIPT), *script_args
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = _run(*zdiag, "analyze", "--json", str(out))
    assert report.returncode == 0, report.stderr[-4000:]
    return proc.stdout, json.loads(report.stdout)["findings"]


def test_resnet18_fsdp1_whole_wrap_code_runs_pasted_on_cpu(tmp_path: Path) -> None:
    _, before = _record(tmp_path / "before")
    wrap = next(f for f in before if f["id"] == "whole-model-wrap")
    assert 10e6 < wrap["expected_gain_bytes"] < 12e6, wrap["gain_method"]
    assert "the 2 largest of 8 blocks" in wrap["gain_method"]
    code = wrap["code"]
    assert 'device_id=torch.device("cpu")' in code and "ModuleWrapPolicy({BasicBlock})" in code
    pasted = tmp_path / "wrap.py"
    pasted.write_text(code)
    stdout, after = _record(tmp_path / "after", "--paste", str(pasted))
    assert "rank 0 units 9 " in stdout  # the root and one unit per BasicBlock
    assert "whole-model-wrap" not in {f["id"] for f in after}
