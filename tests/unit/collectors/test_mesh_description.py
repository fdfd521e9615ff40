"""The device mesh in the model description (`zdiag.model/1.1`): old descriptions load without
one, new ones load into `MeshFacts` with every rank's group per dimension, malformed parts keep
their defaults, and a failing mesh capture never fails the description. Real 4-rank meshes:
tests/integration/runs/test_mesh_runs.py."""

from __future__ import annotations

import json
from math import prod
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from zdiag.analyzers.detectors.fact_sheet import build_fact_sheet
from zdiag.analyzers.inputs.mesh_facts import mesh_groups
from zdiag.analyzers.inputs.model_facts import ModelFacts, facts_from_run_dir
from zdiag.collectors import mesh_capture
from zdiag.collectors.model_capture import describe_model
from zdiag.collectors.model_schema import MODEL_SCHEMA_VERSION, ModelDescription

# What rank 1 of examples/mesh/hsdp.py wrote (trimmed to the mesh parts).
HSDP_RANK1: dict[str, Any] = {
    "schema": "zdiag.model/1.1",
    "rank": 1,
    "framework": "fsdp2",
    "fsdp2_units": [
        {
            "path": "encoder.stages.0",
            "cls": "ResidualMLP",
            "mesh_shape": [2, 2],
            "mesh_dim_names": ["replicate", "shard"],
            "mesh_roles": ["replicate", "shard"],
            "hsdp": True,
        }
    ],
    "mesh": {
        "shape": [2, 2],
        "dim_names": ["replicate", "shard"],
        "device_type": "cpu",
        "ranks": [0, 1, 2, 3],
        "dims": [
            {
                "name": "replicate",
                "size": 2,
                "role": "replicate",
                "group_ranks": [1, 3],
                "group_name": "2",
            },
            {"name": "shard", "size": 2, "role": "shard", "group_ranks": [0, 1], "group_name": "3"},
        ],
    },
    "process_groups": [
        {"name": "0", "desc": "default_pg", "ranks": [0, 1, 2, 3]},
        {"name": "2", "desc": "mesh_replicate", "ranks": [1, 3]},
        {"name": "3", "desc": "mesh_shard", "ranks": [0, 1]},
    ],
}

TP_MODULE: dict[str, Any] = {
    "path": "encoder.stages.0.up",
    "cls": "Linear",
    "mesh_dims": ["dp", "tp"],
    "tp_dims": ["tp"],
    "style": "colwise",
    "params": [{"name": "weight", "placements": ["_S(0, 2)", "S(0)"]}],
}


def old_description() -> dict[str, Any]:
    """A `zdiag.model/1` description: no mesh, no DTensor modules, no process groups, no roles."""
    data = describe_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))).to_json()
    for key in ("mesh", "dtensor_modules", "process_groups"):
        del data[key]
    data["schema"] = "zdiag.model/1"
    data["framework"] = "fsdp2"
    data["fsdp2_units"] = [{"path": "", "cls": "Sequential", "mesh_shape": [2], "hsdp": False}]
    return data


def test_an_old_description_loads_without_a_mesh(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "rank-0.json").write_text(json.dumps(old_description()))
    facts = facts_from_run_dir(tmp_path)
    assert facts is not None and facts.framework == "fsdp2"
    assert facts.description.mesh is None and facts.mesh is None
    assert facts.description.dtensor_modules == () and facts.description.process_groups == ()
    unit = facts.fsdp2_units[0]
    assert unit.mesh_shape == (2,) and unit.mesh_roles == () and not unit.hsdp
    sheet = build_fact_sheet(ledgers={}, breakdowns={}, facts={}, manifest=None, model=facts)
    assert sheet.mesh is None


def test_a_description_without_a_mesh_writes_the_new_version() -> None:
    desc = describe_model(nn.Linear(2, 2))
    assert desc.schema == MODEL_SCHEMA_VERSION == "zdiag.model/1.3"
    assert desc.mesh is None and desc.dtensor_modules == () and desc.process_groups == ()
    data = json.loads(json.dumps(desc.to_json()))
    assert data["mesh"] is None and ModelDescription.from_json(data) == desc


def test_an_hsdp_description_gives_every_ranks_groups() -> None:
    facts = ModelFacts(ModelDescription.from_json(HSDP_RANK1))
    mesh = facts.mesh
    assert mesh is not None and mesh.shape == (2, 2) and mesh.ndim == 2
    assert mesh.dim_names == ("replicate", "shard") and mesh.captured_rank == 1
    replicate, shard = mesh.dims
    assert (replicate.role, shard.role) == ("replicate", "shard")
    assert shard.groups == ((0, 1), (2, 3)) and replicate.groups == ((0, 2), (1, 3))
    assert mesh.captured_groups == ((1, 3), (0, 1))  # what c10d told rank 1: the layout agrees
    assert tuple(mesh.groups_of(1).values()) == mesh.captured_groups
    assert mesh.groups_of(2) == {"replicate": (0, 2), "shard": (2, 3)}
    assert mesh.dim("shard") is shard and mesh.dim("tp") is None
    assert mesh.dims_with_role("replicate") == (replicate,)
    assert [g.desc for g in mesh.process_groups] == ["default_pg", "mesh_replicate", "mesh_shard"]
    assert facts.fsdp2_units[0].mesh_roles == ("replicate", "shard")
    sheet = build_fact_sheet(ledgers={}, breakdowns={}, facts={}, manifest=None, model=facts)
    assert sheet.mesh == mesh


def test_the_tp_plan_is_read_per_module() -> None:
    data = {
        **HSDP_RANK1,
        "mesh": {
            "shape": [2, 2],
            "dim_names": ["dp", "tp"],
            "ranks": [0, 1, 2, 3],
            "dims": [
                {"name": "dp", "size": 2, "role": "shard"},
                {"name": "tp", "size": 2, "role": "tp"},
            ],
        },
        "dtensor_modules": [
            TP_MODULE,
            {**TP_MODULE, "path": "encoder.stages.0.down", "style": "rowwise"},
        ],
    }
    mesh = ModelFacts(ModelDescription.from_json(data)).mesh
    assert mesh is not None and [d.role for d in mesh.dims] == ["shard", "tp"]
    assert mesh.dim("tp") is not None and mesh.dim("tp").groups == ((0, 1), (2, 3))  # type: ignore[union-attr]
    assert [(e.path, e.style, e.dims) for e in mesh.tp_plan] == [
        ("encoder.stages.0.up", "colwise", ("tp",)),
        ("encoder.stages.0.down", "rowwise", ("tp",)),
    ]


def test_malformed_mesh_parts_keep_their_defaults() -> None:
    data = json.loads(json.dumps(HSDP_RANK1))
    data["schema"] = "zdiag.model/1.7"  # a newer minor version: still read
    data["mesh"]["dims"][0]["group_ranks"] = "zero and two"  # malformed: keeps ()
    data["mesh"]["a_future_key"] = [1]
    data["process_groups"] = {"not": "a list"}  # malformed: keeps ()
    desc = ModelDescription.from_json(data)
    assert desc.mesh is not None and desc.mesh.dims[0].group_ranks == ()
    assert desc.process_groups == ()
    mesh = ModelFacts(desc).mesh
    assert mesh is not None and mesh.dims[0].groups == ((0, 2), (1, 3))
    assert ModelDescription.from_json({**data, "mesh": "a string"}).mesh is None
    broken = {**data, "mesh": {**data["mesh"], "ranks": [0, 1, 2]}}  # does not fit the shape
    mesh = ModelFacts(ModelDescription.from_json(broken)).mesh
    assert mesh is not None and all(d.groups == () for d in mesh.dims)
    assert mesh.groups_of(0) == {}


@pytest.mark.parametrize(
    ("shape", "dim", "groups"),
    [
        ((4,), 0, ((0, 1, 2, 3),)),
        ((2, 2), 0, ((0, 2), (1, 3))),
        ((2, 2), 1, ((0, 1), (2, 3))),
        ((2, 2, 2), 0, ((0, 4), (1, 5), (2, 6), (3, 7))),
        ((2, 2, 2), 1, ((0, 2), (1, 3), (4, 6), (5, 7))),
        ((2, 2, 2), 2, ((0, 1), (2, 3), (4, 5), (6, 7))),
        ((2, 3), 0, ((0, 3), (1, 4), (2, 5))),
        ((2, 2), 2, ()),
    ],
)
def test_mesh_groups_follow_the_row_major_layout(
    shape: tuple[int, ...], dim: int, groups: tuple[tuple[int, ...], ...]
) -> None:
    assert mesh_groups(shape, tuple(range(prod(shape))), dim) == groups


def test_mesh_groups_keep_the_layouts_own_ranks() -> None:
    assert mesh_groups((2, 2), (3, 1, 2, 0), 0) == ((3, 2), (1, 0))


def test_a_failing_mesh_capture_is_a_note_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any) -> Any:
        raise RuntimeError("torch moved it")

    monkeypatch.setattr(mesh_capture, "_dtensor_modules", boom)
    monkeypatch.setattr(mesh_capture, "_process_groups", boom)
    desc = describe_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    assert desc.mesh is None and desc.dtensor_modules == () and desc.process_groups == ()
    assert any("DTensor placements not read: RuntimeError" in n for n in desc.notes)
    assert any("process groups not read: RuntimeError" in n for n in desc.notes)
    assert desc.param_count == 40  # the rest of the description is whole
