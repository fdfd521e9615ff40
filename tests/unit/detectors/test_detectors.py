"""Detectors on synthetic FSDP2 traces (tests/unit/rank/test_ledger.py builds them) and hand-built contexts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

from support.ledger_traces import BLOCKS, LEAVES, fsdp2_cpu_trace, write, zero3_cpu_trace
from support.trace_contexts import trace_context
from zdiag.analyzers.detectors import BY_ID, RULES, run_context
from zdiag.analyzers.detectors.blocks import find_block_pattern
from zdiag.analyzers.detectors.comm_model import fit_alpha_beta
from zdiag.analyzers.detectors.context import DetectorContext, parse_oom_message
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.inputs.model_facts import ModelFacts
from zdiag.analyzers.misconfigs import MISCONFIGS
from zdiag.analyzers.rank.fsdp_ledger import build_rank_ledger
from zdiag.collectors.model_capture import describe_model
from zdiag.collectors.run_records import Manifest

HARNESS = {"layers": 3, "dim": 64, "vocab": 512, "batch": 8, "seq": 1024, "zero": 3, "ac": "none"}
OOM_TEXT = (
    "Emulated device out of memory on rank 0. Tried to allocate 1.00 MiB. The device budget "
    "(--memory-budget-gb) has a total capacity of 0.03 GiB of which 0.90 MiB is free. In use: "
    "27.14 MiB activations saved for backward, 0.45 MiB unsharded parameters, 2.22 MiB sharded "
    "parameters, gradients and optimizer state."
)


def _ids(path: Path) -> set[str]:
    return {f.id for f in analyze_paths([path]).findings}


def _ctx(tmp_path: Path, doc: dict[str, object], **kw: object) -> DetectorContext:
    return trace_context(write(tmp_path, doc), **kw)


def test_registry_lists_every_issue_detector() -> None:
    assert set(MISCONFIGS) <= set(BY_ID)
    assert {"straggler", "fp32-collectives", "flat-sharding-multinode", "comm-bound"} <= set(BY_ID)
    assert len(BY_ID) == len(RULES)  # one rule per finding id


def test_missing_overlap_fires_on_serialized_gathers_only(tmp_path: Path) -> None:
    serial = write(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=2), "serial-rank0.json.gz")
    prefetched = write(
        tmp_path, fsdp2_cpu_trace(BLOCKS, steps=2, prefetch=True), "pre-rank0.json.gz"
    )
    report = analyze_paths([serial])
    (f,) = [f for f in report.findings if f.id == "missing-overlap"]
    assert f.severity in ("warning", "critical")
    assert f.evidence["serialized_share"] == 1.0
    assert "set_modules_to_forward_prefetch" in (f.code or "")
    assert "model.layers" in (f.code or "")
    # replay: each late gather (100 us) fits under the previous unit's 300 us compute
    assert f.expected_gain_ms == pytest.approx(6 * 0.1, rel=0.05)
    assert "missing-overlap" not in _ids(prefetched)


def test_whole_model_wrap_names_the_block_and_the_memory_cut(tmp_path: Path) -> None:
    ctx = _ctx(
        tmp_path,
        fsdp2_cpu_trace([("", 20000)], steps=2),
        manifest=Manifest.from_json(
            {"harness": HARNESS, "fsdp_units": [{"name": "", "param_bytes": 80000}]}
        ),
    )
    (f,) = [f for f in run_context(ctx).findings if f.id == "whole-model-wrap"]
    assert f.evidence["largest_unit_share"] == 1.0
    assert "for block in model.layers" in (f.code or "")
    assert f.expected_gain_bytes is not None and 0 < f.expected_gain_bytes < 80000
    assert f.gain_method


def test_block_wrap_is_not_whole_model(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=1, prefetch=True))
    assert "whole-model-wrap" not in {f.id for f in run_context(ctx).findings}


def test_tiny_layer_wrap_fires_when_sub_block_units_are_latency_bound(tmp_path: Path) -> None:
    # alpha 200 us, beta 1000 B/us: n_1/2 = 200 kB, far above these <= 32 kB messages
    doc = fsdp2_cpu_trace(LEAVES, steps=2, gather_us=200, bytes_per_us=1000)
    ctx = _ctx(tmp_path, doc)
    (f,) = [f for f in run_context(ctx).findings if f.id == "tiny-layer-wrap"]
    assert f.evidence["units_per_block"] == 4
    assert f.evidence["alpha_us"] == pytest.approx(200, rel=0.05)
    assert "for block in model.layers" in (f.code or "")
    assert f.expected_gain_ms is not None and f.expected_gain_ms > 0


def test_tiny_layer_wrap_quiet_when_messages_are_bandwidth_bound(tmp_path: Path) -> None:
    big = [(name, n * 1000) for name, n in LEAVES]  # MB-sized messages: >> n_1/2 = 20 kB
    doc = fsdp2_cpu_trace(big, steps=1, gather_us=20, bytes_per_us=1000)
    assert "tiny-layer-wrap" not in {f.id for f in run_context(_ctx(tmp_path, doc)).findings}


def test_tiny_layer_wrap_quiet_on_block_units(tmp_path: Path) -> None:
    doc = fsdp2_cpu_trace(BLOCKS, steps=1, gather_us=200, bytes_per_us=1000)
    assert "tiny-layer-wrap" not in {f.id for f in run_context(_ctx(tmp_path, doc)).findings}


def test_alpha_beta_fit_uses_the_fastest_run_per_size(tmp_path: Path) -> None:
    doc = fsdp2_cpu_trace(LEAVES, steps=1, gather_us=200, bytes_per_us=1000)
    ledger = build_rank_ledger(load_rank_trace(write(tmp_path, doc)))
    # a slow outlier (a late peer) must not move the fit
    ledger.gathers[3].end_us += 5000
    model = fit_alpha_beta(ledger.gathers)
    assert model is not None
    assert model.alpha_us == pytest.approx(200, rel=0.02)
    assert model.beta_bytes_per_us == pytest.approx(1000, rel=0.02)


def test_activation_oom_from_the_oom_record() -> None:
    ev = parse_oom_message(0, OOM_TEXT)
    assert ev.category_bytes["ACTIVATION"] == int(27.14 * 2**20)
    ctx = DetectorContext(
        ledgers={}, memory=[ev], manifest=Manifest.from_json({"harness": HARNESS})
    )
    (f,) = [f for f in run_context(ctx).findings if f.id == "activation-oom"]
    assert f.severity == "critical"
    assert f.evidence["activation_share"] > 0.9
    assert "apply_activation_checkpointing" in (f.code or "")
    assert f.units == ["layers.0", "layers.1", "layers.2"]
    assert f.expected_gain_bytes is not None and f.expected_gain_bytes > 0


def test_activation_oom_quiet_when_parameters_dominate_or_no_oom() -> None:
    params = parse_oom_message(0, OOM_TEXT.replace("27.14 MiB activations", "1.00 MiB activations"))
    ok = parse_oom_message(0, OOM_TEXT)
    ok.oom = False
    ok.capacity_bytes = 2**30  # peak well inside the capacity
    for ev in (params, ok):
        ctx = DetectorContext(ledgers={}, memory=[ev])
        assert "activation-oom" not in {f.id for f in run_context(ctx).findings}


def test_a_failing_detector_becomes_a_warning() -> None:
    import dataclasses

    def boom(ctx: DetectorContext) -> list[Any]:
        raise ValueError("bad input")

    rules = tuple(dataclasses.replace(r, detect=boom) if r.id == "comm-bound" else r for r in RULES)
    results = run_context(DetectorContext(ledgers={}), rules)
    assert any("comm-bound failed" in w for w in results.warnings)
    assert results.failed == ("comm-bound",)
    assert "comm-bound" not in {f.id for f in results.findings}
    assert run_context(DetectorContext(ledgers={})).failed == ()


def test_a_crashed_detector_is_named_in_the_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The reduce puts the crashed rule's id in Report.failed_detectors (renderers read it)."""
    import dataclasses

    from zdiag.analyzers.engine import reduce

    def boom(ctx: DetectorContext) -> list[Any]:
        raise KeyError(3)

    rules = tuple(dataclasses.replace(r, detect=boom) if r.id == "host-sync" else r for r in RULES)
    real = reduce.run_context
    monkeypatch.setattr(reduce, "run_context", lambda ctx: real(ctx, rules))
    trace = write(tmp_path, fsdp2_cpu_trace(BLOCKS))
    report = analyze_paths([trace])
    assert report.failed_detectors == ["host-sync"]
    assert any(w.startswith("detector host-sync failed (KeyError") for w in report.warnings)
    monkeypatch.undo()
    assert analyze_paths([trace]).failed_detectors == []


def test_block_pattern() -> None:
    block = find_block_pattern(["", "layers.0.wq", "layers.1.wq", "norm", "layers.10"])
    assert block is not None and block.pattern == "layers.N" and block.count == 3
    assert block.block_of("layers.1.wq") == "layers.1"
    assert find_block_pattern(["", "encoder", "decoder"]) is None


def test_no_fsdp_findings_on_real_traces(real_traces: Path) -> None:
    files = [p for p in sorted(real_traces.rglob("*.json.gz")) if "sampled_128" not in str(p)]
    inputs = [[p] for p in files] + [[real_traces / "hta" / "sampled_128"]]
    for paths in inputs:
        report = analyze_paths(paths)
        assert report.fsdp_units == [], paths
        fsdp_only = {r.id for r in RULES if r.fsdp_only}
        bad = [f.id for f in report.findings if f.id in fsdp_only | {"activation-oom"}]
        assert not bad, (paths, bad)


def test_activation_oom_from_timeline_categories_and_the_manifest_oom_flag() -> None:
    from zdiag.analyzers.detectors import build_context
    from zdiag.analyzers.report import MemoryTimeline

    cuda_oom = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB"
    )
    manifest = Manifest.from_json(
        {"ranks": [{"rank": 0, "oom": True, "error": cuda_oom}], "exit": {"oom": True}}
    )
    timeline = MemoryTimeline(
        rank=0,
        source="memory_timeline",
        peak_bytes=70 * 2**30,
        peak_category_bytes={
            "ACTIVATION": 50 * 2**30,
            "PARAMETER": 8 * 2**30,
            "GRADIENT": 12 * 2**30,
        },
    )
    ctx = build_context([], manifest=manifest, memory=[timeline])
    (f,) = [f for f in run_context(ctx).findings if f.id == "activation-oom"]
    assert f.evidence["oom"] is True
    assert f.evidence["capacity_bytes"] == int(79.1 * 2**30)
    assert f.evidence["activation_share"] == pytest.approx(50 / 70, abs=1e-3)
    # without the shape, checkpointing is credited with 7/8 of the activations
    assert f.expected_gain_bytes == 50 * 2**30 - 50 * 2**30 // 8


def _whole_wrap_with_decoder_layers(steps: int) -> dict[str, object]:
    """A whole-model FSDP2 unit on CPU whose `with_stack` module events show three DecoderLayer
    blocks, each with four Linears inside its calls."""
    doc = fsdp2_cpu_trace([("", 20000)], steps=steps)
    events = doc["traceEvents"]
    assert isinstance(events, list)
    for k in range(3):
        events.append(
            {"ph": "X", "cat": "python_function", "name": f"nn.Module: DecoderLayer_{k}",
             "pid": 1, "tid": 100, "ts": 50_000 + 100 * k, "dur": 90, "args": {}}
        )  # fmt: skip
        for j in range(4):  # its Linears (the first starts with it): more, but inside its calls
            events.append(
                {"ph": "X", "cat": "python_function", "name": f"nn.Module: Linear_{4 * k + j}",
                 "pid": 1, "tid": 100, "ts": 50_000 + 100 * k + 20 * j, "dur": 10, "args": {}}
            )  # fmt: skip
    return doc


def test_whole_model_wrap_names_the_repeated_module_class_from_a_stack_trace(
    tmp_path: Path,
) -> None:
    doc = _whole_wrap_with_decoder_layers(steps=1)
    (f,) = [f for f in run_context(_ctx(tmp_path, doc)).findings if f.id == "whole-model-wrap"]
    assert "isinstance(module, DecoderLayer)" in (f.code or "")
    assert "DecoderLayer x3" in f.recommendation
    assert "Linear" not in (f.code or "")  # the leaf layer is the tiny-layer anti-pattern


def test_whole_model_wrap_on_cpu_claims_memory_and_no_step_time(tmp_path: Path) -> None:
    """On CPU/gloo without the unshard async op the gathers block: per-block units hide nothing
    and add blocking collectives (the zoo's fixes ran 13-40 ms slower per step), so the finding
    predicts no step time (not 0 ms) and says the step will get slower."""
    ctx = _cpu_only(_ctx(tmp_path, _whole_wrap_with_decoder_layers(steps=2)))
    (f,) = [f for f in run_context(ctx).findings if f.id == "whole-model-wrap"]
    assert f.expected_gain_ms is None and "step time not predicted" in f.gain_method
    assert "expect the step to get slower" in f.recommendation


def _cuda_forward(tmp_path: Path, overlap: bool) -> DetectorContext:
    """FSDP2 on CUDA, forward of 4 blocks; every gather is issued on the host inside its own
    pre_forward (implicit prefetch: lead <= 0). With `overlap` the host runs ahead and each gather
    kernel runs under the previous block's gemm; without, gathers and gemms alternate."""
    from support.ledger_traces import TraceBuilder

    tmp_path.mkdir(parents=True, exist_ok=True)
    b = TraceBuilder()
    host, corr = 9_700.0, 1  # the host a little ahead of the device, as in a real trace
    prev_gemm_start, prev_gemm_end = 10_000.0, 10_000.0
    for k in range(4):
        fqn = f"layers.{k}"
        b.x(f"FSDP::pre_forward ({fqn})", host, 40, cat="user_annotation")
        b.x(f"FSDP::all_gather ({fqn})", host + 2, 20, cat="user_annotation")
        b.x(
            "c10d::_allgather_base_",
            host + 4,
            15,
            **{"Input Dims": [[1 << 20], [1 << 19]], "Input type": ["BFloat16"] * 2},
        )
        b.x("cudaLaunchKernel", host + 6, 2, cat="cuda_runtime", correlation=corr)
        b.x("cudaLaunchKernel", host + 45, 2, cat="cuda_runtime", correlation=corr + 1)
        # run-ahead: the gather runs under the previous gemm; serial: after it
        gather_start = prev_gemm_start + 100 if overlap and k else prev_gemm_end
        b.events.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": "ncclDevKernel_AllGather_RING_LL",
                "pid": 0,
                "tid": 20,
                "ts": gather_start,
                "dur": 300,
                "args": {"correlation": corr},
            }
        )
        gemm_start = max(prev_gemm_end, gather_start + 300)
        b.events.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": "sm90_gemm_bf16",
                "pid": 0,
                "tid": 7,
                "ts": gemm_start,
                "dur": 500,
                "args": {"correlation": corr + 1},
            }
        )
        prev_gemm_start, prev_gemm_end = gemm_start, gemm_start + 500
        host += 60
        corr += 2
    return _ctx(tmp_path, b.doc(device_events=True))  # fmt: skip


def test_missing_overlap_judges_cuda_gathers_by_device_overlap(tmp_path: Path) -> None:
    run_ahead = _cuda_forward(tmp_path / "a", overlap=True)
    assert "missing-overlap" not in {f.id for f in run_context(run_ahead).findings}
    serial = _cuda_forward(tmp_path / "b", overlap=False)
    (f,) = [f for f in run_context(serial).findings if f.id == "missing-overlap"]
    assert f.evidence["exposed_share"] == 1.0
    assert f.expected_gain_ms is not None and f.expected_gain_ms > 0


def test_whole_model_wrap_quiet_when_blocks_are_units_beside_a_huge_embedding(
    tmp_path: Path,
) -> None:
    # a 256k-vocabulary root outweighs small blocks 20:1, but the blocks are wrapped
    units = [("", 200_000), ("layers.0", 4000), ("layers.1", 4000)]
    ctx = _ctx(tmp_path, fsdp2_cpu_trace(units, steps=1, prefetch=True))
    assert "whole-model-wrap" not in {f.id for f in run_context(ctx).findings}


def test_activation_oom_from_a_run_dir_without_traces(tmp_path: Path) -> None:
    """An OOM before the profiler window leaves no trace: the OOM record still tells."""
    import json
    import shutil

    from conftest import REPO_ROOT
    from support.stages import analyze_run
    from zdiag.analyzers.run.run_data import RunData

    sample = REPO_ROOT / "sample_traces" / "activation-oom"
    if not (sample / "manifest.json").is_file():
        pytest.skip("sample_traces/activation-oom not recorded")
    shutil.copytree(sample / "memory", tmp_path / "memory")
    manifest = Manifest.from_json(json.loads((sample / "manifest.json").read_text()))
    run = RunData(ranks=[], manifest=manifest, run_dir=tmp_path)
    (f,) = [f for f in analyze_run(run).report.findings if f.id == "activation-oom"]
    assert f.ranks == [0, 1]
    assert f.evidence["source"] == "oom record"


def _as_fsdp1(doc: dict[str, object], prefetched: bool = False) -> dict[str, object]:
    """The FSDP2 synthetic trace relabelled the way FSDP1 records (no module names);
    `prefetched`: every gather issued under FSDP1's prefetch label."""
    gather = "_pre_backward_prefetch" if prefetched else "_pre_forward_unshard"
    names = {
        "FSDP::pre_forward": "FullyShardedDataParallel._pre_forward",
        "FSDP::pre_backward": "FullyShardedDataParallel._pre_backward_hook",
        "FSDP::all_gather": f"FullyShardedDataParallel.{gather}",
        "FSDP::post_backward_reduce": "FullyShardedDataParallel._post_backward_hook",
    }
    events = []
    for ev in doc["traceEvents"]:  # type: ignore[attr-defined]
        name = str(ev.get("name", ""))
        if name.startswith("FSDP::"):
            base = name.split(" (")[0]
            if base not in names:
                continue
            ev = {**ev, "name": names[base]}
        events.append(ev)
    return {**doc, "traceEvents": events}


def test_missing_overlap_on_fsdp1_uses_exposure_and_fsdp1_knobs(tmp_path: Path) -> None:
    doc = _as_fsdp1(fsdp2_cpu_trace(BLOCKS, steps=2))
    ctx = _ctx(tmp_path, doc)
    assert ctx.ledgers[0].framework == "fsdp1"
    assert ctx.ledgers[0].unit_order == [f"fsdp1-unit-{k}" for k in range(4)]
    report = analyze_paths([write(tmp_path, doc, "fsdp1-rank0.json.gz")])  # with step windows
    (f,) = [f for f in report.findings if f.id == "missing-overlap"]
    assert "forward_prefetch=True" in (f.code or "")
    assert "BackwardPrefetch.BACKWARD_PRE" in (f.code or "")
    # a CPU trace (no kernels): FSDP1's gathers block the only thread, so no gain here; the
    # replayed figure is what prefetch would hide on GPUs
    assert f.severity == "info" and f.expected_gain_ms == 0.0
    assert f.evidence["replayed_gain_ms_per_step"] == pytest.approx(6 * 0.1, rel=0.05)


def test_comm_bound_recognizes_every_fp32_spelling_and_gives_complete_code() -> None:
    from types import SimpleNamespace

    from zdiag.analyzers.detectors import comm_bound
    from zdiag.analyzers.report import StepBreakdown

    def step(n: int) -> StepBreakdown:
        return StepBreakdown(
            step=n,
            duration_ms=100.0,
            compute_ms=30.0,
            comm_ms=60.0,
            overlapped_ms=20.0,
            exposed_comm_ms=40.0,
            idle_ms=30.0,
            verdict="comm-bound",
        )

    for dtype in ("Float", "torch.float32", "fp32"):
        gather = SimpleNamespace(dtype=dtype)
        ledger = SimpleNamespace(
            rank=0, framework="fsdp2", records=[gather], gathers=[gather], unit_order=[]
        )
        ctx = DetectorContext(ledgers={0: ledger}, breakdowns={0: [step(1), step(2)]})  # type: ignore[dict-item]
        (f,) = comm_bound.detect(ctx)
        assert "bf16" in f.recommendation
        assert "import" in (f.code or "") and "fully_shard(block, mp_policy=mp)" in (f.code or "")
        assert f.expected_gain_ms == pytest.approx(30.0)


def test_flat_sharding_across_nodes_recommends_hsdp_with_runnable_code() -> None:
    from types import SimpleNamespace

    from zdiag.analyzers.detectors import flat_sharding

    record = SimpleNamespace(exposed_us=4000.0)
    ledger = SimpleNamespace(
        rank=0, framework="fsdp2", records=[record], steps=[1, 2], unit_order=[], gathers=[],
        reduces=[],
    )  # fmt: skip
    manifest = Manifest.from_json({"world_size": 16, "nnodes": 2})
    ctx = DetectorContext(ledgers={0: ledger}, manifest=manifest)  # type: ignore[dict-item]
    (f,) = flat_sharding.detect(ctx)
    code = f.code or ""
    assert "init_device_mesh" in code and "from torch.distributed.fsdp import fully_shard" in code
    assert "(2, 8)" in code
    assert f.expected_gain_ms == pytest.approx(1.0)  # 2 ms exposed per step, halved
    single_node = DetectorContext(
        ledgers={0: ledger}, manifest=Manifest.from_json({"world_size": 8, "nnodes": 1})
    )  # type: ignore[dict-item]
    assert flat_sharding.detect(single_node) == []


def _comm_bound_ctx(framework: str) -> DetectorContext:
    """Every step comm-bound (60 ms comm, 30 ms compute), fp32 gathers, one `framework` rank."""
    from types import SimpleNamespace

    from zdiag.analyzers.report import StepBreakdown

    steps = [
        StepBreakdown(step=n, duration_ms=100.0, compute_ms=30.0, comm_ms=60.0,
                      overlapped_ms=20.0, exposed_comm_ms=40.0, idle_ms=30.0, verdict="comm-bound")
        for n in (1, 2)
    ]  # fmt: skip
    gather = SimpleNamespace(dtype="float")
    ledger = SimpleNamespace(
        rank=0, framework=framework, records=[gather], gathers=[gather], unit_order=[]
    )
    return DetectorContext(ledgers={0: ledger}, breakdowns={0: steps})  # type: ignore[dict-item]


# What each framework's bf16 advice must name, and what belongs to another framework.
BF16_NAMES = {
    "fsdp2": ("MixedPrecisionPolicy(param_dtype=torch.bfloat16", "mixed_precision="),
    "fsdp1": ("mixed_precision=MixedPrecision(param_dtype=torch.bfloat16", "MixedPrecisionPolicy"),
    "deepspeed": ('"bf16": {"enabled": true}', "MixedPrecision"),
}


@pytest.mark.parametrize("framework", sorted(BF16_NAMES))
def test_comm_bound_bf16_advice_per_framework(framework: str) -> None:
    from zdiag.analyzers.detectors import comm_bound

    (f,) = comm_bound.detect(_comm_bound_ctx(framework))
    must, must_not = BF16_NAMES[framework]
    assert must in f.recommendation and must in (f.code or "")
    assert must_not not in f.recommendation and must_not not in (f.code or "")
    if framework != "fsdp2":
        assert "fully_shard" not in f.recommendation + (f.code or "")


@pytest.mark.parametrize("framework", sorted(BF16_NAMES))
def test_fp32_collectives_bf16_advice_per_framework(framework: str) -> None:
    from zdiag.analyzers.detectors import fp32_collectives
    from zdiag.analyzers.rank.fsdp_ledger import CollectiveRecord, RankLedger

    gathers = [
        CollectiveRecord(unit=f"u{k}", framework=framework, family="all_gather",
                         kind="all_gather", phase="forward", step=1, issued_us=1000.0 * k,
                         issue_end_us=1000.0 * k + 5, start_us=1000.0 * k + 10,
                         end_us=1000.0 * k + 510, bytes=4 << 20, dtype="float", exposed_us=500.0)
        for k in range(4)
    ]  # fmt: skip
    ledger = RankLedger(rank=0, framework=framework, device="cpu", records=gathers, steps=[1])
    ledger.window_us = 4000.0
    (f,) = fp32_collectives.detect(DetectorContext(ledgers={0: ledger}))
    must, must_not = BF16_NAMES[framework]
    assert must in f.recommendation and must in (f.code or "")
    assert must_not not in f.recommendation and must_not not in (f.code or "")


def test_whole_model_wrap_does_not_apply_to_deepspeed_zero(tmp_path: Path) -> None:
    """One ZeRO-3 fetch moving nearly every parameter is not a wrap choice (ZeRO has none): the
    same ledger with the framework renamed to FSDP's would be a whole-model wrap."""
    import dataclasses

    from zdiag.analyzers.detectors import whole_model_wrap

    ctx = _ctx(tmp_path, zero3_cpu_trace([200_000, 100], steps=1, refetch=False, persistent=0))
    ledger = ctx.ledgers[0]
    assert ledger.framework == "deepspeed"
    assert whole_model_wrap.detect(ctx) == []
    ledger.framework = "fsdp1"  # the guard is what keeps it quiet
    (f,) = whole_model_wrap.detect(dataclasses.replace(ctx))  # the fact sheet derived again
    assert f.units == ["zero-gather-0"]


# --- remedies from analyzers/frameworks/: the run's framework, its modules, nothing it has ----


def test_whole_model_wrap_on_fsdp1_gets_fsdp1_code_naming_the_user_container(
    tmp_path: Path,
) -> None:
    """FSDP1 runs used to get `fully_shard` code; the block set comes from the manifest's units."""
    doc = _as_fsdp1(fsdp2_cpu_trace([("", 20000)], steps=2))
    units = [{"name": f"encoder.stages.{i}", "param_bytes": 20000} for i in range(3)]
    ctx = _ctx(tmp_path, doc, manifest=Manifest.from_json({"fsdp_units": units}))
    (f,) = [f for f in run_context(ctx).findings if f.id == "whole-model-wrap"]
    code = f.code or ""
    assert "blocks = set(model.encoder.stages)" in code and "auto_wrap_policy=" in code
    assert "fully_shard" not in code


def test_whole_model_wrap_without_a_known_block_set_prints_no_guessed_code(
    tmp_path: Path,
) -> None:
    ctx = _ctx(tmp_path, fsdp2_cpu_trace([("", 20000)], steps=2))
    (f,) = [f for f in run_context(ctx).findings if f.id == "whole-model-wrap"]
    assert f.code is None  # was `for block in model.layers:`, an attribute the model may lack


def _cpu_only(ctx: DetectorContext) -> DetectorContext:
    """`ctx` with a measured step without a device kernel: a CPU-only run."""
    import dataclasses

    from zdiag.analyzers.report import StepBreakdown

    cpu_step = StepBreakdown(
        step=1, duration_ms=10.0, compute_ms=5.0, comm_ms=5.0, overlapped_ms=0.0,
        exposed_comm_ms=5.0, idle_ms=0.0, verdict="comm-bound",
    )  # fmt: skip
    return dataclasses.replace(ctx, breakdowns={0: [cpu_step]})


def test_missing_overlap_proposes_no_prefetch_the_harness_run_already_sets(tmp_path: Path) -> None:
    doc = fsdp2_cpu_trace(BLOCKS, steps=2)
    off = _ctx(tmp_path, doc, manifest=Manifest.from_json({"harness": {"prefetch": "off"}}))
    (f,) = [f for f in run_context(off).findings if f.id == "missing-overlap"]
    assert "set_modules_to_forward_prefetch" in (f.code or "")
    on = _ctx(tmp_path, doc, manifest=Manifest.from_json({"harness": {"prefetch": "explicit"}}))
    (f,) = [f for f in run_context(on).findings if f.id == "missing-overlap"]
    assert (
        f.code is None
        and "already sets every FSDP2 (fully_shard) prefetch option" in f.recommendation
    )
    # on CPU: the harness sets the unshard async op, so no line for it, and the note says so
    from zdiag.analyzers.detectors import missing_overlap

    (g,) = missing_overlap.detect(_cpu_only(on))
    assert g.code is None and "the unshard async op the run sets" in g.recommendation


def test_missing_overlap_on_sub_block_units_wraps_the_blocks_before_prefetching(
    tmp_path: Path,
) -> None:
    """Prefetch calls on `model.layers[i]` raise AttributeError unless each block is a unit. In
    the report the wrap finding comes first and takes the overlap's place (reconcile.py)."""
    from zdiag.analyzers.detectors import missing_overlap

    ctx = _ctx(tmp_path, fsdp2_cpu_trace(LEAVES, steps=2))
    (f,) = missing_overlap.detect(ctx)
    code = f.code or ""
    assert code.index("fully_shard(block)") < code.index("set_modules_to_forward_prefetch")
    ids = {g.id: g for g in run_context(ctx).findings}
    assert "missing-overlap" not in ids
    wrap = ids["tiny-layer-wrap"]
    assert "missing-overlap" in wrap.evidence["explains"]
    assert "re-profile after re-wrapping" in wrap.recommendation


def test_activation_oom_from_a_memory_budget_hooks_wording() -> None:
    """An OOM before the profiler window (no trace): the record's own wording names the
    activations held and the budget; the rest of the budget counts as other memory, so the
    share is the activations' part of the budget, and a hook naming few activations is quiet."""
    text = (
        "CUDA out of memory (emulated). Tried to allocate 1.00 MiB; budget 48.0 MiB, "
        "29.27 MiB held by saved activations."
    )
    ev = parse_oom_message(1, text)
    assert ev.capacity_bytes == 48 * 2**20
    assert ev.category_bytes["ACTIVATION"] == int(29.27 * 2**20)
    assert ev.category_bytes["OTHER"] == pytest.approx((48 - 1 - 29.27) * 2**20, rel=1e-6)
    (f,) = [f for f in run_context(DetectorContext(ledgers={}, memory=[ev])).findings]
    assert f.id == "activation-oom" and f.ranks == [1]
    assert f.evidence["activation_share"] == pytest.approx(29.27 / 47.0, abs=0.01)
    few = parse_oom_message(1, text.replace("29.27 MiB held", "5.00 MiB held"))
    assert run_context(DetectorContext(ledgers={}, memory=[few])).findings == []


def test_activation_oom_when_checkpointing_alone_would_fit() -> None:
    """Activations a third of the budget (large parameter state beside them): the finding fires
    when freeing 7/8 of them covers the failing request, not when the request is larger."""
    text = (
        "CUDA out of memory (emulated). Tried to allocate 1.75 MiB; budget 100.0 MiB, "
        "30.00 MiB held by saved activations."
    )
    (f,) = run_context(DetectorContext(ledgers={}, memory=[parse_oom_message(0, text)])).findings
    assert f.id == "activation-oom" and 0.25 < f.evidence["activation_share"] < 0.5
    # 28 MiB requested: 7/8 of 30 MiB (26.25) would not make it fit; still 42% of memory in use
    big = parse_oom_message(0, text.replace("1.75 MiB;", "28.00 MiB;"))
    assert run_context(DetectorContext(ledgers={}, memory=[big])).findings == []


def test_missing_overlap_quiet_when_every_gather_is_already_prefetched(tmp_path: Path) -> None:
    """A correct FSDP1 run (forward_prefetch / BACKWARD_PRE: every gather under a prefetch label)
    whose gathers are still 100% exposed (CPU/gloo blocks on them) has nothing prefetch could
    hide: no finding. The same trace with the gathers issued when needed fires."""
    doc = _as_fsdp1(fsdp2_cpu_trace(BLOCKS, steps=2))
    (tmp_path / "late").mkdir()
    (tmp_path / "prefetched").mkdir()
    late = _ctx(tmp_path / "late", doc)
    (f,) = [f for f in run_context(late).findings if f.id == "missing-overlap"]
    assert f.evidence["exposed_share"] == 1.0 and (f.expected_gain_ms or 0) > 0
    ctx = _ctx(tmp_path / "prefetched", _as_fsdp1(fsdp2_cpu_trace(BLOCKS, steps=2), True))
    assert all(r.prefetched for lg in ctx.fsdp_ledgers() for r in lg.gathers)
    assert "missing-overlap" not in {f.id for f in run_context(ctx).findings}


def _with_every_fsdp1_prefetch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fact sheet says the run sets every FSDP1 prefetch option."""
    import dataclasses

    from zdiag.analyzers.detectors.fact_sheet import RunFactSheet

    real = RunFactSheet.run_facts
    every = {
        "forward_prefetch": True,
        "backward_prefetch": "BACKWARD_PRE",
        "limit_all_gathers": True,
    }

    def facts_with_every_setting(*args: Any, **kwargs: Any) -> Any:
        facts = real(*args, **kwargs)
        return dataclasses.replace(facts, settings={**facts.settings, **every})

    monkeypatch.setattr(RunFactSheet, "run_facts", facts_with_every_setting)


def test_missing_overlap_silent_on_cpu_fsdp1_with_every_prefetch_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU FSDP1 whose gathers are all late but whose run already sets forward_prefetch and
    BACKWARD_PRE: nothing to change and nothing to gain here, so no finding (a healthy zoo run
    got an info finding with 0 ms). Without those settings the info finding stays."""
    from zdiag.analyzers.detectors import missing_overlap

    ctx = _cpu_only(_ctx(tmp_path, _as_fsdp1(fsdp2_cpu_trace(BLOCKS, steps=2))))
    (f,) = missing_overlap.detect(ctx)
    assert f.severity == "info" and f.expected_gain_ms == 0.0
    _with_every_fsdp1_prefetch(monkeypatch)
    assert missing_overlap.detect(ctx) == []


def test_missing_overlap_silent_without_a_remedy_or_measured_lateness(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """FSDP1 / ZeRO-3 name no consumer, so their lateness is the guess "not under a prefetch
    label" (ZeRO-3 labels none). When the run already has every prefetch setting there is
    nothing to change and nothing measured: no finding (a healthy ZeRO-3 zoo script got one)."""
    from zdiag.analyzers.detectors import missing_overlap

    ctx = _ctx(tmp_path, _as_fsdp1(fsdp2_cpu_trace(BLOCKS, steps=2)))
    assert not ctx.sheet.cpu_only  # judged as a GPU run: the gain is not zeroed
    (f,) = missing_overlap.detect(ctx)
    assert (f.expected_gain_ms or 0) > 0
    _with_every_fsdp1_prefetch(monkeypatch)
    assert missing_overlap.detect(ctx) == []


def test_missing_overlap_on_cpu_fsdp1_only_for_a_switched_off_backward_prefetch(
    tmp_path: Path,
) -> None:
    """CPU FSDP1 on its defaults (backward gathers under `_pre_backward_prefetch`, forward ones
    issued when needed): forward_prefetch would gain nothing on this machine, so no finding (a
    healthy zoo script got a 0 ms info finding, and so did the fix of a prefetch-off one). With
    the backward prefetch off as well, the info finding names the default to restore."""
    from zdiag.analyzers.detectors import missing_overlap

    ctx = _cpu_only(_ctx(tmp_path, _as_fsdp1(fsdp2_cpu_trace(BLOCKS, steps=2))))
    backward = [r for lg in ctx.fsdp_ledgers() for r in lg.gathers if r.phase == "backward"]
    assert backward and not any(r.prefetched for r in backward)
    (f,) = missing_overlap.detect(ctx)
    assert "BackwardPrefetch.BACKWARD_PRE" in (f.code or "")
    for r in backward:
        r.prefetched = True
    assert missing_overlap.detect(ctx) == []


def test_exposed_comm_claims_nothing_when_the_run_has_every_overlap_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Most steps exposed-comm on a DDP run: a warning with DDP's bucket settings and the overlap
    gain; when the run already sets all of them, info with 0 ms (nothing to apply)."""
    import dataclasses

    from zdiag.analyzers.detectors import step_verdicts
    from zdiag.analyzers.rank.rank_analysis import RankFacts
    from zdiag.analyzers.report import StepBreakdown

    step = StepBreakdown(
        step=1, duration_ms=100.0, compute_ms=60.0, comm_ms=40.0, overlapped_ms=10.0,
        exposed_comm_ms=30.0, idle_ms=10.0, verdict="exposed-comm", kernel_count=5,
    )  # fmt: skip
    ctx = DetectorContext(
        ledgers={},
        breakdowns={0: [step, step], 1: [step, step]},
        facts={0: RankFacts(framework="ddp"), 1: RankFacts(framework="ddp")},
    )
    (f,) = step_verdicts.detect_exposed_comm(ctx)
    assert f.severity == "warning" and f.expected_gain_ms == 30.0
    assert "bucket_cap_mb" in (f.code or "")
    from zdiag.analyzers.detectors.fact_sheet import RunFactSheet

    real = RunFactSheet.run_facts
    every = {"bucket_cap_mb": 25.0, "gradient_as_bucket_view": True, "static_graph": True}

    def with_every_setting(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(real(*args, **kwargs), settings=every)

    monkeypatch.setattr(RunFactSheet, "run_facts", with_every_setting)
    (g,) = step_verdicts.detect_exposed_comm(ctx)
    assert g.severity == "info" and g.expected_gain_ms == 0.0 and g.code is None
    assert g.evidence["overlap_gain_ms_per_step"] == 30.0


def test_missing_overlap_on_cpu_fsdp2_sets_the_unshard_async_op(tmp_path: Path) -> None:
    """On CPU/gloo an FSDP2 prefetch list overlaps nothing without the unshard async op: the
    code sets it last (the zoo's fix verification applies it, the harness sets it itself); ZeRO
    runs on CPU get no FSDP advice, their gathers being async ops already."""
    import dataclasses

    from zdiag.analyzers.detectors import missing_overlap
    from zdiag.analyzers.rank.rank_analysis import RankFacts

    ctx = _cpu_only(_ctx(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=2)))
    assert not ctx.sheet.gathers_can_overlap()
    (f,) = missing_overlap.detect(ctx)
    code = (f.code or "").splitlines()
    assert "set_modules_to_forward_prefetch" in "\n".join(code)
    assert code[-1].startswith("model._set_unshard_async_op(True)")
    assert "the code's last line" in f.recommendation and "FSDP1" not in f.recommendation
    zero = dataclasses.replace(ctx, facts={0: RankFacts(framework="deepspeed")})
    assert zero.sheet.gathers_can_overlap()


class _MlpBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)


class _BlockModel(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 64)
        self.blocks = nn.ModuleList(_MlpBlock() for _ in range(blocks))


def _described(blocks: int) -> ModelFacts:
    """A real model's captured description: a stem and `blocks` repeated MLP blocks."""
    return ModelFacts(describe_model(_BlockModel(blocks), rank=0))


@pytest.mark.parametrize(
    ("modules", "in_backward", "scale"),
    [
        (("", "blocks.1"), False, 4 / 1.5),  # failed in the 2nd of 4 blocks: half of it done
        (("", "blocks.1", "blocks.1.down"), False, 4 / 1.75),  # in its 2nd of 2 children
        (("", "blocks.1", "blocks.1.up"), False, 4 / 1.25),
        (("", "blocks.3"), False, 4 / 3.5),
        (("", "blocks.1"), True, 1.0),  # a recompute in backward: the forward was whole
        (("", "stem"), False, 1.0),  # before the blocks: no block to count from
        ((), False, 1.0),  # an older record: no failure point
    ],
)
def test_activation_oom_scales_a_failure_partway_through_the_forward(
    modules: tuple[str, ...], in_backward: bool, scale: float
) -> None:
    """An OOM record naming the block the forward failed in: the activations held there are
    that share of a whole forward's, so checkpointing frees about 7/8 of the whole forward's
    (blocks save alike); in backward, or outside the blocks, the failure's own figure stands."""
    text = (
        "CUDA out of memory (emulated). Tried to allocate 1.00 MiB; budget 48.0 MiB, "
        "29.27 MiB held by saved activations."
    )
    ev = parse_oom_message(0, text)
    ev.modules, ev.in_backward = modules, in_backward
    ctx = DetectorContext(ledgers={}, memory=[ev], model=_described(4))
    (f,) = run_context(ctx).findings
    act = ev.category_bytes["ACTIVATION"]
    whole = int(act * scale)
    assert f.expected_gain_bytes == whole - whole // 8
    assert "model.blocks[N]" in f.recommendation and "set(model.blocks)" in (f.code or "")
    assert ("failed_in_block" in f.evidence) == (scale != 1.0)


class _EncoderTower(_MlpBlock):
    pass


class _DecoderTower(_MlpBlock):
    pass


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList(_EncoderTower() for _ in range(3))


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList(_DecoderTower() for _ in range(2))


class _Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = _Encoder(), _Decoder()


def test_activation_oom_counts_an_encoders_blocks_before_a_decoders() -> None:
    """Blocks in two containers run container after container, in definition order: a failure
    in the decoder's first block had the encoder's 3 blocks and half of it done, of 5."""
    text = "CUDA out of memory. Tried to allocate 1.00 MiB; budget 48.0 MiB, 29.27 MiB held by "
    ev = parse_oom_message(0, text + "saved activations.")
    ev.modules = ("", "decoder", "decoder.towers.0")
    ctx = DetectorContext(ledgers={}, memory=[ev], model=ModelFacts(describe_model(_Seq2Seq())))
    (f,) = run_context(ctx).findings
    assert f.evidence["failed_in_block"] == "decoder.towers.0"
    assert f.evidence["blocks_done_at_failure"] == "3.50 of 5"
    assert f.units == [
        *(f"encoder.towers.{i}" for i in range(3)),
        "decoder.towers.0",
        "decoder.towers.1",
    ]


class _WidthBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = nn.Linear(width, width)


class _Stage(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_WidthBlock(width) for _ in range(2))


class _Pyramid(nn.Module):
    """timm's ConvNeXt shape: stages of blocks, each stage wider than the last."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(_Stage(w) for w in (8, 16, 32, 64))


class _SmallEncoderBigDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = _Encoder(), _Decoder()
        self.decoder.towers.extend(_DecoderTower() for _ in range(3))  # 5 towers to the 3


def test_blocks_in_several_containers_are_named_in_the_models_order() -> None:
    """The description lists repeated sets largest first; the wrap code names them as the model
    defines and runs them (stages 0 to 3, the encoder before the decoder), not by size."""
    from zdiag.analyzers.detectors.facts import model_block_set

    pyramid = model_block_set(ModelFacts(describe_model(_Pyramid())))
    assert pyramid is not None and pyramid.python == (
        "[*model.stages[0].blocks, *model.stages[1].blocks, *model.stages[2].blocks, "
        "*model.stages[3].blocks]"
    )
    seq2seq = model_block_set(ModelFacts(describe_model(_SmallEncoderBigDecoder())))
    assert seq2seq is not None
    assert seq2seq.python == "[*model.encoder.towers, *model.decoder.towers]"
    assert seq2seq.classes == ("_EncoderTower", "_DecoderTower")


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(64, 4)
        self.experts = nn.ModuleList(_MlpBlock() for _ in range(4))


class _MoeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Experts() for _ in range(4))


def test_activation_oom_counts_blocks_of_layers_the_description_collapsed() -> None:
    """Blocks nested in a repeated layer (experts in every MoE layer): the description lists
    only the first few layers, yet every layer's blocks run layer after layer, so a failure
    in layer 1's 3rd expert had 4 + 2.5 of the 16 blocks done."""
    desc = describe_model(_MoeModel())
    assert "layers.3.experts" not in {m.path for m in desc.modules}  # collapsed
    text = "CUDA out of memory. Tried to allocate 1.00 MiB; budget 48.0 MiB, 29.27 MiB held by "
    ev = parse_oom_message(0, text + "saved activations.")
    ev.modules = ("", "layers.1", "layers.1.experts.2")
    ctx = DetectorContext(ledgers={}, memory=[ev], model=ModelFacts(desc))
    (f,) = run_context(ctx).findings
    assert f.evidence["failed_in_block"] == "layers.1.experts.2"
    assert f.evidence["blocks_done_at_failure"] == "6.50 of 16"
    assert f.units[:5] == [*(f"layers.0.experts.{i}" for i in range(4)), "layers.1.experts.0"]
    assert f.units[-1] == "layers.3.experts.3"


def test_flat_sharding_gains_what_the_hsdp_shape_replays_to_when_the_steps_are_modelled() -> None:
    """With modelled steps, the gain is the replay of the HSDP shape (nodes x ranks per node)
    on the run's nodes, the shard groups' bytes INTRA_NODE_SPEEDUP times as fast inside a
    node; the formula stays for runs without them."""
    from types import SimpleNamespace

    from zdiag.analyzers.detectors import flat_sharding
    from zdiag.analyzers.rank.declared_groups import ProcessGroupInfo
    from zdiag.analyzers.rank.rank_analysis import RankFacts
    from zdiag.analyzers.rank.step_model import ModelOp, StepModel

    def op(kind: str, family: str, pos: float, dur: float) -> ModelOp:
        return ModelOp(
            kind=kind, lane=f"0|{kind}", issue_pos_us=pos, after=-1, delay_us=0.0, dur_us=dur,
            wait_pos_us=pos, bytes=4000, unit="layers.0", family=family,
            phase="forward" if family == "all_gather" else "backward",
        )  # fmt: skip

    step = StepModel(
        step=1, start_us=0.0, duration_us=1700.0, work_us=1000.0,
        ops=[op("all_gather", "all_gather", 100.0, 300.0), op("all_reduce", "reduce", 600.0, 400.0)],
    )  # fmt: skip
    record = SimpleNamespace(exposed_us=700.0)
    ledger = SimpleNamespace(
        rank=0, framework="fsdp2", records=[record], steps=[1], unit_order=[], gathers=[],
        reduces=[],
    )  # fmt: skip
    ranks = [{"rank": r, "node_rank": r // 2, "host": "h"} for r in range(4)]
    manifest = Manifest.from_json({"world_size": 4, "nnodes": 2, "ranks": ranks})
    facts = {r: RankFacts(process_groups=[ProcessGroupInfo(name="0", size=4)]) for r in range(4)}
    ctx = DetectorContext(
        ledgers={0: ledger}, manifest=manifest, facts=facts,
        step_models={r: [step] for r in range(4)}, device="cpu",
    )  # type: ignore[dict-item]  # fmt: skip
    (f,) = flat_sharding.detect(ctx)
    assert (f.gain_method or "").startswith("replayed (zdiag whatif --mesh-shape 2,2)")
    assert f.expected_gain_ms is not None and f.expected_gain_ms > 0
    assert f.expected_gain_ms != pytest.approx(0.35)  # not the formula's half of 0.7 ms


def test_a_container_of_more_blocks_than_the_description_names_is_known_by_index() -> None:
    """The description names a container's first 8 children; a ModuleList's are its indices,
    so all 12 blocks are known, and whether each is an FSDP unit can be told."""
    from zdiag.analyzers.detectors.facts import block_paths, model_block_set

    facts = ModelFacts(describe_model(_BlockModel(12)))
    (rep,) = [r for r in facts.description.repeated if r.path == "blocks"]
    assert len(rep.child_names) < rep.count == 12
    blocks = model_block_set(facts)
    assert blocks is not None and blocks.containers == ("blocks",)
    assert block_paths(facts, blocks) == {f"blocks.{k}" for k in range(12)}
