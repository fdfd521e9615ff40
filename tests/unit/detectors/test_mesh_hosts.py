"""Host-aware mesh advice (issue 26, item 4): a flat FSDP group that spans nodes gets HSDP code
built from the run's host layout (the manifest's node ranks: two launchers on one machine share
a host name, not a node rank), with the cut in cross-node bytes; on a mesh that already has a
TP dimension the run's own mesh is split, never rebuilt as a bare 2-D HSDP mesh; a TP group
across nodes is its own finding."""

from __future__ import annotations

from math import prod
from types import SimpleNamespace
from typing import Any

from zdiag.analyzers.detectors import flat_sharding, tp_across_nodes
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.frameworks import BlockSet, FsdpMesh, RunFacts, fsdp2
from zdiag.analyzers.inputs.model_facts import ModelFacts
from zdiag.analyzers.rank.fsdp_ledger import CollectiveRecord, RankLedger
from zdiag.collectors.model_schema import DeviceMeshInfo, Fsdp2Unit, MeshDim, ModelDescription
from zdiag.collectors.run_records import Manifest

STAGES = BlockSet(container="encoder.stages", block_class="ResidualMLP", count=4)


def manifest(nodes: list[list[int]], host: str = "vm") -> Manifest:
    """A run manifest whose ranks sit on `nodes` (node rank = index), all on one host name."""
    world = sum(len(n) for n in nodes)
    ranks = [
        {"rank": r, "node_rank": k, "host": host, "local_rank": i}
        for k, node in enumerate(nodes)
        for i, r in enumerate(node)
    ]
    doc: dict[str, Any] = {"world_size": world, "nnodes": len(nodes), "ranks": ranks}
    return Manifest.from_json(doc)


def ledger(rank: int = 0) -> RankLedger:
    """Per step one 1 MiB gather and one 1 MiB reduce-scatter, 2 ms exposed each, 2 steps."""
    recs = []
    for step in (1, 2):
        for family, kind in (("all_gather", "all_gather"), ("reduce", "reduce_scatter")):
            t = step * 1e6 + (0 if family == "all_gather" else 5e4)
            recs.append(
                CollectiveRecord(
                    unit="", framework="fsdp2", family=family, kind=kind, phase="", step=step,
                    issued_us=t, issue_end_us=t, start_us=t, end_us=t + 2e3, bytes=1 << 20,
                    dtype="float", exposed_us=2e3,
                )
            )  # fmt: skip
    return RankLedger(
        rank=rank, framework="fsdp2", device="cuda", records=recs, unit_order=[""], steps=[1, 2]
    )


def described(shape: tuple[int, ...], dims: tuple[tuple[str, str], ...]) -> ModelFacts:
    names = tuple(n for n, _ in dims)
    fsdp = tuple(n for n, role in dims if role in ("shard", "replicate"))
    mesh = DeviceMeshInfo(
        shape=shape,
        dim_names=names,
        device_type="cuda",
        ranks=tuple(range(prod(shape))),
        dims=tuple(MeshDim(n, s, role) for (n, role), s in zip(dims, shape, strict=True)),
    )
    unit = Fsdp2Unit(path="", cls="TabResNet", mesh_dim_names=fsdp, hsdp=len(fsdp) == 2)
    return ModelFacts(ModelDescription(framework="fsdp2", fsdp2_units=(unit,), mesh=mesh))


def test_nodes_come_from_the_launchers_node_ranks_not_the_host_name() -> None:
    ctx = DetectorContext(ledgers={0: ledger()}, manifest=manifest([[0, 1], [2, 3]]))
    assert ctx.sheet.hosts == frozenset({"vm"})  # one machine, two "nodes"
    assert ctx.sheet.nodes == ((0, 1), (2, 3))


def test_flat_fsdp_across_two_nodes_gets_hsdp_from_the_host_layout() -> None:
    ctx = DetectorContext(ledgers={0: ledger()}, manifest=manifest([[0, 1], [2, 3]]))
    (f,) = flat_sharding.detect(ctx)
    assert f.title == "FSDP shards across all 4 ranks on 2 nodes"
    assert 'mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("replicate", "shard"))' in (
        f.code or ""
    )
    # now: half of each 1 MiB gather and reduce-scatter comes from / goes to the other node;
    # HSDP: the ring all-reduce of the 1/2 gradient shard across 2 replicas
    assert f.evidence["cross_node_bytes_per_step_per_rank"] == {"now": 1 << 20, "hsdp": 1 << 19}


def test_nodes_holding_interleaved_ranks_get_an_explicit_device_mesh() -> None:
    ctx = DetectorContext(ledgers={0: ledger()}, manifest=manifest([[0, 2], [1, 3]]))
    (f,) = flat_sharding.detect(ctx)
    assert 'mesh = DeviceMesh("cuda", [[0, 2], [1, 3]], mesh_dim_names=("replicate", "shard"))' in (
        f.code or ""
    )
    assert "from torch.distributed.device_mesh import DeviceMesh" in (f.code or "")


def test_one_node_or_already_hsdp_is_no_finding() -> None:
    assert (
        flat_sharding.detect(
            DetectorContext(ledgers={0: ledger()}, manifest=manifest([[0, 1, 2, 3]]))
        )
        == []
    )
    hsdp = described((2, 2), (("replicate", "replicate"), ("shard", "shard")))
    ctx = DetectorContext(ledgers={0: ledger()}, manifest=manifest([[0, 1], [2, 3]]), model=hsdp)
    assert flat_sharding.detect(ctx) == []


def test_fsdp_tp_run_with_dp_across_nodes_splits_its_own_mesh() -> None:
    """(dp=4, tp=2) on 2 nodes of 4: "dp" groups {0,2,4,6} span both nodes. The code keeps the
    run's "tp" and splits "dp" into dp_replicate x dp_shard (not a bare ("replicate", "shard")
    mesh from the node count, which would drop the TP dimension), and flattens the pair back
    into "dp": the script's other `mesh["dp"]` (its data's rank) still runs once pasted (without
    it: KeyError, tests/integration/runs/test_mesh_split_dp.py)."""
    model = described((4, 2), (("dp", "shard"), ("tp", "tp")))
    ctx = DetectorContext(
        ledgers={0: ledger()}, manifest=manifest([[0, 1, 2, 3], [4, 5, 6, 7]]), model=model
    )
    (f,) = flat_sharding.detect(ctx)
    code = f.code or ""
    assert f.title == "FSDP shards across 4 ranks on 2 nodes"
    assert f.evidence["fsdp_group"] == [0, 2, 4, 6]
    assert (
        'mesh = init_device_mesh("cuda", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", '
        '"tp"))\ndp_mesh = mesh["dp_replicate", "dp_shard"]\ndp_mesh._flatten("dp")  # '
    ) in code
    assert code.endswith("fully_shard(block, mesh=dp_mesh)  # for each block, then the root")
    assert '("replicate", "shard")' not in code
    compile(code, "<remedy>", "exec")
    # 2 replicas, shards of 2: now 1/2 of (gather + reduce-scatter); HSDP 2*(1/2) * 1 MiB / 2
    assert f.evidence["cross_node_bytes_per_step_per_rank"] == {"now": 1 << 20, "hsdp": 1 << 19}


def test_split_dp_keeps_shard_groups_on_one_node() -> None:
    from zdiag.analyzers.frameworks.hsdp_layout import groups_along, split_dp

    mesh = FsdpMesh((4, 2), ("dp", "tp"), "cuda", tuple(range(8)), ("dp",))
    layout = split_dp(mesh, ((0, 1, 2, 3), (4, 5, 6, 7)))
    assert layout is not None and layout.shape == (2, 2, 2)
    assert groups_along(layout.shape, layout.ranks, 1) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # split in place: (dp_replicate, dp_shard) flattened is the old "dp", the same ranks in order
    flat = groups_along((4, 2), layout.ranks, 0)
    assert flat == groups_along(mesh.shape, mesh.ranks, 0) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert split_dp(mesh, ((0, 1, 2, 3, 4, 5, 6, 7),)) is None  # one node: nothing to split
    facts = RunFacts(
        framework="fsdp2", blocks=STAGES, mesh=mesh, nodes=((0, 1, 2, 3), (4, 5, 6, 7))
    )
    assert fsdp2.hybrid_shard(facts) is not None
    assert fsdp2.hybrid_shard(RunFacts(framework="fsdp2", blocks=STAGES, mesh=mesh)) is None


def test_tp_group_across_nodes_is_its_own_finding_with_tp_last() -> None:
    model = described((2, 2), (("tp", "tp"), ("dp", "shard")))  # tp first: groups {0,2}, {1,3}
    ctx = DetectorContext(ledgers={0: ledger()}, manifest=manifest([[0, 1], [2, 3]]), model=model)
    (f,) = tp_across_nodes.detect(ctx)
    assert f.evidence["crossing_groups"] == [[0, 2], [1, 3]]
    assert (f.code or "").endswith(
        'mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))'
    )
    ok = described((2, 2), (("dp", "shard"), ("tp", "tp")))
    ctx_ok = DetectorContext(ledgers={0: ledger()}, manifest=manifest([[0, 1], [2, 3]]), model=ok)
    assert tp_across_nodes.detect(ctx_ok) == []


def test_tp_across_nodes_takes_its_gain_from_the_mesh_order_replay() -> None:
    """Each rank's step: a blocking 400 us TP all-reduce on its TP group (across nodes, tp
    first). With "tp" last it runs inside a node at the stated 2x: 200 us saved per step."""
    from zdiag.analyzers.rank.declared_groups import ProcessGroupInfo
    from zdiag.analyzers.rank.rank_analysis import RankFacts
    from zdiag.analyzers.rank.step_model import ModelOp, StepModel

    def facts(rank: int) -> RankFacts:
        tp = [rank % 2, rank % 2 + 2]
        return RankFacts(process_groups=[ProcessGroupInfo(name="1", size=2, ranks=tp)])

    tp_op = ModelOp(
        kind="all_reduce", lane="1|all_reduce", issue_pos_us=100.0, after=-1, delay_us=0.0,
        dur_us=400.0, wait_pos_us=100.0, bytes=4000,
    )  # fmt: skip
    model = StepModel(step=1, start_us=0.0, duration_us=1400.0, work_us=1000.0, ops=[tp_op])
    ctx = DetectorContext(
        ledgers={0: ledger()},
        manifest=manifest([[0, 1], [2, 3]]),
        model=described((2, 2), (("tp", "tp"), ("dp", "shard"))),
        facts={r: facts(r) for r in range(4)},
        step_models={r: [model] for r in range(4)},
        device="cpu",
    )
    (f,) = tp_across_nodes.detect(ctx)
    assert f.expected_gain_ms == 0.2
    assert f.gain_method.startswith("replayed (zdiag whatif --mesh-order dp,tp)")
    # without modelled steps: not estimated, and the text says why
    bare = DetectorContext(
        ledgers={0: ledger()}, manifest=manifest([[0, 1], [2, 3]]),
        model=described((2, 2), (("tp", "tp"), ("dp", "shard"))),
    )  # fmt: skip
    (g,) = tp_across_nodes.detect(bare)
    assert g.expected_gain_ms is None and g.gain_method.startswith("not estimated")


def test_tp_wider_than_a_node_gets_no_code() -> None:
    model = described((1, 4), (("dp", "shard"), ("tp", "tp")))
    ctx = DetectorContext(ledgers={0: ledger()}, manifest=manifest([[0, 1], [2, 3]]), model=model)
    (f,) = tp_across_nodes.detect(ctx)
    assert f.code is None and "divides the ranks per node (2)" in f.recommendation


def test_flat_sharding_keeps_its_old_code_without_node_ranks() -> None:
    lg = SimpleNamespace(
        rank=0, framework="fsdp2", records=ledger().records, steps=[1, 2], unit_order=[],
        gathers=[], reduces=[],
    )  # fmt: skip
    ctx = DetectorContext(
        ledgers={0: lg},  # type: ignore[dict-item]
        manifest=Manifest.from_json({"world_size": 16, "nnodes": 2}),
    )
    (f,) = flat_sharding.detect(ctx)
    assert 'init_device_mesh("cuda", (2, 8), mesh_dim_names=("replicate", "shard"))' in (
        f.code or ""
    )


def test_tp_filling_each_node_gets_no_hsdp_split() -> None:
    """(dp=2, tp=2) on 2 nodes of 2: each dp group spans both nodes, but a dp_shard of one rank
    would be plain replication (DDP), not HSDP: no finding."""
    model = described((2, 2), (("dp", "shard"), ("tp", "tp")))
    ctx = DetectorContext(ledgers={0: ledger()}, manifest=manifest([[0, 1], [2, 3]]), model=model)
    assert flat_sharding.detect(ctx) == []


def test_tp_across_nodes_from_the_trace_headers_without_a_captured_mesh() -> None:
    """Traces recorded elsewhere: the "mesh_tp" groups of the pg_config, on nodes from the
    manifest; no mesh to rebuild, so no code."""
    from zdiag.analyzers.rank.declared_groups import ProcessGroupInfo
    from zdiag.analyzers.rank.rank_analysis import RankFacts

    def facts(tp: list[int]) -> RankFacts:
        return RankFacts(
            process_groups=[ProcessGroupInfo(name="3", description="mesh_tp", size=2, ranks=tp)]
        )

    ctx = DetectorContext(
        ledgers={0: ledger()},
        manifest=manifest([[0, 1], [2, 3]]),
        facts={0: facts([0, 2]), 1: facts([1, 3]), 2: facts([0, 2]), 3: facts([1, 3])},
    )
    (f,) = tp_across_nodes.detect(ctx)
    assert f.evidence["crossing_groups"] == [[0, 2], [1, 3]]
    assert f.code is None and "divides the ranks per node (2)" in f.recommendation
    ok = DetectorContext(
        ledgers={0: ledger()},
        manifest=manifest([[0, 1], [2, 3]]),
        facts={0: facts([0, 1]), 2: facts([2, 3])},
    )
    assert tp_across_nodes.detect(ok) == []


def test_comm_bound_offers_hsdp_only_to_a_run_that_shards_across_nodes() -> None:
    """comm-bound lists HSDP among what would help only while FSDP shards across nodes: never to
    a run on one node, nor to one that already replicates across them."""
    from zdiag.analyzers.detectors import comm_bound
    from zdiag.analyzers.report import StepBreakdown

    def bound_step(n: int) -> StepBreakdown:
        return StepBreakdown(
            step=n, duration_ms=100.0, compute_ms=30.0, comm_ms=60.0, overlapped_ms=20.0,
            exposed_comm_ms=40.0, idle_ms=10.0, verdict="comm-bound",
        )  # fmt: skip

    def advice(nodes: list[list[int]], model: ModelFacts | None = None) -> str:
        ctx = DetectorContext(
            ledgers={0: ledger()},
            breakdowns={0: [bound_step(1), bound_step(2)]},
            manifest=manifest(nodes),
            model=model,
        )
        (f,) = comm_bound.detect(ctx)
        return f.recommendation

    assert "HSDP" in advice([[0, 1], [2, 3]])
    assert "HSDP" not in advice([[0, 1, 2, 3]])
    hsdp = described((2, 2), (("replicate", "replicate"), ("shard", "shard")))
    assert "HSDP" not in advice([[0, 1], [2, 3]], hsdp)
