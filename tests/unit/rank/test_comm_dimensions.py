"""Communication by mesh dimension (issue 26 item 3): the map's per-step split
(`rank/comm_dimensions.py`) and the reduce's roles (`run/comm_dimensions.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from msgspec import UNSET

from support.mesh_traces import hsdp_job
from support.traces import TraceBuilder, small_job
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.inputs.mesh_facts import MeshDimFacts, MeshFacts
from zdiag.analyzers.rank.comm_dimensions import dimension_labels
from zdiag.analyzers.rank.declared_groups import ProcessGroupInfo
from zdiag.analyzers.rank.rank_analysis import RankContext, analyze_rank
from zdiag.analyzers.report import DimensionComm, StepBreakdown, encode_report
from zdiag.analyzers.run.comm_dimensions import dimension_role

TP_PGS = [
    {"pg_name": "0", "pg_desc": "default_pg", "pg_size": 4, "ranks": [0, 1, 2, 3]},
    {"pg_name": "1", "pg_desc": "mesh_dp", "pg_size": 2, "ranks": [0, 2]},
    {"pg_name": "3", "pg_desc": "mesh_tp", "pg_size": 2, "ranks": [0, 1]},
]


def _dims(step: StepBreakdown) -> dict[str, DimensionComm]:
    assert step.comm_by_dimension is not UNSET
    return {d.dimension: d for d in step.comm_by_dimension}


def test_hsdp_steps_split_by_shard_and_replicate_and_add_up(tmp_path: Path) -> None:
    report = analyze_paths([hsdp_job(tmp_path / "run")])
    for rank in report.ranks:
        assert len(rank.steps) == 3
        for step in rank.steps:
            dims = _dims(step)
            assert set(dims) == {"shard", "replicate"}  # no "other": every call has its group
            assert dims["shard"].calls == 3 and dims["replicate"].calls == 1
            # ranks 0, 1: 3 x 1.8 ms all-gathers, then a 1.5 ms all-reduce; ranks 2, 3 gather
            # 1.5 ms later, so their last gather shares 0.8 ms with the all-reduce: half each
            shard_ms, replicate_ms = (5.4, 1.5) if rank.rank < 2 else (5.0, 1.1)
            assert dims["shard"].comm_ms == pytest.approx(shard_ms)
            assert dims["replicate"].comm_ms == pytest.approx(replicate_ms)
            assert sum(d.comm_ms for d in dims.values()) == pytest.approx(step.comm_ms, abs=1e-5)
            assert sum(d.exposed_comm_ms for d in dims.values()) == pytest.approx(
                step.exposed_comm_ms, abs=1e-5
            )
    by_name = {d.name: d for d in report.comm_dimensions}  # type: ignore[union-attr]
    shard, replicate = by_name["shard"], by_name["replicate"]
    assert (shard.role, shard.role_source, shard.group_size) == ("dp-shard", "name", 2)
    assert (replicate.role, replicate.group_size, replicate.kinds) == (
        "dp-replicate",
        2,
        ["all_reduce"],
    )
    assert shard.kinds == ["all_gather"] and shard.ranks == [0, 1, 2, 3]
    assert shard.comm_ms_per_step == pytest.approx(5.2)  # mean over the ranks


def _overlapping_rank(folder: Path) -> Path:
    """Rank 0 of a (dp, tp) mesh, one 10 ms step: compute 0-4 ms, a dp all-gather 2-6 ms and a
    tp all-reduce 5-7 ms on other streams."""
    folder.mkdir()
    b = TraceBuilder(rank=0, world_size=4)
    b.doc["distributedInfo"]["pg_config"] = TP_PGS
    b.step(0, 0, 10_000)
    b.kernel("sm90_gemm", 0, 4_000, launch_at=0)
    for name, pg, start, dur, stream in (
        ("allgather", "1", 2_000, 4_000, 20),
        ("allreduce", "3", 5_000, 2_000, 21),
    ):
        kernel = "AllGather_RING_LL" if name == "allgather" else "AllReduce_Sum_f32_RING_LL"
        b.kernel(
            f"ncclDevKernel_{kernel}",
            start,
            dur,
            stream=stream,
            launch_at=start - 10,
            args={"Collective name": name, "Process Group Name": pg, "Group size": 2},
        )
    return b.write(folder / "rank-0.json")


def test_overlapping_dimensions_share_time_and_exposure(tmp_path: Path) -> None:
    """dp alone 2-5 ms (2-4 under compute), both 5-6 ms (half each), tp alone 6-7 ms."""
    analysis = analyze_rank(load_rank_trace(_overlapping_rank(tmp_path / "run")))
    (step,) = analysis.breakdown
    assert (step.comm_ms, step.exposed_comm_ms) == pytest.approx((5.0, 3.0))
    dims = _dims(step)
    assert set(dims) == {"dp", "tp"}
    assert (dims["dp"].comm_ms, dims["dp"].exposed_comm_ms) == pytest.approx((3.5, 1.5))
    assert (dims["tp"].comm_ms, dims["tp"].exposed_comm_ms) == pytest.approx((1.5, 1.5))
    assert dims["dp"].calls == dims["tp"].calls == 1


def test_gloo_waits_take_the_dimension_they_wait_for(tmp_path: Path) -> None:
    """Host-only: the gloo ops name no group (their threads give it); the training thread's
    wait, not a collective of the table, goes to the dimension whose call it waits for."""
    b = TraceBuilder(rank=0, world_size=4, backend="gloo", gpu_name=None)
    b.doc["distributedInfo"]["pg_config"] = TP_PGS
    b.step(0, 0, 10_000)
    b.cpu_op("aten::mm", 0, 1_000)
    b.cpu_op("gloo:all_gather", 1_000, 2_000, tid=50)  # dp, 1-3 ms
    b.cpu_op("gloo:all_reduce", 4_000, 2_000, tid=60)  # tp, 4-6 ms
    b.cpu_op("_c10d_functional::wait_tensor", 4_500, 1_600)  # waits for tp, 4.5-6.1 ms
    path = b.write(tmp_path / "rank-0.json")
    context = RankContext(thread_groups={50: "1", 60: "3"})
    (step,) = analyze_rank(load_rank_trace(path), context).breakdown
    dims = _dims(step)
    assert set(dims) == {"dp", "tp"}
    assert dims["dp"].comm_ms == pytest.approx(2.0)
    assert dims["tp"].comm_ms == pytest.approx(2.1)  # 4-6 ms and the wait's 0.1 ms after it
    assert step.comm_ms == pytest.approx(4.1)


def test_single_group_runs_have_no_split_in_json(tmp_path: Path) -> None:
    report = analyze_paths([small_job(tmp_path / "run", ranks=2, late=None)])
    assert report.ranks and all(s.comm_by_dimension is UNSET for r in report.ranks for s in r.steps)
    assert report.comm_dimensions is UNSET
    data = encode_report(report)
    assert b"comm_by_dimension" not in data and b"comm_dimensions" not in data


def test_calls_of_no_known_dimension_do_not_make_a_split(tmp_path: Path) -> None:
    """As in a vLLM trace: all-reduces naming no group on a rank of groups of different members
    ("other") and one all-gather on a declared group, no DeviceMesh: one dimension only, so no
    split."""
    b = TraceBuilder(rank=0, world_size=4)
    b.doc["distributedInfo"]["pg_config"] = [
        {"pg_name": "0", "pg_desc": "default_pg", "pg_size": 4, "ranks": [0, 1, 2, 3]},
        {"pg_name": "1", "pg_desc": "undefined", "pg_size": 4, "ranks": [0, 1, 2, 3]},
        {"pg_name": "5", "pg_desc": "undefined", "pg_size": 1, "ranks": [0]},
    ]
    b.step(0, 0, 10_000)
    for start, pg in ((1_000, ""), (3_000, ""), (5_000, "1")):
        args = {"Collective name": "allreduce", "Group size": 2}
        if pg:
            args["Process Group Name"] = pg
        b.kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", start, 1_000, 20, start - 10, args)
    (step,) = analyze_rank(load_rank_trace(b.write(tmp_path / "rank-0.json"))).breakdown
    assert step.comm_ms == pytest.approx(3.0) and step.comm_by_dimension is UNSET


def test_a_mesh_rank_with_one_dimension_and_other_is_split(tmp_path: Path) -> None:
    """A (dp, pp) mesh on gloo: the gloo point-to-point calls run on the calling thread, which no
    group's thread map names ("other"); on a rank of a 2-D mesh that still makes a split."""
    b = TraceBuilder(rank=0, world_size=4, backend="gloo", gpu_name=None)
    b.doc["distributedInfo"]["pg_config"] = [
        {"pg_name": "0", "pg_desc": "default_pg", "pg_size": 4, "ranks": [0, 1, 2, 3]},
        {"pg_name": "1", "pg_desc": "mesh_dp", "pg_size": 2, "ranks": [0, 2]},
        {"pg_name": "3", "pg_desc": "mesh_pp", "pg_size": 2, "ranks": [0, 1]},
    ]
    b.step(0, 0, 10_000)
    b.cpu_op("gloo:all_gather", 1_000, 2_000, tid=50)
    b.cpu_op("gloo:send", 5_000, 500)
    context = RankContext(thread_groups={50: "1"})
    (step,) = analyze_rank(load_rank_trace(b.write(tmp_path / "rank-0.json")), context).breakdown
    dims = _dims(step)
    assert (dims["dp"].comm_ms, dims["other"].comm_ms) == pytest.approx((2.0, 0.5))
    assert dims["other"].calls == 1


def test_dimension_labels_of_group_names() -> None:
    infos = [
        ProcessGroupInfo(name="0", description="default_pg", ranks=[0, 1, 2, 3]),
        ProcessGroupInfo(name="1", description="mesh_dp", ranks=[0, 2]),
        ProcessGroupInfo(name="5", description="undefined", ranks=[0, 1]),
        ProcessGroupInfo(name="6", description="my_pp", ranks=[0, 3]),
    ]
    assert dimension_labels(infos, ["0", "1", "5", "6", "9", ""]) == [
        "world",
        "dp",
        "group 5",
        "my_pp",
        "other",  # not declared
        "other",  # names no group on a rank of several groups
    ]
    one = [ProcessGroupInfo(name="0", description="default_pg", ranks=[0, 1])]
    assert dimension_labels(one, [""]) == ["world"]


def test_dimension_roles_mesh_first_then_names_then_kinds() -> None:
    mesh = MeshFacts(
        shape=(2, 2),
        dim_names=("a", "b"),
        ranks=(0, 1, 2, 3),
        dims=(MeshDimFacts("a", 2, "replicate"), MeshDimFacts("b", 2, "tp")),
    )
    assert dimension_role("a", ["all_reduce"], mesh) == ("dp-replicate", "mesh")
    assert dimension_role("b", ["all_reduce"], mesh) == ("tp", "mesh")
    assert dimension_role("tp", ["all_reduce"], None) == ("tp", "name")
    assert dimension_role("dp_shard", [], None) == ("dp-shard", "name")
    assert dimension_role("cp", [], None) == ("cp", "name")
    assert dimension_role("pipe", [], None) == ("pp", "name")
    assert dimension_role("group 7", ["send_recv"], None) == ("pp", "kinds")
    assert dimension_role("world", ["all_gather", "reduce_scatter"], None) == ("dp-shard", "kinds")
    assert dimension_role("other", ["all_reduce"], None) == ("other", "")
