"""Detectors that know the mesh (issue 26, item 4): tensor-parallel collectives are not FSDP
traffic, so they never make a step comm-bound in FSDP's name. The TP dimension is known from the
captured mesh, or from the trace header's pg_config descriptions ("mesh_tp")."""

from __future__ import annotations

from types import SimpleNamespace

from zdiag.analyzers.detectors import comm_bound, replicate_allreduce
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.inputs.model_facts import ModelFacts
from zdiag.analyzers.rank.declared_groups import ProcessGroupInfo
from zdiag.analyzers.rank.fsdp_ledger import CollectiveRecord, RankLedger
from zdiag.analyzers.rank.rank_analysis import RankFacts
from zdiag.analyzers.report import StepBreakdown
from zdiag.collectors.model_schema import (
    DeviceMeshInfo,
    Fsdp2Unit,
    MeshDim,
    ModelDescription,
    Precision,
)

# rank 0 of a (dp=2, tp=2) mesh: dp {0, 2}, tp {0, 1}
FSDP_TP_GROUPS = [
    ProcessGroupInfo(name="0", description="default_pg", size=4, ranks=[0, 1, 2, 3]),
    ProcessGroupInfo(name="1", description="mesh_dp", size=2, ranks=[0, 2]),
    ProcessGroupInfo(name="3", description="mesh_tp", size=2, ranks=[0, 1]),
]


def step(n: int) -> StepBreakdown:
    """A step whose communication (60 ms: TP all-reduces and FSDP collectives together) is twice
    its compute: comm-bound by the step verdict."""
    return StepBreakdown(
        step=n,
        duration_ms=100.0,
        compute_ms=30.0,
        comm_ms=60.0,
        overlapped_ms=20.0,
        exposed_comm_ms=40.0,
        idle_ms=10.0,
        verdict="comm-bound",
    )


def fsdp_ledger() -> SimpleNamespace:
    """Rank 0's FSDP ledger: per step one 5 ms gather and one 5 ms reduce, 4 ms of it exposed
    each (the 50 ms rest of the step's communication is tensor-parallel)."""
    records = []
    for n in (1, 2):
        base = n * 1e6
        for family, start in (("all_gather", base), ("reduce", base + 50e3)):
            records.append(
                SimpleNamespace(
                    family=family,
                    step=n,
                    start_us=start,
                    end_us=start + 5e3,
                    exposed_us=4e3,
                    dtype="float",
                )
            )
    gathers = [r for r in records if r.family == "all_gather"]
    return SimpleNamespace(
        rank=0, framework="fsdp2", records=records, gathers=gathers, unit_order=[], steps=[1, 2]
    )


def context(**kw: object) -> DetectorContext:
    return DetectorContext(
        ledgers={0: fsdp_ledger()},  # type: ignore[dict-item]
        breakdowns={0: [step(1), step(2)]},
        **kw,  # type: ignore[arg-type]
    )


def fsdp_tp_model() -> ModelFacts:
    """A captured FSDP2 + TP description: (2, 2) mesh ("dp", "tp"), FSDP shards over "dp"."""
    mesh = DeviceMeshInfo(
        shape=(2, 2),
        dim_names=("dp", "tp"),
        device_type="cpu",
        ranks=(0, 1, 2, 3),
        dims=(MeshDim("dp", 2, "shard"), MeshDim("tp", 2, "tp")),
    )
    unit = Fsdp2Unit(path="", cls="TabResNet", mesh_dim_names=("dp",))
    return ModelFacts(ModelDescription(framework="fsdp2", fsdp2_units=(unit,), mesh=mesh))


def test_flat_run_is_judged_on_all_its_communication_as_before() -> None:
    (f,) = comm_bound.detect(context())
    assert f.evidence["comm_ms_per_step"] == 60.0
    assert "tensor_parallel_left_out" not in f.evidence
    assert "steps are comm-bound: communication (60.0 ms/step)" in f.title


def test_tp_collectives_never_make_fsdp_comm_bound_from_pg_config() -> None:
    """No captured model: the trace header says which groups are "mesh_tp"; FSDP's own 10 ms per
    step is a third of the compute, so nothing is comm-bound in FSDP's name."""
    ctx = context(facts={0: RankFacts(process_groups=FSDP_TP_GROUPS)})
    assert ctx.tensor_parallel
    assert ctx.group_roles == {(0, 2): "shard", (0, 1): "tp"}
    assert comm_bound.detect(ctx) == []


def test_tp_collectives_never_make_fsdp_comm_bound_from_the_captured_mesh() -> None:
    ctx = context(model=fsdp_tp_model())
    assert ctx.tensor_parallel
    assert ctx.group_roles == {(0, 2): "shard", (1, 3): "shard", (0, 1): "tp", (2, 3): "tp"}
    assert comm_bound.detect(ctx) == []


def test_fsdp_comm_alone_above_compute_is_still_comm_bound_on_a_tp_run() -> None:
    """FSDP's collectives alone exceed compute: the finding stays, on FSDP's numbers only."""
    slow = fsdp_ledger()
    for r in slow.records:
        r.end_us = r.start_us + 40e3
        r.exposed_us = 20e3
    ctx = DetectorContext(
        ledgers={0: slow},  # type: ignore[dict-item]
        breakdowns={0: [step(1), step(2)]},
        facts={0: RankFacts(process_groups=FSDP_TP_GROUPS)},
    )
    (f,) = comm_bound.detect(ctx)
    assert f.evidence["tensor_parallel_left_out"] is True
    assert f.evidence["comm_ms_per_step"] == 80.0
    assert "FSDP communication (80.0 ms/step)" in f.title
    assert f.expected_gain_ms == 50.0


def test_hsdp_groups_are_not_tensor_parallel() -> None:
    groups = [
        ProcessGroupInfo(name="1", description="mesh_replicate", size=2, ranks=[0, 2]),
        ProcessGroupInfo(name="3", description="mesh_shard", size=2, ranks=[0, 1]),
    ]
    ctx = context(facts={0: RankFacts(process_groups=groups)})
    assert ctx.group_roles == {(0, 2): "replicate", (0, 1): "shard"}
    assert not ctx.tensor_parallel
    assert len(comm_bound.detect(ctx)) == 1


# --- exposed-replicate-allreduce (HSDP) ---------------------------------------------------

HSDP_GROUPS = [
    ProcessGroupInfo(name="1", description="mesh_replicate", size=2, ranks=[0, 2]),
    ProcessGroupInfo(name="3", description="mesh_shard", size=2, ranks=[0, 1]),
]


def hsdp_ledger(
    micro_batches: int = 1, all_reduce_per_pass: bool = True, nccl: bool = False
) -> RankLedger:
    """Rank 0 of a gloo (or NCCL) HSDP run, 2 steps of 100 ms, 2 units; per unit and backward
    pass a 1 ms reduce-scatter then a 4 ms all-reduce (exposed 4 ms), the all-reduce only on the
    last pass when `all_reduce_per_pass` is False."""
    recs = []
    for step_no in (1, 2):
        t = step_no * 1e6
        for k in range(micro_batches):
            for unit in ("encoder.stages.0", ""):
                pairs = [("reduce_scatter" if nccl else "all_reduce", 1e3)]
                if all_reduce_per_pass or k == micro_batches - 1:
                    pairs.append(("all_reduce", 4e3))
                for kind, dur in pairs:
                    recs.append(
                        CollectiveRecord(
                            unit=unit, framework="fsdp2", family="reduce", kind=kind,
                            phase="", step=step_no, issued_us=t, issue_end_us=t, start_us=t,
                            end_us=t + dur, bytes=-1, dtype="", exposed_us=dur,
                        )
                    )  # fmt: skip
                    t += dur
    return RankLedger(
        rank=0, framework="fsdp2", device="cpu", records=recs, steps=[1, 2], window_us=200e3
    )


def hsdp_ctx(
    lg: RankLedger, model: ModelFacts | None = None, groups: bool = True
) -> DetectorContext:
    """The ledger's context; `groups`: each record's group is known (gloo: by its thread), the
    4 ms all-reduces ran in the replicate group {0, 2}, the reduce-scatters in the shard group."""
    members: dict[float, tuple[int, ...]] = {
        round(r.start_us, 3): (0, 2) if r.dur_us == 4e3 else (0, 1) for r in lg.records
    }
    return DetectorContext(
        ledgers={0: lg},
        facts={0: RankFacts(process_groups=HSDP_GROUPS)},
        model=model,
        record_members={0: members} if groups else {},
    )


def test_exposed_replicate_all_reduce_single_pass_proposes_bf16_reduce() -> None:
    (f,) = replicate_allreduce.detect(hsdp_ctx(hsdp_ledger()))
    assert f.id == "exposed-replicate-allreduce"
    assert f.evidence["all_reduces_per_step"] == 2
    assert f.evidence["micro_batches_per_step"] == 1
    assert f.evidence["exposed_all_reduce_ms_per_step"] == 8.0  # 2 x 4 ms, not the reduce-scatters
    assert f.evidence["last_all_reduce_exposed_ms_per_step"] == 4.0
    assert "reduce_dtype=torch.bfloat16" in (f.code or "")
    assert f.expected_gain_ms == 4.0  # sizes unknown: at most half


def test_nccl_kinds_tell_the_all_reduces_apart_gloo_needs_the_groups() -> None:
    (f,) = replicate_allreduce.detect(hsdp_ctx(hsdp_ledger(nccl=True), groups=False))
    assert f.evidence["exposed_all_reduce_ms_per_step"] == 8.0
    # gloo runs the reduce-scatters as all-reduces too: without the groups, nothing is said
    assert replicate_allreduce.detect(hsdp_ctx(hsdp_ledger(), groups=False)) == []


def test_micro_batches_each_all_reduced_get_set_requires_all_reduce() -> None:
    (f,) = replicate_allreduce.detect(hsdp_ctx(hsdp_ledger(micro_batches=4)))
    assert f.evidence["micro_batches_per_step"] == 4
    assert f.evidence["exposed_all_reduce_ms_per_step"] == 32.0
    assert f.code is not None and "model.set_requires_all_reduce(i == 3)" in f.code
    assert f.expected_gain_ms == 24.0  # 3 of 4 all-reduces skipped


def test_run_already_all_reducing_once_per_step_is_not_told_to() -> None:
    """Micro-batches whose earlier passes skip the all-reduce: no set_requires_all_reduce; the
    bf16 reduce remains, unless the run already reduces in bf16."""
    lg = hsdp_ledger(micro_batches=3, all_reduce_per_pass=False)
    (f,) = replicate_allreduce.detect(hsdp_ctx(lg))
    assert f.evidence["micro_batches_per_step"] == 3
    assert "set_requires_all_reduce" not in (f.code or "")
    assert "reduce_dtype=torch.bfloat16" in (f.code or "")
    bf16 = hsdp_model(reduce_dtype="bfloat16")
    assert replicate_allreduce.detect(hsdp_ctx(lg, bf16)) == []
    bf16_params = hsdp_model(param_dtype="bfloat16")  # reduces in param_dtype when unset
    assert replicate_allreduce.detect(hsdp_ctx(lg, bf16_params)) == []


def test_bf16_reduce_code_uses_the_runs_mesh_and_keeps_its_param_dtype() -> None:
    ctx = hsdp_ctx(hsdp_ledger(), hsdp_model(param_dtype="float16"))
    (f,) = replicate_allreduce.detect(ctx)
    code = f.code or ""
    assert 'mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))' in code
    assert (
        "mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.bfloat16)" in code
    )
    assert "fully_shard(block, mesh=mesh, mp_policy=mp)" in code


def test_no_finding_without_hsdp_or_below_the_threshold() -> None:
    flat = DetectorContext(ledgers={0: hsdp_ledger()})
    assert replicate_allreduce.detect(flat) == []
    tp = DetectorContext(ledgers={0: hsdp_ledger()}, model=fsdp_tp_model())
    assert replicate_allreduce.detect(tp) == []
    long_steps = hsdp_ledger()
    long_steps.window_us = 400e3  # 8 ms of 200 ms steps: 4%
    assert replicate_allreduce.detect(hsdp_ctx(long_steps)) == []


def hsdp_model(param_dtype: str | None = None, reduce_dtype: str | None = None) -> ModelFacts:
    """A captured HSDP description: (2, 2) ("replicate", "shard"), 2 block units + root."""
    mesh = DeviceMeshInfo(
        shape=(2, 2),
        dim_names=("replicate", "shard"),
        device_type="cpu",
        ranks=(0, 1, 2, 3),
        dims=(MeshDim("replicate", 2, "replicate"), MeshDim("shard", 2, "shard")),
    )
    mp = Precision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    units = tuple(
        Fsdp2Unit(path=p, cls="X", mesh_dim_names=("replicate", "shard"), hsdp=True,
                  mixed_precision=mp)
        for p in ("", "encoder.stages.0", "encoder.stages.1")
    )  # fmt: skip
    return ModelFacts(ModelDescription(framework="fsdp2", fsdp2_units=units, mesh=mesh))


def test_a_record_that_ran_in_a_tp_group_is_no_fsdp_traffic() -> None:
    """A collective the ledger took for an FSDP one (issued under an FSDP label) but that ran in
    the tensor-parallel group {0, 1} is left out of every FSDP detector's ledger; the dp gathers
    stay. On real FSDP2 + TP runs none is (tests/integration/runs/test_mesh_detector_runs.py)."""

    def gather(t: float) -> CollectiveRecord:
        return CollectiveRecord(
            unit="", framework="fsdp2", family="all_gather", kind="all_gather", phase="",
            step=1, issued_us=t, issue_end_us=t, start_us=t, end_us=t + 1e3, bytes=4096,
            dtype="float", exposed_us=1e3,
        )  # fmt: skip

    lg = RankLedger(
        rank=0, framework="fsdp2", device="cpu", records=[gather(0.0), gather(5e3)], unit_order=[""]
    )
    members: dict[float, tuple[int, ...]] = {0.0: (0, 2), 5000.0: (0, 1)}
    ctx = DetectorContext(
        ledgers={0: lg},
        facts={0: RankFacts(process_groups=FSDP_TP_GROUPS)},
        record_members={0: members},
    )
    (kept,) = ctx.fsdp_ledgers()
    assert [r.start_us for r in kept.records] == [0.0]
    assert kept.units()[0].all_gather_count == 1
    flat = DetectorContext(ledgers={0: lg}, record_members={0: members})
    assert len(flat.fsdp_ledgers()[0].records) == 2  # no TP dimension: nothing left out


def test_comm_bound_title_never_contradicts_its_numbers() -> None:
    """Issue 30 (a ViT run): "communication (357.7 ms/step) exceeds compute (442.9 ms/step)":
    the title's means came from every step, the verdict from the comm-bound ones."""
    from types import SimpleNamespace

    from zdiag.analyzers.report import StepBreakdown

    def step(i: int, verdict: str, compute: float, comm: float) -> StepBreakdown:
        return StepBreakdown(
            step=i, duration_ms=400.0, compute_ms=compute, comm_ms=comm, overlapped_ms=0.0,
            exposed_comm_ms=comm, idle_ms=0.0, verdict=verdict,
        )  # fmt: skip

    ledger = SimpleNamespace(
        rank=0, framework="fsdp2", records=[object()], gathers=[], unit_order=[]
    )
    ctx = DetectorContext(
        ledgers={0: ledger},  # type: ignore[dict-item]
        breakdowns={
            0: [step(0, "comm-bound", 100.0, 300.0), step(1, "compute-bound", 390.0, 10.0)]
        },
    )
    (f,) = comm_bound.detect(ctx)
    assert "communication (300.0 ms/step) exceeds compute (100.0 ms/step) in those steps" in f.title
