"""Runs on a 2-D mesh, end to end with real processes: examples/mesh/hsdp.py (HSDP on a (2, 2)
mesh) and examples/mesh/fsdp_tp.py (FSDP2 over "dp" + tensor parallel over "tp") under
`zdiag run --nproc-per-node 4` with default options. Every rank's model description holds the
mesh with its true groups, and `zdiag analyze` reads the run directories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from support.processes import zdiag
from zdiag.analyzers.inputs.model_facts import facts_from_run_dir

pytestmark = pytest.mark.slow  # real processes: seconds per test (make integration)

PAIRS = ((0, 1), (2, 3))  # the rows of a (2, 2) mesh over ranks 0-3
ACROSS = ((0, 2), (1, 3))  # its columns


def run_example(name: str, out: Path) -> list[dict[str, Any]]:
    """Run examples/mesh/<name>.py on 4 gloo ranks; the 4 model descriptions, rank order."""
    proc = zdiag("run", "--nproc-per-node", "4", "--out", str(out), f"examples/mesh/{name}.py")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((out / "model" / f"rank-{r}.json").read_text()) for r in range(4)]


def group_of(rank: int, groups: tuple[tuple[int, ...], ...]) -> list[int]:
    return list(next(g for g in groups if rank in g))


def assert_analyzes(run_dir: Path) -> None:
    proc = zdiag("analyze", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_hsdp_mesh_is_captured_with_each_ranks_groups(tmp_path: Path) -> None:
    descriptions = run_example("hsdp", tmp_path / "hsdp")
    for rank, desc in enumerate(descriptions):
        assert desc["schema"] == "zdiag.model/1.3" and desc["rank"] == rank
        mesh = desc["mesh"]
        assert mesh["shape"] == [2, 2] and mesh["dim_names"] == ["replicate", "shard"]
        assert mesh["ranks"] == [0, 1, 2, 3]
        replicate, shard = mesh["dims"]
        assert (replicate["role"], shard["role"]) == ("replicate", "shard")
        assert shard["group_ranks"] == group_of(rank, PAIRS)
        assert replicate["group_ranks"] == group_of(rank, ACROSS)
        groups = {g["desc"]: g["ranks"] for g in desc["process_groups"]}
        assert groups["mesh_shard"] == group_of(rank, PAIRS)
        assert groups["mesh_replicate"] == group_of(rank, ACROSS)
        assert groups["default_pg"] == [0, 1, 2, 3]
        assert desc["dtensor_modules"] == []  # FSDP's own placements are not a TP plan
        units = {u["path"]: u for u in desc["fsdp2_units"]}
        assert set(units) == {"", *(f"encoder.stages.{i}" for i in range(4))}
        assert all(u["mesh_roles"] == ["replicate", "shard"] and u["hsdp"] for u in units.values())
    facts = facts_from_run_dir(tmp_path / "hsdp")
    assert facts is not None and facts.mesh is not None
    assert facts.mesh.dim("shard").groups == PAIRS  # type: ignore[union-attr]
    assert facts.mesh.dim("replicate").groups == ACROSS  # type: ignore[union-attr]
    assert_analyzes(tmp_path / "hsdp")


def test_fsdp_tp_mesh_and_plan_are_captured(tmp_path: Path) -> None:
    descriptions = run_example("fsdp_tp", tmp_path / "tp")
    for rank, desc in enumerate(descriptions):
        mesh = desc["mesh"]
        assert mesh["shape"] == [2, 2] and mesh["dim_names"] == ["dp", "tp"]
        dp, tp = mesh["dims"]
        assert (dp["role"], tp["role"]) == ("shard", "tp")
        assert tp["group_ranks"] == group_of(rank, PAIRS)
        assert dp["group_ranks"] == group_of(rank, ACROSS)
        plan = {m["path"]: m for m in desc["dtensor_modules"]}
        for i in range(4):
            up, down = plan[f"encoder.stages.{i}.up"], plan[f"encoder.stages.{i}.down"]
            assert (up["style"], down["style"]) == ("colwise", "rowwise")
            assert up["tp_dims"] == down["tp_dims"] == ["tp"]
        assert len(plan) == 8  # the norms, stem and head are FSDP's only
        units = desc["fsdp2_units"]
        assert all(u["mesh_dim_names"] == ["dp"] and u["mesh_roles"] == ["shard"] for u in units)
        assert not any(u["hsdp"] for u in units)  # 2-D DTensors, but FSDP shards over "dp" only
    facts = facts_from_run_dir(tmp_path / "tp")
    assert facts is not None and facts.mesh is not None
    assert [(e.path, e.style) for e in facts.mesh.tp_plan[:2]] == [
        ("encoder.stages.0.up", "colwise"),
        ("encoder.stages.0.down", "rowwise"),
    ]
    assert_analyzes(tmp_path / "tp")
