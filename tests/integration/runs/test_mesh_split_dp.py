"""FSDP2 + TP with its flat FSDP dimension across two nodes: the HSDP split code runs when pasted
(issue 26, the `flat-sharding-multinode` code on a 2-D mesh).

examples/mesh/fsdp_tp.py on 8 gloo ranks, recorded by two `zdiag run --nnodes 2` launchers of 4
ranks each on localhost (nodes {0..3} and {4..7}, told apart by their node ranks): its
(dp=4, tp=2) mesh keeps the TP pairs {0,1}, {2,3}, ... inside a node, while the dp groups
{0,2,4,6} and {1,3,5,7} span both nodes. `flat-sharding-multinode` proposes the run's own mesh
with "dp" split into dp_replicate x dp_shard, a (2, 2, 2) mesh with "tp" kept; `tp-across-nodes`
stays quiet. The code is pasted as a user would: its mesh lines in place of the script's mesh
line, its `fully_shard` lines in place of the script's. The script's other `mesh["dp"]` (its
data's rank) is left as it was, so the code must keep that name working. Recorded the same way,
the patched script trains, shards within a node in pairs, all-reduces across the nodes, and
raises neither finding. About a minute on 2 cores: two 8-rank runs of about 25 s each.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT
from support.processes import analyze_json, two_nodes

pytestmark = [pytest.mark.slow, pytest.mark.dist]

SCRIPT = REPO_ROOT / "examples" / "mesh" / "fsdp_tp.py"
MESH_LINE = '    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))\n'
WRAP_LINES = (
    "    for stage in model.encoder.stages:\n"
    '        fully_shard(stage, mesh=mesh["dp"])\n'
    '    fully_shard(model, mesh=mesh["dp"])\n'
)
STEPS = 4
NODES = [[0, 1, 2, 3], [4, 5, 6, 7]]
# the lines the code must hold: the run's dimension names, the run's own blocks
EXPECTED_CODE = (
    'mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))',
    'dp_mesh = mesh["dp_replicate", "dp_shard"]',
    'dp_mesh._flatten("dp")',
    "for block in model.encoder.stages:\n    fully_shard(block, mesh=dp_mesh)\n"
    "fully_shard(model, mesh=dp_mesh)",
)
LOSS_RE = re.compile(r"^step (\d+) loss (\S+)$", re.M)


def _record(script: Path, out: Path) -> tuple[dict[str, Any], dict[int, float]]:
    """`script` on 2 nodes of 4 ranks: the analysis and rank 0's loss per step."""
    logs = two_nodes(script, out, "--steps", str(STEPS), nproc_per_node=4)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["world_size"] == 8 and manifest["nnodes"] == 2
    assert len(set(manifest["hosts"])) == 1  # one machine: the node ranks tell the nodes apart
    assert [r["node_rank"] for r in manifest["ranks"]] == [0] * 4 + [1] * 4
    assert [(r["exit_code"], r["steps"]) for r in manifest["ranks"]] == [(0, STEPS)] * 8
    losses = {int(step): float(loss) for step, loss in LOSS_RE.findall(logs[0])}  # rank 0
    assert sorted(losses) == list(range(STEPS)), logs[0][-2000:]
    return analyze_json(out), losses


def paste(script: str, code: str) -> str:
    """`script` with the code pasted: its lines before the first `for`/`fully_shard` (imports,
    the mesh) in place of the mesh line, the rest in place of the script's `fully_shard` lines."""
    lines = code.splitlines()
    cut = next(i for i, line in enumerate(lines) if line.startswith(("for ", "fully_shard(")))
    assert MESH_LINE in script and WRAP_LINES in script
    script = script.replace(MESH_LINE, textwrap.indent("\n".join(lines[:cut]), "    ") + "\n")
    return script.replace(WRAP_LINES, textwrap.indent("\n".join(lines[cut:]), "    ") + "\n")


def _groups(doc: dict[str, Any], description: str) -> list[dict[str, Any]]:
    return sorted(
        (g for g in doc["process_groups"] if g["description"] == description),
        key=lambda g: g["ranks"],
    )


def test_flat_dp_across_nodes_split_into_hsdp_code_runs_pasted_into_the_tp_script(
    tmp_path: Path,
) -> None:
    node_of = {r: k for k, node in enumerate(NODES) for r in node}
    before, losses_before = _record(SCRIPT, tmp_path / "before")
    found = {f["id"]: f for f in before["findings"]}
    assert "tp-across-nodes" not in found  # the TP pairs sit on one node each
    assert [g["ranks"] for g in _groups(before, "mesh_tp")] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    flat = found["flat-sharding-multinode"]
    assert flat["title"] == "FSDP shards across 4 ranks on 2 nodes"
    assert flat["evidence"]["fsdp_group"] == [0, 2, 4, 6]
    assert flat["evidence"]["nodes_spanned"] == 2
    code = flat["code"]
    for expected in EXPECTED_CODE:
        assert expected in code, code
    assert '("replicate", "shard")' not in code  # not a bare 2-D HSDP mesh: "tp" kept

    patched = tmp_path / "fsdp_tp_hsdp.py"
    patched.write_text(paste(SCRIPT.read_text(), code))
    after, losses_after = _record(patched, tmp_path / "after")
    assert after["run"]["config"]["mesh"] == "dp_replicate=2 x dp_shard=2 x tp=2"
    # FSDP now gathers in pairs inside a node and all-reduces across the two nodes
    shard = _groups(after, "mesh_dp_shard")
    assert [g["ranks"] for g in shard] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert all(len({node_of[r] for r in g["ranks"]}) == 1 for g in shard)
    assert all("all_gather" in g["kinds"] for g in shard)
    replicate = _groups(after, "mesh_dp_replicate")
    assert [g["ranks"] for g in replicate] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all([node_of[r] for r in g["ranks"]] == [0, 1] for g in replicate)
    assert all(g["kinds"] == ["all_reduce"] for g in replicate)
    gathers_across = [
        g["ranks"]
        for g in after["process_groups"]
        if "all_gather" in g["kinds"] and len({node_of[r] for r in g["ranks"]}) > 1
    ]
    assert gathers_across == []
    # mesh["dp"] (the flattened pair) seeds the data as before: rank 0 trains on the same batches
    assert losses_after == pytest.approx(losses_before, abs=1e-3)

    after_ids = {f["id"] for f in after["findings"]}
    assert not after_ids & {"flat-sharding-multinode", "tp-across-nodes"}, after_ids
    # nothing new but what HSDP brings: its cross-replica all-reduce, when exposed
    assert after_ids - set(found) <= {"exposed-replicate-allreduce"}, after_ids
