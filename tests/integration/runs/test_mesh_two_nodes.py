"""A two-"node" launch on one machine (issue 26, items 4 and 6): host-aware mesh advice, tested.

Two `zdiag run --nnodes 2 --node-rank K` launchers on localhost meet at one rendezvous and write
one run directory. Both see the same host name: the analysis tells the nodes apart by the node
rank each launcher records for its ranks (manifest.d/rank-N.json `node_rank`).

The script is examples/mesh/fsdp_tp.py with its mesh built ("tp", "dp") instead of ("dp", "tp"):
init_device_mesh lays ranks out row-major, so the TP groups become {0, 2} and {1, 3}, across the
two nodes {0, 1} and {2, 3}. `tp-across-nodes` says so; its code (the mesh rebuilt with "tp"
last), pasted in place of the script's mesh line, trains on the same two nodes and no longer
raises it. Its gain is the replay of that order (`zdiag whatif --mesh-order dp,tp`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT
from support.processes import analyze_json, two_nodes, zdiag

pytestmark = [pytest.mark.slow, pytest.mark.dist]

SCRIPT = REPO_ROOT / "examples" / "mesh" / "fsdp_tp.py"
MESH_LINE = '    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))\n'
TP_FIRST = '    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("tp", "dp"))\n'


def _two_nodes(script: Path, out: Path) -> list[dict[str, Any]]:
    """Record `script` with two launchers of 2 ranks each on localhost; the findings of
    `zdiag analyze --json`."""
    two_nodes(script, out, "--steps", "4")
    findings: list[dict[str, Any]] = analyze_json(out)["findings"]
    return findings


def test_tp_across_two_nodes_on_one_machine_is_found_and_its_code_fixes_it(
    tmp_path: Path,
) -> None:
    source = SCRIPT.read_text()
    assert MESH_LINE in source
    tp_first = tmp_path / "fsdp_tp_first.py"
    tp_first.write_text(source.replace(MESH_LINE, TP_FIRST))

    out = tmp_path / "before"
    findings = {f["id"]: f for f in _two_nodes(tp_first, out)}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["nnodes"] == 2 and len(set(manifest["hosts"])) == 1  # one machine
    assert [r["node_rank"] for r in manifest["ranks"]] == [0, 0, 1, 1]
    tp = findings["tp-across-nodes"]
    assert tp["evidence"]["crossing_groups"] == [[0, 2], [1, 3]]
    code = tp["code"]
    assert code.endswith('mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))')
    # the dp groups {0, 1}, {2, 3} sit on one node each: no HSDP advice
    assert "flat-sharding-multinode" not in findings
    # the gain comes from the replay of that mesh order (whatever its sign on one machine's
    # loopback), which `zdiag whatif` runs on its own and explains
    assert "zdiag whatif --mesh-order dp,tp" in tp["gain_method"]
    whatif = zdiag("whatif", str(out), "--mesh-order", "dp,tp")
    assert whatif.returncode == 0, whatif.stderr
    text = " ".join(whatif.stdout.split())
    assert '"dp" inside a node -> across nodes; "tp" across nodes -> inside a node' in text

    fixed = tmp_path / "fsdp_tp_fixed.py"
    fixed.write_text(source.replace(MESH_LINE, "    " + code.splitlines()[-1] + "\n"))
    after = {f["id"] for f in _two_nodes(fixed, tmp_path / "after")}
    assert "tp-across-nodes" not in after
