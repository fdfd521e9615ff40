"""Micro-batches: the passes run K times, their compute at 1/K, gradients reduced once."""

from __future__ import annotations

import msgspec
import pytest

from zdiag.analyzers.rank.step_model import ModelOp, StepModel
from zdiag.analyzers.whatif.micro_batch import MicroBatchError, micro_batched, passes_span
from zdiag.analyzers.whatif.replay import replay
from zdiag.analyzers.whatif.run_whatif import Change, WhatIfError, replay_change


def call(kind: str, family: str, pos: float, dur: float, phase: str) -> ModelOp:
    """A blocking FSDP call: issued and awaited at `pos`."""
    return ModelOp(
        kind=kind,
        lane=f"pg|{kind}",
        issue_pos_us=pos,
        after=-1,
        delay_us=0.0,
        dur_us=dur,
        wait_pos_us=pos,
        bytes=1000,
        unit="layers.0",
        family=family,
        phase=phase,
        needed_pos_us=pos if family == "all_gather" else None,
    )


def step() -> StepModel:
    """1000 us of progress: data until 100, the passes from the gather at 100 (50 us, blocking)
    to the reduce issued at 900 (40 us, blocking), 20 us of the unit's hooks at 100 and a 10 us
    host sync at 500 inside them, the optimizer after."""
    ops = [
        call("all_gather", "all_gather", 100.0, 50.0, "forward"),
        call("reduce_scatter", "reduce", 900.0, 40.0, "backward"),
    ]
    return StepModel(
        step=1,
        start_us=0.0,
        duration_us=1090.0,
        work_us=1000.0,
        ops=ops,
        syncs=[(500.0, 10.0, True)],
        unit_chunks=[(100.0, 20.0, "layers.0")],
    )


def test_the_passes_run_k_times_their_compute_shrunk_and_gradients_reduced_once() -> None:
    model = step()
    assert passes_span(model) == (100.0, 900.0)
    out = micro_batched(model, 2)
    # per micro-batch: 30 us of hooks and syncs as measured + 770 us of compute / 2 = 415 us
    assert out.work_us == pytest.approx(100.0 + 2 * 415.0 + 100.0)
    gathers = [op.issue_pos_us for op in out.ops if op.family == "all_gather"]
    reduces = [op.issue_pos_us for op in out.ops if op.family == "reduce"]
    assert gathers == pytest.approx([100.0, 515.0])
    assert reduces == pytest.approx([100.0 + 2 * 415.0])  # in the last micro-batch only
    assert len(out.syncs) == 2 and len(out.unit_chunks) == 2
    # the replay: the new progress plus both gathers and the one reduce, all blocking
    assert replay(out).duration_us == pytest.approx(out.work_us + 2 * 50.0 + 40.0)


def test_what_lies_after_the_passes_moves_on_by_what_they_grew() -> None:
    model = step()
    late = call("all_reduce", "", 950.0, 5.0, "")  # e.g. a gradient-norm all-reduce
    model = msgspec.structs.replace(model, ops=[*model.ops, late])
    out = micro_batched(model, 2)
    grown = 2 * (30.0 + 770.0 / 2) - 800.0  # the hooks and the sync run twice at full length
    assert [op.issue_pos_us for op in out.ops if op.kind == "all_reduce"] == [950.0 + grown]


def test_micro_batches_need_the_fsdp_passes_and_two_or_more() -> None:
    bare = StepModel(step=1, start_us=0.0, duration_us=100.0, work_us=100.0)
    with pytest.raises(MicroBatchError):
        micro_batched(bare, 2)
    with pytest.raises(WhatIfError, match="FSDP and ZeRO runs only"):
        replay_change({0: [bare]}, "cpu", Change(micro_batches=2))
    with pytest.raises(WhatIfError, match="2 or more"):
        replay_change({0: [step()]}, "cpu", Change(micro_batches=1))
    result = replay_change({0: [step()]}, "cpu", Change(micro_batches=2))
    assert result.predicted_ms > result.measured_ms
    assert result.memory_delta_bytes is None and "activations" in result.memory_basis


def test_what_lies_at_the_passes_end_follows_the_last_micro_batch() -> None:
    model = msgspec.structs.replace(step(), syncs=[(500.0, 10.0, True), (900.0, 5.0, False)])
    out = micro_batched(model, 2)
    # the sync at 500 runs in each micro-batch: after the 20 us of hooks and half of the 380 us
    # of compute before it; the one where the last reduce is issued stays after them both
    first, second, last = sorted(p for p, _n, _o in out.syncs)
    assert (first, second) == pytest.approx((100.0 + 20.0 + 190.0, 515.0 + 20.0 + 190.0))
    assert last == pytest.approx(100.0 + 2 * 415.0)
