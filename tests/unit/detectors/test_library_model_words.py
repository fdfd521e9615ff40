"""Issue 30, on synthetic model descriptions: prefetch lists that name the unit itself, the
unshard async op a CPU FSDP2 run lacks, the whole-wrap saving from the captured block sizes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from support.ledger_traces import BLOCKS, fsdp2_cpu_trace, write
from support.trace_contexts import trace_context
from zdiag.analyzers.detectors import missing_overlap, step_verdicts
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.detectors.unshard_async_op import ASYNC_OP_LINE
from zdiag.analyzers.inputs.model_facts import ModelFacts
from zdiag.analyzers.rank.rank_analysis import RankFacts
from zdiag.analyzers.report import StepBreakdown
from zdiag.collectors.model_schema import Fsdp2Unit, ModelDescription

LAYERS = ("layers.0", "layers.1", "layers.2")


def _fsdp2_model(
    forward: Mapping[str, tuple[str, ...]],
    backward: Mapping[str, tuple[str, ...]],
    *,
    root_forward: tuple[str, ...] = (),
    async_op: bool | None = None,
) -> ModelFacts:
    """An FSDP2 description: the root and LAYERS, each with the prefetch lists given (a unit
    not named prefetches nothing)."""
    root = Fsdp2Unit(
        path="", cls="Net", forward_prefetch=root_forward, backward_prefetch=(),
        unshard_async_op=async_op,
    )  # fmt: skip
    units = tuple(
        Fsdp2Unit(
            path=p,
            cls="Block",
            forward_prefetch=forward.get(p, ()),
            backward_prefetch=backward.get(p, ()),
            unshard_async_op=async_op,
        )
        for p in LAYERS
    )
    return ModelFacts(ModelDescription(framework="fsdp2", fsdp2_units=(root, *units)))


def _serial_ctx(tmp_path: Path, model: ModelFacts) -> DetectorContext:
    return trace_context(write(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=2)), model=model)


def test_missing_overlap_names_a_prefetch_list_that_names_the_unit_itself(
    tmp_path: Path,
) -> None:
    """`blocks[i].set_modules_to_forward_prefetch([blocks[i]])`: the finding names the bug, not
    the docs' default recipe word for word (what a run with no lists at all gets)."""
    own = {p: (p,) for p in LAYERS}
    (f,) = missing_overlap.detect(_serial_ctx(tmp_path, _fsdp2_model(own, own)))
    assert f.recommendation.startswith("`blocks[i]` prefetches itself (forward: layers.0, ")
    assert "`blocks[i].set_modules_to_backward_prefetch([blocks[i]])`" in f.recommendation
    assert "where `[blocks[i + 1]]` was meant" in f.recommendation
    code = f.code or ""
    assert code.startswith("# replaces blocks[i].set_modules_to_forward_prefetch([blocks[i]])")
    assert "blocks[i].set_modules_to_forward_prefetch([blocks[i + 1]])" in code
    (plain,) = missing_overlap.detect(_serial_ctx(tmp_path, _fsdp2_model({}, {})))
    assert "prefetches itself" not in plain.recommendation + (plain.code or "")
    assert f.recommendation.endswith(plain.recommendation)  # the remedy itself is the same


def test_missing_overlap_names_only_the_direction_that_prefetches_itself(tmp_path: Path) -> None:
    """Backward lists right, forward lists naming the unit itself: only the forward call is named."""
    forward = {p: (p,) for p in LAYERS}
    backward = {"layers.1": ("layers.0",), "layers.2": ("layers.1",)}
    (f,) = missing_overlap.detect(_serial_ctx(tmp_path, _fsdp2_model(forward, backward)))
    assert "prefetches itself (forward: layers.0, layers.1, layers.2 call" in f.recommendation
    assert "set_modules_to_backward_prefetch([blocks[i]])" not in f.recommendation


def _exposed_comm_ctx(model: ModelFacts, kernels: int = 0) -> DetectorContext:
    """Two ranks of steps, most of them exposed-comm, FSDP2; CPU-only without `kernels`."""
    step = StepBreakdown(
        step=1, duration_ms=100.0, compute_ms=60.0, comm_ms=40.0, overlapped_ms=0.0,
        exposed_comm_ms=40.0, idle_ms=0.0, verdict="exposed-comm", kernel_count=kernels,
    )  # fmt: skip
    return DetectorContext(
        ledgers={},
        breakdowns={0: [step, step], 1: [step, step]},
        facts={0: RankFacts(framework="fsdp2"), 1: RankFacts(framework="fsdp2")},
        model=model,
    )


def test_exposed_comm_on_cpu_fsdp2_proposes_the_unshard_async_op_it_lacks() -> None:
    """A CPU FSDP2 run with every prefetch list set explicitly but no unshard async op is not
    told it "already sets every FSDP2 overlap option": it gets that setting. With it set, the
    claim is true and stays; on GPUs the op is not needed."""
    forward = {"layers.0": ("layers.1",), "layers.1": ("layers.2",)}
    backward = {"layers.1": ("layers.0",), "layers.2": ("layers.1",)}
    model = _fsdp2_model(forward, backward, root_forward=("layers.0",))
    lacking = _exposed_comm_ctx(model)
    assert lacking.sheet.cpu_only and not lacking.sheet.gathers_can_overlap()
    (f,) = step_verdicts.detect_exposed_comm(lacking)
    assert "already sets" not in f.recommendation
    assert (f.code or "").startswith(ASYNC_OP_LINE)
    assert "until its unshard runs as an async op" in f.recommendation
    assert "whatever these settings" not in f.recommendation
    # a context without the traces' step models: what the op hides is not predicted (0 ms)
    assert f.severity == "info" and f.expected_gain_ms == 0.0
    assert "is not predicted" in f.gain_method
    with_op = _exposed_comm_ctx(
        _fsdp2_model(forward, backward, root_forward=("layers.0",), async_op=True)
    )
    (g,) = step_verdicts.detect_exposed_comm(with_op)
    assert "already sets every FSDP2 (fully_shard) overlap option" in g.recommendation
    assert g.code is None and g.severity == "info" and g.expected_gain_ms == 0.0
    (h,) = step_verdicts.detect_exposed_comm(_exposed_comm_ctx(model, kernels=5))
    assert "already sets every" in h.recommendation and h.code is None  # not needed on GPUs


def test_exposed_comm_and_missing_overlap_give_one_replayed_gain(tmp_path: Path) -> None:
    """On a CPU FSDP2 run without the unshard async op whose steps are modelled, both findings
    propose prefetching with that op and both take its gain from the same replay: one figure,
    naming the `zdiag whatif` command that gives it."""
    import dataclasses

    ctx = trace_context(
        write(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=2)), model=_fsdp2_model({}, {})
    )
    step = StepBreakdown(
        step=1, duration_ms=4.0, compute_ms=2.4, comm_ms=1.6, overlapped_ms=0.0,
        exposed_comm_ms=1.6, idle_ms=0.0, verdict="exposed-comm",
    )  # fmt: skip
    ctx = dataclasses.replace(ctx, breakdowns={0: [step, step]})
    assert ctx.sheet.cpu_only and not ctx.sheet.gathers_can_overlap()
    (e,) = step_verdicts.detect_exposed_comm(ctx)
    (m,) = missing_overlap.detect(ctx)
    assert e.expected_gain_ms == m.expected_gain_ms
    assert e.expected_gain_ms is not None and e.expected_gain_ms > 0
    assert "zdiag whatif --prefetch 1 --unshard-async-op" in e.gain_method
    assert e.gain_method == m.gain_method
    from zdiag.analyzers.whatif.run_whatif import Change

    assert list(ctx.replays) == [Change(prefetch=1, unshard_async_op=True)]  # replayed once


RESNET18 = Path(__file__).parents[2] / "data" / "library_models" / "resnet18_fsdp1.model.json"


def test_whole_wrap_saving_comes_from_the_captured_block_sizes() -> None:
    """ResNet-18 (its description captured from tests/data/library_models/resnet18_fsdp1.py):
    layer4's two blocks hold 33.6 MB of the 46.8 MB model, so per-block units save ~11 MB at the
    peak, not the 33.5 MB eight equal blocks would give."""
    import json

    from zdiag.analyzers.detectors import whole_model_wrap as wmw
    from zdiag.analyzers.detectors.facts import model_block_set

    model = ModelFacts(ModelDescription.from_json(json.loads(RESNET18.read_text())))
    blocks = model_block_set(model)
    assert blocks is not None and blocks.count == 8 and blocks.block_class == "BasicBlock"
    share = wmw._block_share(model, blocks, {})
    assert share.peak is not None and 0.71 < share.peak < 0.73
    whole = model.description.param_bytes
    saved, method = wmw._memory_gain(whole, blocks.count, True, share)
    assert saved is not None and 10.5e6 < saved < 11.5e6
    assert "the 2 largest of 8 blocks" in method
    equal, _ = wmw._memory_gain(whole, blocks.count, True, dataclasses.replace(share, peak=None))
    assert equal is not None and equal > 30e6  # what the equal-blocks arithmetic claimed


def test_fsdp1_code_on_a_cpu_run_carries_its_device_id() -> None:
    """FSDP1 refuses a CPU-only machine without `device_id`: a CPU run's printed calls carry the
    run's own; an accelerator run's keep the user's (the closing comment says so)."""
    from zdiag.analyzers.frameworks import BlockSet, RunFacts, fsdp1

    blocks = BlockSet(container="layer4", block_class="BasicBlock", count=8)
    for device in ("cpu", "cuda"):
        facts = RunFacts(
            framework="fsdp1", blocks=blocks, blocks_are_units=False, device_type=device
        )
        for remedy in (fsdp1.wrap_blocks(facts), fsdp1.overlap(facts), fsdp1.bf16_comm(facts)):
            assert remedy is not None and remedy.code is not None
            code = remedy.code
            on_cpu = 'device_id=torch.device("cpu"))' in code
            assert on_cpu == (device == "cpu"), code
            assert code.startswith("import torch\n") == (device == "cpu" or "bfloat16" in code)
            assert code.count("import torch\n") <= 1


def test_host_bound_on_a_cpu_only_run_names_the_host_not_a_device() -> None:
    """Most steps host-bound: on a CPU-only run (no device kernel) the host's training thread
    idles; with device kernels, the device."""
    from zdiag.analyzers.detectors.step_verdicts import detect_host_bound

    def ctx(kernels: int) -> DetectorContext:
        step = StepBreakdown(
            step=1, duration_ms=100.0, compute_ms=30.0, comm_ms=0.0, overlapped_ms=0.0,
            exposed_comm_ms=0.0, idle_ms=70.0, verdict="host-bound", kernel_count=kernels,
        )  # fmt: skip
        return DetectorContext(ledgers={}, breakdowns={0: [step, step]}, facts={})

    (cpu,) = detect_host_bound(ctx(0))
    assert "host-bound: the host's training thread idles 70.0 ms" in cpu.title
    assert "device" not in cpu.title
    (gpu,) = detect_host_bound(ctx(5))
    assert "host-bound: the device idles 70.0 ms" in gpu.title


def test_whole_wrap_ignores_block_sizes_that_count_shards() -> None:
    """An FSDP1 description whose modules hold views of this rank's shards (use_orig_params: the
    model's bytes are half its flat parameter's, split unevenly over the blocks) gives no
    per-block sizes: the saving falls back to equal blocks rather than trusting them."""
    import json

    from zdiag.analyzers.detectors import whole_model_wrap as wmw
    from zdiag.analyzers.detectors.facts import model_block_set

    data = json.loads(RESNET18.read_text())
    assert wmw._block_sizes(ModelFacts(ModelDescription.from_json(data)))
    data["fsdp1"][0]["flat_param_bytes"] = 2 * data["param_bytes"]
    model = ModelFacts(ModelDescription.from_json(data))
    assert wmw._block_sizes(model) == []
    assert wmw._block_share(model, model_block_set(model), {}).peak is None
