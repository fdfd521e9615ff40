"""The whole-model-wrap code of a 2-D run runs when pasted into that script (issue 26, item 4).

- examples/mesh/fsdp_tp_root_only.py shards only its root over the "dp" dimension of a (2, 2)
  ("dp", "tp") mesh, beside tensor parallelism over "tp". Code without `mesh=` would shard over
  the whole world and break the TP composition.
- examples/mesh/hsdp_root_only.py shards only its root over a (2, 2) ("replicate", "shard") HSDP
  mesh: the code must keep the run's HSDP mesh, not fall back to a flat shard over the world.

The finding's code, from `zdiag analyze --json`, replaces the body of the script's
`wrap(model, mesh)`; the patched script trains under torchrun on 4 gloo ranks, and recorded again
it no longer raises whole-model-wrap.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.slow  # real processes: a minute or two (make integration)

TIMEOUT_S = 300
MESH_EXAMPLES = REPO_ROOT / "examples" / "mesh"
# per script: the lines the whole-model-wrap code must hold (the run's own mesh and modules)
EXPECTED_CODE = {
    "fsdp_tp_root_only.py": (
        'dp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"]',
        "fully_shard(block, mesh=dp_mesh)",
        "fully_shard(model, mesh=dp_mesh)",
    ),
    "hsdp_root_only.py": (
        'mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))',
        "for block in model.encoder.stages:",
        "fully_shard(block, mesh=mesh)",
        "fully_shard(model, mesh=mesh)",
    ),
}
WRAP_RE = re.compile(
    r"^def wrap\(model: nn\.Module, mesh: DeviceMesh\) -> None:\n(?:    .*\n)+", re.M
)


def _run(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [*args], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False
    )


def _findings(script: Path, out: Path) -> list[dict[str, Any]]:
    """Record `script` under `zdiag run` on 4 gloo ranks; the findings of `zdiag analyze --json`."""
    zdiag = (sys.executable, "-m", "zdiag")
    proc = _run(*zdiag, "run", "--nproc-per-node", "4", "--out", str(out), str(script))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    proc = _run(*zdiag, "analyze", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    findings: list[dict[str, Any]] = json.loads(proc.stdout)["findings"]
    return findings


def paste_into_wrap(script: str, code: str) -> str:
    """`script` with the body of its `wrap(model, mesh)` replaced by `code`."""
    head = "def wrap(model: nn.Module, mesh: DeviceMesh) -> None:\n"
    assert WRAP_RE.search(script), "the script has no wrap(model, mesh) to paste into"
    return WRAP_RE.sub(lambda _: head + textwrap.indent(code, "    ") + "\n", script, count=1)


@pytest.mark.parametrize("script_name", sorted(EXPECTED_CODE))
def test_whole_model_wrap_code_runs_pasted_into_the_script(
    script_name: str, tmp_path: Path
) -> None:
    script = MESH_EXAMPLES / script_name
    before = _findings(script, tmp_path / "before")
    wrap = next(f for f in before if f["id"] == "whole-model-wrap")
    code = wrap["code"]
    for line in EXPECTED_CODE[script_name]:
        assert line in code, code

    patched = tmp_path / f"wrapped_{script_name}"
    patched.write_text(paste_into_wrap(script.read_text(), code))
    after = _findings(patched, tmp_path / "after")  # it trains (exit 0) on all 4 ranks
    ranks = json.loads((tmp_path / "after" / "manifest.json").read_text())["ranks"]
    assert len(ranks) == 4 and all(r["exit_code"] == 0 and r["steps"] >= 3 for r in ranks)
    assert "whole-model-wrap" not in {f["id"] for f in after}


HOOK = 'def before_backward(model: nn.Module, i: int) -> None:\n    """Called before micro-batch i\'s backward (i = 0 .. MICRO_BATCHES - 1)."""\n'


def _replicate_calls(out: Path) -> float:
    """Calls per rank on the run's replicate groups (`zdiag analyze --json`)."""
    proc = _run(sys.executable, "-m", "zdiag", "analyze", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    groups = json.loads(proc.stdout)["process_groups"]
    return sum(g["calls_per_rank"] for g in groups if g["description"] == "mesh_replicate")


def test_replicate_all_reduce_code_runs_in_the_accumulation_loop(tmp_path: Path) -> None:
    """examples/mesh/hsdp_accum.py accumulates 4 micro-batches per step under HSDP, and FSDP2
    all-reduces across the replicas after each one. The exposed-replicate-allreduce code goes in
    the script's `before_backward(model, i)` hook: the patched script trains, all-reduces once
    per step (a quarter of the replicate calls), and is not told to do it again. When the
    remaining all-reduces are still exposed, the next code (bf16 reduction on the run's mesh)
    goes in `wrap(model, mesh)` and runs too."""
    script = MESH_EXAMPLES / "hsdp_accum.py"
    before = _findings(script, tmp_path / "before")
    finding = next(f for f in before if f["id"] == "exposed-replicate-allreduce")
    assert finding["code"].endswith("model.set_requires_all_reduce(i == 3)"), finding["code"]
    # its gain is the replay of that change, which `zdiag whatif --all-reduce-once` gives too
    assert "zdiag whatif --all-reduce-once" in finding["gain_method"], finding["gain_method"]
    assert finding["expected_gain_ms"] > 0
    calls_before = _replicate_calls(tmp_path / "before")

    text = script.read_text()
    assert HOOK in text
    patched = tmp_path / "hsdp_accum_fixed.py"
    patched.write_text(text.replace(HOOK, HOOK + textwrap.indent(finding["code"], "    ") + "\n"))
    after = _findings(patched, tmp_path / "after")
    assert _replicate_calls(tmp_path / "after") == pytest.approx(calls_before / 4)
    again = [f for f in after if f["id"] == "exposed-replicate-allreduce"]
    assert not any("set_requires_all_reduce" in (f["code"] or "") for f in again)
    if again:  # the bf16 reduction, pasted into wrap(): it trains and is not proposed again
        code = again[0]["code"]
        assert 'mesh_dim_names=("replicate", "shard")' in code and "reduce_dtype" in code
        # on this CPU run bf16 does not pay (gloo sums it on the host): no figure, and why
        assert again[0]["expected_gain_ms"] is None
        assert "gloo sums bf16 on the host" in again[0]["gain_method"]
        bf16 = tmp_path / "hsdp_accum_bf16.py"
        bf16.write_text(paste_into_wrap(patched.read_text(), code))
        last = _findings(bf16, tmp_path / "bf16")
        assert "exposed-replicate-allreduce" not in {f["id"] for f in last}
