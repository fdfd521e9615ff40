"""Ranks that never communicate (issue 30): a script launched on 2 processes without a process
group is a `no-communication` finding, and its code, pasted after the model is built, makes the
processes train one model: recorded again, they exchange collectives and the finding is gone."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT
from support.processes import run as _run

pytestmark = pytest.mark.slow  # real processes (make integration)

SCRIPT = REPO_ROOT / "tests" / "support" / "train_alone.py"
MODEL_LINE = "    model = Net()\n"


def _findings(script: Path, out: Path) -> dict[str, dict[str, Any]]:
    zdiag = (sys.executable, "-m", "zdiag")
    proc = _run(*zdiag, "run", "--nproc-per-node", "2", "--out", str(out), str(script))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("trained") == 2
    proc = _run(*zdiag, "analyze", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {f["id"]: f for f in json.loads(proc.stdout)["findings"]}


def test_processes_that_never_communicate_are_told_how_to_train_one_model(
    tmp_path: Path,
) -> None:
    before = _findings(SCRIPT, tmp_path / "before")
    finding = before["no-communication"]
    assert finding["severity"] == "critical"
    assert finding["evidence"]["processes_launched"] == 2
    code = finding["code"]
    assert "dist.init_process_group()" in code
    assert "for block in model.blocks:" in code and "fully_shard(model)" in code

    script = SCRIPT.read_text()
    assert MODEL_LINE in script
    patched = tmp_path / "train_together.py"
    patched.write_text(
        script.replace(MODEL_LINE, MODEL_LINE + textwrap.indent(code, "    ") + "\n")
    )
    after = _findings(patched, tmp_path / "after")
    assert "no-communication" not in after
