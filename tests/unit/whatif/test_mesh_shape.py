"""Another HSDP mesh shape: gathers and reduces as ring collectives over the new groups."""

from __future__ import annotations

import msgspec
import pytest

from zdiag.analyzers.rank.step_model import ModelOp, StepModel
from zdiag.analyzers.whatif.mesh_shape import (
    DpGroups,
    Fabric,
    MeshShapeError,
    check_shape,
    dp_groups,
    mesh_memory_delta,
    reshaped,
)
from zdiag.analyzers.whatif.platform import CommFit
from zdiag.analyzers.whatif.replay import replay
from zdiag.analyzers.whatif.run_whatif import Change, WhatIfError, replay_change


def call(kind: str, group: str, family: str, pos: float, dur: float, after: int = -1) -> ModelOp:
    """A blocking FSDP call of unit `layers.0` on `group`: issued and awaited at `pos`."""
    return ModelOp(
        kind=kind,
        lane=f"{group}|{kind}",
        issue_pos_us=pos,
        after=after,
        delay_us=0.0,
        dur_us=dur,
        wait_pos_us=pos,
        bytes=4000,
        unit="layers.0",
        family=family,
        phase="forward" if family == "all_gather" else "backward",
    )


def flat_step() -> StepModel:
    """Flat FSDP over group "0": a 300 us gather at 100, a 400 us reduce (gloo: an all-reduce)
    at 600, and a 100 us optimizer step at 800 of 1000 us of progress."""
    return StepModel(
        step=1,
        start_us=0.0,
        duration_us=1700.0,
        work_us=1000.0,
        ops=[
            call("all_gather", "0", "all_gather", 100.0, 300.0),
            call("all_reduce", "0", "reduce", 600.0, 400.0),
        ],
        optimizer=[(800.0, 100.0)],
    )


def hsdp_step() -> StepModel:
    """HSDP 2 x 2: the gather and reduce on shard group "3", the reduce's all-reduce of the
    gradient shard on replicate group "1" right after it."""
    model = flat_step()
    ops = [
        call("all_gather", "3", "all_gather", 100.0, 300.0),
        call("all_reduce", "3", "reduce", 600.0, 400.0),
        call("all_reduce", "1", "reduce", 600.0, 200.0),
        call("all_reduce", "3", "reduce", 700.0, 400.0, after=1),
    ]
    return StepModel(
        step=1, start_us=0.0, duration_us=2300.0, work_us=1000.0, ops=ops,
        optimizer=model.optimizer,
    )  # fmt: skip


def fit(lane: str, alpha: float) -> CommFit:
    return CommFit(lane, alpha, 1.0, 10, 2, 0.1, True)


def test_the_groups_come_from_the_gathers_and_the_other_reduces_with_their_declared_sizes() -> None:
    flat = dp_groups([flat_step()], {"0": 4})
    assert flat == DpGroups("0", 4, None, 1)
    hsdp = dp_groups([hsdp_step()], {"1": 2, "3": 2})
    assert hsdp == DpGroups("3", 2, "1", 2)
    # no process-group table: a run with no replicate group shards over the world
    assert dp_groups([flat_step()], {}, world=8).shape == (1, 8)
    with pytest.raises(MeshShapeError, match="do not say how many ranks"):
        dp_groups([hsdp_step()], {}, world=4)


def test_runs_that_cannot_be_reshaped_are_refused_with_the_reason() -> None:
    copies = StepModel(
        step=1, start_us=0.0, duration_us=10.0, work_us=10.0,
        ops=[call("all_reduce", "1", "reduce", 5.0, 1.0)],
    )  # fmt: skip
    with pytest.raises(MeshShapeError, match="whole copy of the model"):
        dp_groups([copies], {"1": 4})
    two_meshes = flat_step()
    two_meshes.ops.append(call("all_gather", "5", "all_gather", 200.0, 10.0))
    with pytest.raises(MeshShapeError, match="several process groups"):
        dp_groups([two_meshes], {"0": 4, "5": 2})
    groups = DpGroups("0", 4, None, 1)
    with pytest.raises(MeshShapeError, match="R x S = 4"):
        check_shape(groups, (3, 2))
    with pytest.raises(MeshShapeError, match="already 1 x 4"):
        check_shape(groups, (1, 4))


def test_a_flat_run_on_half_the_shard_gets_a_replicate_all_reduce_and_a_bigger_optimizer() -> None:
    model = flat_step()
    fits = {"0|all_gather": fit("0|all_gather", 60.0), "0|all_reduce": fit("0|all_reduce", 90.0)}
    out = reshaped(model, DpGroups("0", 4, None, 1), (2, 2), fits)
    gather, reduce, new = out.ops
    # ring over p ranks: (p-1) latencies, (p-1)/p of the bytes; 4 -> 2: 1/3 and 2/3
    assert gather.dur_us == pytest.approx(60.0 / 3 + 240.0 * (1 / 2) / (3 / 4))
    assert reduce.dur_us == pytest.approx(90.0 / 3 + 310.0 * (1 / 2) / (3 / 4))
    # the replicate all-reduce of the 2-way shard over 2 replicas, on the reduce's link: the
    # all-reduce over 4 had 2*3 latencies (15 us each) and moved 2*3/4 of the message (310 us)
    assert new.kind == "all_reduce" and new.family == "reduce" and new.lane == reduce.lane
    assert new.after == 1 and new.bytes == 2000
    assert new.dur_us == pytest.approx(2 * 1 * 15.0 + 2 * (1 / 2) * (310.0 / 1.5) / 2)
    # the optimizer holds twice the shard: its 100 us become 200, what follows moves on
    assert out.optimizer == [(800.0, 200.0)] and out.work_us == pytest.approx(1100.0)
    # every call blocks: the step is the progress plus the three calls, one after the other
    assert replay(out).duration_us == pytest.approx(1100.0 + sum(op.dur_us for op in out.ops))


def test_an_hsdp_run_made_flat_loses_its_all_reduces_and_halves_its_optimizer() -> None:
    out = reshaped(hsdp_step(), DpGroups("3", 2, "1", 2), (1, 4), {})
    assert [op.lane for op in out.ops] == ["3|all_gather", "3|all_reduce", "3|all_reduce"]
    assert out.ops[2].after == 1  # still queued behind the first reduce, re-indexed
    # no fit: no latency part; 2 -> 4 ranks moves (3/4) / (1/2) of the bytes
    assert out.ops[0].dur_us == pytest.approx(300.0 * 1.5)
    assert out.work_us == pytest.approx(950.0)


def test_an_hsdp_run_with_more_replicas_all_reduces_a_bigger_shard_over_more_ranks() -> None:
    four = StepModel(step=1, start_us=0.0, duration_us=1.0, work_us=1000.0, ops=hsdp_step().ops)
    # 2 x 4 -> 4 x 2: the replicate all-reduce goes from 2 to 4 ranks and carries twice the shard
    out = reshaped(four, DpGroups("3", 4, "1", 2), (4, 2), {})
    assert out.ops[2].dur_us == pytest.approx(200.0 * ((3 / 4) / (1 / 2)) * 2)
    assert out.ops[2].bytes == 8000


def test_the_memory_grows_with_the_shard_by_parameters_gradients_and_adams_two_states() -> None:
    groups = DpGroups("0", 4, None, 1)
    delta, how = mesh_memory_delta(8 * 2**20, groups, (2, 2), ("AdamW",))
    assert delta == 4 * 8 * 2**20 * (1 / 2 - 1 / 4)
    assert "AdamW's 2 state(s)" in how
    delta, how = mesh_memory_delta(8 * 2**20, groups, (2, 2), ("SGD",))
    assert delta == 2 * 8 * 2**20 * (1 / 2 - 1 / 4) and "not counted" in how
    assert mesh_memory_delta(None, groups, (2, 2), ())[0] is None


def test_replay_change_reshapes_every_rank_and_refuses_a_shape_of_other_ranks() -> None:
    sizes = {0: {"0": 4}, 1: {"0": 4}}
    step = msgspec.structs.replace(flat_step(), optimizer=[(800.0, 30.0)])
    result = replay_change(
        {0: [step], 1: [step]}, "cpu", Change(mesh_shape=(2, 2)), group_sizes=sizes
    )
    assert result.change.label() == "--mesh-shape 2,2"
    assert any("1 x 4 (replicate x shard), replayed as 2 x 2" in n for n in result.notes)
    assert any("shard group's links" in n for n in result.notes)
    # one message size per lane: no latency fitted. The gather and the reduce lose a third
    # (-100, -133.3 us), the new all-reduce costs 133.3 us, the optimizer 30 us more
    assert result.gain_ms == pytest.approx(0.07)
    with pytest.raises(WhatIfError, match="R x S = 4"):
        replay_change({0: [flat_step()]}, "cpu", Change(mesh_shape=(2, 4)), group_sizes=sizes)


def test_one_rank_per_shard_drops_the_gathers_and_reduce_scatters() -> None:
    out = reshaped(flat_step(), DpGroups("0", 4, None, 1), (4, 1), {})
    # FSDP2 issues no collective on a group of one rank: only the new all-reduce of the whole
    # gradients over 4 replicas is left, where the reduce-scatter was (the same ring all-reduce)
    (only,) = out.ops
    assert only.kind == "all_reduce" and only.after == -1 and only.issue_pos_us == 600.0
    assert only.dur_us == pytest.approx(400.0)
    assert out.work_us == pytest.approx(1300.0)  # the optimizer over the whole model: 4x


def accumulated_step() -> StepModel:
    """HSDP 2 x 2 with two micro-batches: unit `layers.0` reduce-scatters (shard group "3") and
    all-reduces (replicate group "1") right after in each, blocking."""
    ops = [
        call("all_reduce", "3", "reduce", 300.0, 100.0),
        call("all_reduce", "1", "reduce", 300.5, 200.0),
        call("all_reduce", "3", "reduce", 700.0, 100.0, after=0),
        call("all_reduce", "1", "reduce", 700.5, 200.0, after=1),
        call("all_gather", "3", "all_gather", 100.0, 50.0),
    ]
    return StepModel(step=1, start_us=0.0, duration_us=1650.0, work_us=1000.0, ops=ops)


def test_all_reduce_once_keeps_each_units_last_replicate_all_reduce() -> None:
    from zdiag.analyzers.whatif.mesh_shape import all_reduced_once

    out, dropped = all_reduced_once(accumulated_step(), DpGroups("3", 2, "1", 2))
    assert dropped == 1
    assert [(op.lane, op.issue_pos_us) for op in out.ops] == [
        ("3|all_reduce", 300.0),
        ("3|all_reduce", 700.0),
        ("1|all_reduce", 700.5),
        ("3|all_gather", 100.0),
    ]
    assert [op.after for op in out.ops] == [-1, 0, -1, -1]  # its predecessor went with it
    assert replay(out).duration_us == pytest.approx(1650.0 - 200.0)


def test_all_reduce_once_needs_replicate_all_reduces_to_drop() -> None:
    sizes = {0: {"1": 2, "3": 2}}
    result = replay_change(
        {0: [accumulated_step()]}, "cpu", Change(all_reduce_once=True), group_sizes=sizes
    )
    assert result.change.label() == "--all-reduce-once"
    assert result.gain_ms == pytest.approx(0.2)
    with pytest.raises(WhatIfError, match="this run has none"):
        replay_change({0: [flat_step()]}, "cpu", Change(all_reduce_once=True),
                      group_sizes={0: {"0": 4}})  # fmt: skip
    once = msgspec.structs.replace(accumulated_step(), ops=accumulated_step().ops[2:])
    with pytest.raises(WhatIfError, match="once per step already"):
        replay_change({0: [once]}, "cpu", Change(all_reduce_once=True), group_sizes=sizes)


def test_bf16_reduces_keep_their_latency_and_halve_the_rest() -> None:
    from zdiag.analyzers.whatif.counterfactuals import half_reduce_bytes

    model = hsdp_step()
    fits = {"3|all_reduce": fit("3|all_reduce", 100.0)}
    out = half_reduce_bytes(model, fits)
    assert [op.dur_us for op in out.ops] == [300.0, 250.0, 100.0, 250.0]  # the gather unchanged
    assert [op.bytes for op in out.ops] == [4000, 2000, 2000, 2000]
    result = replay_change({0: [model]}, "cuda", Change(bf16_reduce=True))
    assert result.change.label() == "--reduce-dtype bf16"
    assert any("taken as fp32 now" in n for n in result.notes)
    # on CPU/gloo the halved bytes do not pay: refused, with the measured reason
    with pytest.raises(WhatIfError, match="gloo sums bf16 on the host"):
        replay_change({0: [model]}, "cpu", Change(bf16_reduce=True))


def test_bf16_parameters_halve_the_gathers_only_and_are_refused_on_cpu() -> None:
    from zdiag.analyzers.whatif.counterfactuals import half_gather_bytes

    model = hsdp_step()
    fits = {"3|all_gather": fit("3|all_gather", 100.0)}
    out = half_gather_bytes(model, fits)
    assert [op.bytes for op in out.ops] == [2000, 4000, 4000, 4000]  # the reduces unchanged
    assert out.ops[0].dur_us == pytest.approx(100.0 + (model.ops[0].dur_us - 100.0) / 2)
    result = replay_change({0: [model]}, "cuda", Change(bf16_params=True))
    assert result.change.label() == "--param-dtype bf16"
    assert result.predicted_ms < result.measured_ms
    assert result.memory_delta_bytes is not None and result.memory_delta_bytes < 0
    assert any("a lower bound" in n for n in result.notes)
    with pytest.raises(WhatIfError, match="moves the model's math to bf16"):
        replay_change({0: [model]}, "cpu", Change(bf16_params=True))


def test_a_coarser_wrap_merges_an_hsdp_units_reduces_per_group() -> None:
    from zdiag.analyzers.whatif.counterfactuals import coarser_wrap
    from zdiag.analyzers.whatif.platform import Platform

    ops = []
    for k, pos in (("attn", 600.0), ("mlp", 700.0)):
        rs = call("all_reduce", "3", "reduce", pos, 100.0)
        ar = call("all_reduce", "1", "reduce", pos + 0.5, 50.0)
        ops += [msgspec.structs.replace(op, unit=f"layers.0.{k}") for op in (rs, ar)]
    model = StepModel(step=1, start_us=0.0, duration_us=1300.0, work_us=1000.0, ops=ops)
    out = coarser_wrap(model, "layers", {}, Platform("cpu", False, "test"))
    # layers.0's two units' reduce-scatters merge, and so do their all-reduces: one of each
    assert sorted(op.lane for op in out.ops) == ["1|all_reduce", "3|all_reduce"]


def test_on_two_nodes_hsdp_moves_the_shard_groups_inside_a_node_at_the_stated_speedup() -> None:
    """Flat over 2 nodes of 2 ranks -> 2 x 2: the gathers and reduce-scatters now run inside a
    node, their bytes 4x as fast; the new all-reduce crosses nodes as the old reduce did, so it
    keeps that link. Back from 2 x 2 to flat, the shard group crosses nodes: 4x as slow."""
    fabric = Fabric(ranks_per_node=2, intra_node_speedup=4.0)
    assert fabric.crosses((1, 4), "shard") and not fabric.crosses((2, 2), "shard")
    assert fabric.crosses((2, 2), "replicate") and not fabric.crosses((1, 4), "replicate")
    assert not fabric.crosses((1, 2), "shard")  # one node's worth
    model = flat_step()
    fits = {"0|all_gather": fit("0|all_gather", 60.0), "0|all_reduce": fit("0|all_reduce", 90.0)}
    plain = reshaped(model, DpGroups("0", 4, None, 1), (2, 2), fits)
    out = reshaped(model, DpGroups("0", 4, None, 1), (2, 2), fits, fabric)
    assert out.ops[0].dur_us == pytest.approx(60.0 / 3 + 240.0 * (1 / 2) / (3 / 4) / 4)
    assert out.ops[1].dur_us == pytest.approx(90.0 / 3 + 310.0 * (1 / 2) / (3 / 4) / 4)
    assert out.ops[2].dur_us == pytest.approx(plain.ops[2].dur_us)
    back = reshaped(hsdp_step(), DpGroups("3", 2, "1", 2), (1, 4), {}, fabric)
    assert back.ops[0].dur_us == pytest.approx(300.0 * 1.5 * 4)
    # one node: nothing crosses, every link as measured
    one = reshaped(model, DpGroups("0", 4, None, 1), (2, 2), fits, Fabric(4, 4.0))
    assert [op.dur_us for op in one.ops] == pytest.approx([op.dur_us for op in plain.ops])


def test_replay_change_takes_the_fabric_from_the_nodes_only_when_fsdp_spans_them() -> None:
    sizes = {r: {"0": 4} for r in range(4)}
    models = {r: [flat_step()] for r in range(4)}
    change = Change(mesh_shape=(2, 2))
    plain = replay_change(models, "cpu", change, group_sizes=sizes)
    nodes = ((0, 1), (2, 3))
    two = replay_change(models, "cpu", change, group_sizes=sizes, nodes=nodes)
    assert two.gain_ms > plain.gain_ms
    assert any("moves bytes 2x as fast" in n and "replicate groups none" in n for n in two.notes)
    faster = replay_change(
        models, "cpu", Change(mesh_shape=(2, 2), intra_node_speedup=8.0), group_sizes=sizes,
        nodes=nodes,
    )  # fmt: skip
    assert faster.gain_ms > two.gain_ms
    assert faster.change.label() == "--mesh-shape 2,2 --intra-node-speedup 8"
    # FSDP over 4 of 8 ranks (TP beside it): where its groups sit is not modelled
    wide = replay_change(
        {0: [flat_step()]}, "cpu", Change(mesh_shape=(2, 2)), group_sizes={0: {"0": 4}},
        nodes=((0, 1, 2, 3), (4, 5, 6, 7)),
    )  # fmt: skip
    assert wide.gain_ms == pytest.approx(plain.gain_ms)
    assert any("not modelled" in n for n in wide.notes)
    # one node: the speedup changes nothing, and the text says so
    alone = replay_change(
        models, "cpu", Change(mesh_shape=(2, 2), intra_node_speedup=8.0), group_sizes=sizes,
        nodes=((0, 1, 2, 3),),
    )  # fmt: skip
    assert alone.gain_ms == pytest.approx(plain.gain_ms)
    assert any("--intra-node-speedup changes nothing here" in n for n in alone.notes)
