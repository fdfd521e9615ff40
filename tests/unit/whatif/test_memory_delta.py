"""Memory deltas from the activations a run measured: checkpointing and micro-batches."""

from __future__ import annotations

from support.described_models import MIB, described, measured
from zdiag.analyzers.rank.step_model import ModelOp, StepModel
from zdiag.analyzers.whatif.memory_delta import checkpoint_saving, memory_delta, micro_batch_delta
from zdiag.analyzers.whatif.run_whatif import Change


def _step(gathers: dict[str, int]) -> StepModel:
    """A step whose FSDP units gathered these bytes."""
    ops = [
        ModelOp(kind="all_gather", lane="pg|all_gather", issue_pos_us=10.0 * k, after=-1,
                delay_us=0.0, dur_us=5.0, wait_pos_us=None, bytes=b, unit=u,
                family="all_gather", phase="forward")
        for k, (u, b) in enumerate(gathers.items())
    ]  # fmt: skip
    return StepModel(step=1, start_us=0.0, duration_us=100.0, work_us=100.0, ops=ops)


def test_checkpointing_frees_the_saved_tensors_less_inputs_and_one_recompute() -> None:
    facts = measured(blocks=4, saved=10 * MIB, inputs=MIB)
    freed, how = checkpoint_saving(facts, "layers") or (0, "")
    assert freed == 4 * 10 * MIB - 4 * MIB - 10 * MIB
    assert "40.0 MiB" in how and "4.0 MiB" in how
    assert checkpoint_saving(facts, "encoder") is None  # no measured block there
    assert checkpoint_saving(described(blocks=4), "layers") is None  # nothing measured


def test_micro_batches_shrink_the_activations_and_hold_the_unsharded_gradients() -> None:
    facts = measured(blocks=4, saved=10 * MIB, inputs=MIB)  # 40 MiB saved in all
    steps = [_step({"layers.0": 2 * MIB, "layers.1": 2 * MIB, "": MIB})]
    delta, how = micro_batch_delta(facts, steps, 4) or (0, "")
    assert delta == 5 * MIB - 30 * MIB  # the units' 5 MiB of gradients held, 3/4 of 40 freed
    assert "1/4" in how and "unsharded gradients" in how
    d, basis = memory_delta(steps, Change(micro_batches=4), model=facts)
    assert d == delta and basis == how
    assert micro_batch_delta(described(4), steps, 4) is None  # nothing measured
    unknown, why = memory_delta(steps, Change(micro_batches=2, checkpoint="layers"), model=facts)
    assert unknown is None and "together" in why


def test_without_fsdp_units_the_whole_models_gradients_are_held() -> None:
    facts = measured(blocks=2, saved=8 * MIB, inputs=MIB)
    delta, how = micro_batch_delta(facts, [_step({})], 2) or (0, "")
    assert delta == facts.description.param_bytes - 8 * MIB
    assert "the model's gradients" in how
