"""The finer wrap: a unit split into one unit per block, from the captured module tree."""

from __future__ import annotations

import msgspec
import pytest

from support.described_models import MIB, described
from zdiag.analyzers.rank.step_model import ModelOp, StepModel
from zdiag.analyzers.whatif import finer_wrap as fw
from zdiag.analyzers.whatif.platform import CommFit, OverheadFit, Platform
from zdiag.analyzers.whatif.replay import replay
from zdiag.analyzers.whatif.run_whatif import Change, WhatIfError, replay_change

GPU = Platform("cuda", True, "test: overlaps")
BLOCKING = Platform("cpu", False, "test: blocking")


def call(
    kind: str, issue: float, wait: float | None, dur: float, phase: str, **kw: object
) -> ModelOp:
    family = "all_gather" if kind == "all_gather" else "reduce"
    return ModelOp(
        kind=kind,
        lane=f"pg|{kind}",
        issue_pos_us=issue,
        after=-1,
        delay_us=kw.pop("delay", 10.0),  # type: ignore[arg-type]
        dur_us=dur,
        wait_pos_us=wait,
        bytes=kw.pop("nbytes", 8 * MIB + MIB // 2),  # type: ignore[arg-type]
        unit="",
        family=family,
        phase=phase,
        **kw,  # type: ignore[arg-type]
    )


def whole_step(blocking_reduce: bool = True) -> StepModel:
    """One root unit: its gather blocks at 100 us (900 us), 3000 us of work, its reduce issued
    at 2900 and awaited at 3000; blocking: it starts only where awaited."""
    g = call("all_gather", 100.0, 100.0, 900.0, "forward")
    r = call("reduce_scatter", 2900.0, 3000.0, 400.0, "backward", delay=10.0)
    if blocking_reduce:
        r = call("reduce_scatter", 2900.0, 3000.0, 400.0, "backward", delay=100.0,
                 start_pos_us=3000.0)  # fmt: skip
    end = replay(StepModel(step=1, start_us=0.0, duration_us=0.0, work_us=3000.0, ops=[g, r]))
    ops = [
        msgspec.structs.replace(op, waited_us=o.waited_us)
        for op, o in zip([g, r], end.ops, strict=True)
    ]
    return StepModel(step=1, start_us=0.0, duration_us=end.duration_us, work_us=3000.0, ops=ops)


def test_the_split_takes_block_sizes_from_the_tree_collapsed_blocks_included() -> None:
    split = fw.wrap_split(described(), "layers", [""])
    assert split.unit == ""
    assert [p for p, _b in split.blocks] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert all(b == 2 * MIB for _p, b in split.blocks)
    assert split.rest_share == pytest.approx(0.5 / 8.5)


def test_a_split_needs_the_captured_tree_and_a_container_of_blocks() -> None:
    with pytest.raises(fw.SplitError, match="captured module tree"):
        fw.wrap_split(None, "layers", [""])
    with pytest.raises(fw.SplitError, match="fewer than two children"):
        fw.wrap_split(described(), "embed", [""])


def test_each_block_gathers_twice_and_reduces_once_where_it_runs() -> None:
    model = whole_step()
    split = fw.wrap_split(described(), "layers", [""])
    out = fw.finer_wrap(model, split, {}, BLOCKING)
    blocks = [op for op in out.ops if op.unit.startswith("layers.")]
    assert len(blocks) == 4 * 3
    fwd = sorted(
        op.issue_pos_us for op in blocks if op.phase == "forward" and op.kind == "all_gather"
    )
    bwd = sorted(
        op.issue_pos_us for op in blocks if op.phase == "backward" and op.kind == "all_gather"
    )
    # forward: the first third of [100, 2900], blocks evenly from where the root's was needed
    assert fwd[0] == pytest.approx(100.0) and fwd[-1] < 100.0 + 2800.0 / 3
    assert min(bwd) >= 100.0 + 2800.0 / 3 - 1e-6 and max(bwd) < 2900.0
    # the bytes are shared as the tree says, and so is the per-byte time of the measured call
    g = [op for op in blocks if op.kind == "all_gather"]
    assert sum(op.bytes for op in g if op.phase == "forward") == pytest.approx(8 * MIB, rel=1e-6)
    assert sum(op.dur_us for op in g if op.phase == "forward") == pytest.approx(900.0 * 8 / 8.5)
    # a reduce that started only where awaited blocks where each block issues its own
    assert all(op.wait_pos_us == op.issue_pos_us for op in blocks if op.kind == "reduce_scatter")


def test_on_a_blocking_platform_the_split_costs_the_backward_regathers() -> None:
    model = whole_step()
    split = fw.wrap_split(described(rest=0), "layers", [""])
    base = replay(model).duration_us  # 3000 of work + the gather (10 + 900) + the reduce (400)
    out = replay(fw.finer_wrap(model, split, {}, BLOCKING)).duration_us
    # every call blocks, one after the other: 8 gathers of 10 + 225 and 4 reduces of 10 + 100
    assert out == pytest.approx(3000.0 + 8 * 235.0 + 4 * 110.0)
    # so the split costs the blocks' backward re-gathers (900), 7 more gather launches, and
    # the reduces' 4 launches beyond the one it replaces (whose peer wait overlapped work)
    assert out - base == pytest.approx(900.0 + 7 * 10.0 + 4 * 10.0)


def test_a_fitted_latency_and_overhead_cost_every_new_call_and_unit() -> None:
    model = whole_step()
    split = fw.wrap_split(described(), "layers", [""])
    fits = {
        "pg|all_gather": CommFit("pg|all_gather", 50.0, 1e4, 4, 2, 0.0, True),
        "pg|reduce_scatter": CommFit("pg|reduce_scatter", 20.0, 1e4, 4, 2, 0.0, True),
    }
    plain = replay(fw.finer_wrap(model, split, {}, BLOCKING)).duration_us
    fitted = replay(fw.finer_wrap(model, split, fits, BLOCKING)).duration_us
    assert fitted > plain  # each of 8 + 1 gathers and 4 + 1 reduces pays its latency
    one_size = OverheadFit(300.0, 0.0, 6, 0.0, sizes=1)
    two_sizes = OverheadFit(300.0, 0.0, 6, 0.0, sizes=2)
    assert replay(fw.finer_wrap(model, split, {}, BLOCKING, one_size)).duration_us == plain
    hooked = replay(fw.finer_wrap(model, split, {}, BLOCKING, two_sizes)).duration_us
    assert hooked == pytest.approx(plain + 4 * 300.0)


def test_where_gathers_overlap_the_blocks_gathers_hide_under_the_previous_block() -> None:
    model = whole_step(blocking_reduce=False)
    split = fw.wrap_split(described(), "layers", [""])
    gpu = replay(fw.finer_wrap(model, split, {}, GPU))
    blocking = replay(fw.finer_wrap(model, split, {}, BLOCKING))
    assert gpu.duration_us < blocking.duration_us
    assert gpu.duration_us < replay(model).duration_us  # the whole gather no longer all exposed


def test_replay_change_splits_where_no_unit_lies_under_the_module() -> None:
    models = {0: [whole_step()], 1: [whole_step()]}
    with pytest.raises(WhatIfError, match="captured module tree"):
        replay_change(models, "cpu", Change(wrap="layers"))
    result = replay_change(models, "cpu", Change(wrap="layers"), model=described())
    assert result.predicted_ms > result.measured_ms  # CPU: the backward re-gathers block
    assert any("finer wrap: 4 blocks" in n for n in result.notes)
    # memory: the root gathered whole (8.5 MiB) against its rest plus two blocks (4.5 MiB)
    assert result.memory_delta_bytes == pytest.approx(-4 * MIB, abs=8)


def test_a_split_without_a_units_hook_cost_is_a_lower_bound_and_says_so() -> None:
    from zdiag.render.whatif_text import render_whatif_text, whatif_json

    models = {0: [whole_step()], 1: [whole_step()]}
    result = replay_change(models, "cpu", Change(wrap="layers"), model=described())
    assert result.lower_bound  # one unit: no per-unit hook cost to add
    assert " -> at least " in render_whatif_text(result).splitlines()[0]
    assert whatif_json(result)["predicted_is_lower_bound"] is True
    merged = replay_change(models, "cpu", Change(prefetch=1))
    assert not merged.lower_bound and " -> at least " not in render_whatif_text(merged)


def test_a_unit_without_its_gradient_reduce_cannot_be_split() -> None:
    """A GPU trace over gloo whose reduce the FSDP labels do not name: without the end of the
    unit's backward the blocks would be spread over the optimizer step too, so the split is
    refused (the finding then keeps its own estimate)."""
    step = whole_step()
    no_reduce = msgspec.structs.replace(step, ops=[op for op in step.ops if op.family != "reduce"])
    with pytest.raises(WhatIfError, match="no gradient reduce"):
        replay_change({0: [no_reduce]}, "cuda", Change(wrap="layers"), model=described())
