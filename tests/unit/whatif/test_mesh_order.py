"""The captured mesh in another dimension order: each dimension's collectives on the link of the
rank's new group (inside a node, or across nodes)."""

from __future__ import annotations

import pytest

from zdiag.analyzers.inputs.model_facts import ModelFacts
from zdiag.analyzers.rank.step_model import ModelOp, StepModel
from zdiag.analyzers.whatif.mesh_order import (
    MeshOrderError,
    check_order,
    regroupings,
    reordered,
)
from zdiag.analyzers.whatif.platform import CommFit
from zdiag.analyzers.whatif.run_whatif import Change, WhatIfError, WhatIfResult, replay_change
from zdiag.collectors.model_schema import DeviceMeshInfo, MeshDim, ModelDescription

NODES = ((0, 1), (2, 3))


def tp_first() -> ModelFacts:
    """A ("tp", "dp") mesh of 2 x 2: TP groups {0, 2} and {1, 3}, across the nodes {0, 1} and
    {2, 3}; the DP groups {0, 1} and {2, 3}, one node each."""
    mesh = DeviceMeshInfo(
        shape=(2, 2),
        dim_names=("tp", "dp"),
        device_type="cpu",
        ranks=(0, 1, 2, 3),
        dims=(MeshDim("tp", 2, "tp"), MeshDim("dp", 2, "shard")),
    )
    return ModelFacts(ModelDescription(framework="fsdp2", mesh=mesh))


def members(rank: int) -> dict[str, tuple[int, ...]]:
    """Rank's process groups by name: "0" the world, "1" its TP group, "2" its DP group."""
    return {
        "0": (0, 1, 2, 3),
        "1": (rank % 2, rank % 2 + 2),
        "2": (rank - rank % 2, rank - rank % 2 + 1),
    }


def op(kind: str, group: str, pos: float, dur: float) -> ModelOp:
    return ModelOp(
        kind=kind, lane=f"{group}|{kind}", issue_pos_us=pos, after=-1, delay_us=0.0,
        dur_us=dur, wait_pos_us=pos, bytes=4000,
    )  # fmt: skip


def step() -> StepModel:
    """A TP all-reduce (400 us), an FSDP-style gather on the DP group (300 us) and a world
    all-reduce (100 us), each blocking, in 1000 us of work."""
    ops = [
        op("all_reduce", "1", 100.0, 400.0),
        op("all_gather", "2", 500.0, 300.0),
        op("all_reduce", "0", 900.0, 100.0),
    ]
    return StepModel(step=1, start_us=0.0, duration_us=1800.0, work_us=1000.0, ops=ops)


def test_tp_last_moves_tp_inside_a_node_and_dp_across_at_the_stated_speedup() -> None:
    mesh = check_order(tp_first().mesh, ("dp", "tp"), NODES)
    every = regroupings(mesh, ("dp", "tp"), range(4), NODES, {r: members(r) for r in range(4)}, 4.0)
    regroup = every[0]
    assert regroup.groups == {"dp": ((0, 1), (0, 2)), "tp": ((0, 2), (0, 1))}
    assert every[3].groups == {"dp": ((2, 3), (1, 3)), "tp": ((1, 3), (2, 3))}
    assert all(g.node_of is regroup.node_of for g in every.values())  # worked out once
    fits = {"1|all_reduce": CommFit("1|all_reduce", 100.0, 1.0, 10, 2, 0.1, True)}
    out = reordered(step(), regroup, fits)
    # TP: its 100 us latency kept, its 300 us of bytes 4x as fast; DP: 4x as slow; world kept
    assert [o.dur_us for o in out.ops] == pytest.approx([100.0 + 300.0 / 4, 300.0 * 4, 100.0])
    # the TP all-reduce is the "tp" group's, the gather the "dp" group's, the world's none
    assert [regroup.regrouped(o.lane) for o in step().ops] == [
        ((0, 2), (0, 1)),
        ((0, 1), (0, 2)),
        None,
    ]


def test_runs_that_cannot_be_reordered_are_refused_with_the_reason() -> None:
    mesh = tp_first().mesh
    with pytest.raises(MeshOrderError, match="needs the run's device mesh"):
        check_order(None, ("dp", "tp"), NODES)
    with pytest.raises(MeshOrderError, match=r"each of the run's mesh dimensions once \(tp,dp\)"):
        check_order(mesh, ("dp", "pp"), NODES)
    with pytest.raises(MeshOrderError, match="already in the order tp,dp"):
        check_order(mesh, ("tp", "dp"), NODES)
    with pytest.raises(MeshOrderError, match="this run has one node"):
        check_order(mesh, ("dp", "tp"), ((0, 1, 2, 3),))


def replayed(change: Change, nodes: tuple[tuple[int, ...], ...] = NODES) -> WhatIfResult:
    """`change` replayed on 4 ranks of `step()` under the tp-first mesh."""
    return replay_change(
        {r: [step()] for r in range(4)}, "cpu", change, model=tp_first(), nodes=nodes,
        group_members={r: members(r) for r in range(4)},
    )  # fmt: skip


def test_replay_change_reorders_every_rank_and_says_which_groups_move() -> None:
    change = Change(mesh_order=("dp", "tp"))
    result = replayed(change)
    # the TP all-reduce saves 200 of its 400 us, the DP gather costs 300 us more
    assert result.gain_ms == pytest.approx(-0.1)
    assert change.label() == "--mesh-order dp,tp"
    text = " ".join(result.notes)
    assert '"tp" across nodes -> inside a node' in text
    assert '"dp" inside a node -> across nodes' in text
    assert "1 of 3 collectives per step are on groups that are not one mesh dimension's" in text
    faster = replayed(Change(mesh_order=("dp", "tp"), intra_node_speedup=8.0))
    assert faster.gain_ms < result.gain_ms  # DP's 300 us cost 8x, TP's 400 us at most saved
    with pytest.raises(WhatIfError, match="not both"):
        replayed(Change(mesh_order=("dp", "tp"), mesh_shape=(1, 4)))
    with pytest.raises(WhatIfError, match="this run has one node"):
        replayed(change, nodes=((0, 1, 2, 3),))
    # a process-group table without members: no collective can be placed on a dimension
    with pytest.raises(WhatIfError, match="nothing to re-time"):
        replay_change({r: [step()] for r in range(4)}, "cpu", change, model=tp_first(), nodes=NODES)
