"""The replay engine and the counterfactuals on hand-built step models, checked by hand."""

from __future__ import annotations

import msgspec
import pytest

from zdiag.analyzers.rank.step_model import ModelOp, StepModel
from zdiag.analyzers.whatif import counterfactuals as cf
from zdiag.analyzers.whatif.platform import (
    CommFit,
    Platform,
    fit_comm,
    fit_unit_overhead,
    platform_of,
)
from zdiag.analyzers.whatif.replay import replay

GPU = Platform("cuda", True, "test: overlaps")
BLOCKING = Platform("cpu", False, "test: blocking")


def gather(
    unit: str,
    issue: float,
    wait: float | None,
    dur: float,
    phase: str = "forward",
    nbytes: int = 1000,
    delay: float = 0.0,
    after: int = 0,
) -> ModelOp:
    return ModelOp(
        kind="all_gather",
        lane="pg|all_gather",
        issue_pos_us=issue,
        after=after,
        delay_us=delay,
        dur_us=dur,
        wait_pos_us=wait,
        bytes=nbytes,
        unit=unit,
        family="all_gather",
        phase=phase,
    )


def serialized() -> StepModel:
    """Three units, each gathered where it is needed (prefetch off): 30 us each, exposed; 100 us
    of work per unit. Progress 300 us; step 300 + 3 * 30 = 390 us."""
    ops = [gather(f"blocks.{k}", 100.0 * k, 100.0 * k, 30.0) for k in range(3)]
    return StepModel(step=1, start_us=0.0, duration_us=390.0, work_us=300.0, ops=ops)


def test_unchanged_replay_gives_back_the_step() -> None:
    r = replay(serialized())
    assert r.duration_us == pytest.approx(390.0)
    assert r.waited_us == pytest.approx(90.0)
    assert [round(o.start_us) for o in r.ops] == [0, 130, 260]


def test_prefetch_one_hides_all_but_the_first_gather_on_an_overlapping_platform() -> None:
    changed = cf.prefetch(serialized(), 1, GPU)
    r = replay(changed)
    # blocks.1 is issued where blocks.0 starts (position 0), queues behind blocks.0's gather
    # (ends at 30) and ends at 60, long before its consumer at time 130
    assert r.duration_us == pytest.approx(330.0)
    assert r.waited_us == pytest.approx(30.0)


def test_prefetch_changes_nothing_where_gathers_block() -> None:
    assert cf.prefetch(serialized(), 2, BLOCKING) == serialized()


def test_a_gather_longer_than_the_work_it_hides_under_stays_partly_exposed() -> None:
    m = StepModel(
        step=1,
        start_us=0.0,
        duration_us=0.0,
        work_us=200.0,
        ops=[gather("a", 0.0, 0.0, 10.0), gather("b", 100.0, 100.0, 150.0)],
    )
    r = replay(cf.prefetch(m, 1, GPU))
    # b issued at 0, queued behind a (ends 10), runs 10..160; its consumer arrives at 110
    assert r.duration_us == pytest.approx(200.0 + 10.0 + 50.0)


def test_no_reshard_after_forward_drops_backward_regathers_only() -> None:
    ops = [
        gather("a", 0.0, 0.0, 10.0),
        gather("a", 50.0, 50.0, 10.0, phase="backward"),
        gather("root", 60.0, 60.0, 5.0, phase="backward"),
    ]
    m = StepModel(step=1, start_us=0.0, duration_us=0.0, work_us=100.0, ops=ops)
    kept = cf.no_reshard_after_forward(m)
    assert [(o.unit, o.phase) for o in kept.ops] == [("a", "forward"), ("root", "backward")]
    assert replay(kept).duration_us == pytest.approx(115.0)


def test_coarser_wrap_merges_units_and_costs_one_fitted_call() -> None:
    ops = [
        gather(f"layers.0.{n}", 10.0 * k, 10.0 * k, 40.0, nbytes=1000)
        for k, n in enumerate(("q", "k", "v"))
    ]
    m = StepModel(step=1, start_us=0.0, duration_us=0.0, work_us=100.0, ops=ops)
    fit = CommFit(
        "pg|all_gather",
        alpha_us=20.0,
        bytes_per_us=100.0,
        calls=3,
        sizes=2,
        error=0.0,
        latency_known=True,
    )
    merged = cf.coarser_wrap(m, "layers", {"pg|all_gather": fit}, BLOCKING)
    assert len(merged.ops) == 1
    assert merged.ops[0].unit == "layers.0"
    assert merged.ops[0].bytes == 3000
    assert merged.ops[0].dur_us == pytest.approx(20.0 + 3000 / 100.0)
    assert replay(merged).duration_us == pytest.approx(100.0 + 50.0)


def test_coarser_wrap_shrinks_the_units_own_ranges_by_the_overhead_fit() -> None:
    ops = [
        gather("layers.0.a", 0.0, 0.0, 1.0, nbytes=100),
        gather("layers.0.b", 50.0, 50.0, 1.0, nbytes=300),
    ]
    chunks = [(0.0, 20.0, "layers.0.a"), (50.0, 20.0, "layers.0.b")]
    m = StepModel(step=1, start_us=0.0, duration_us=0.0, work_us=100.0, ops=ops, unit_chunks=chunks)
    fit = fit_unit_overhead([m])
    assert fit is not None
    merged = cf.coarser_wrap(m, "layers", {}, BLOCKING, fit)
    # the fit through (100 B, 20 us) and (300 B, 20 us) is flat: 20 us per unit, so merging two
    # units saves 20 us of progress
    assert merged.work_us == pytest.approx(80.0)


def test_removing_host_syncs_shortens_progress_and_moves_later_ops() -> None:
    m = StepModel(
        step=1,
        start_us=0.0,
        duration_us=130.0,
        work_us=100.0,
        ops=[gather("a", 60.0, 60.0, 30.0)],
        syncs=[(10.0, 5.0, True), (40.0, 5.0, True)],
    )
    out = cf.without_host_syncs(m)
    assert out.work_us == pytest.approx(90.0)
    assert out.ops[0].issue_pos_us == pytest.approx(50.0)
    assert replay(out).duration_us == pytest.approx(120.0)


def test_removing_the_models_syncs_keeps_the_optimizers_and_moves_them() -> None:
    """`--no-model-syncs`: only the syncs marked the model's own go; the optimizer's sync at 40
    stays, moved back by the 5 us cut before it."""
    m = StepModel(
        step=1,
        start_us=0.0,
        duration_us=130.0,
        work_us=100.0,
        ops=[gather("a", 60.0, 60.0, 30.0)],
        syncs=[(10.0, 5.0, True), (40.0, 5.0, False)],
    )
    out = cf.without_host_syncs(m, model_only=True)
    assert out.work_us == pytest.approx(95.0)
    assert out.syncs == [(35.0, 5.0, False)]
    assert out.ops[0].issue_pos_us == pytest.approx(55.0)
    assert cf.without_host_syncs(out, model_only=True) == out  # nothing of the model's left


def test_measured_depth_reads_how_far_ahead_gathers_were_issued() -> None:
    assert cf.measured_depth(serialized()) == 0
    assert cf.measured_depth(cf.prefetch(serialized(), 1, GPU)) == 1
    assert cf.measured_depth(cf.prefetch(serialized(), 2, GPU)) == 2


def test_comm_fit_recovers_latency_and_bandwidth() -> None:
    ops = [
        ModelOp(
            kind="all_gather",
            lane="pg|ag",
            issue_pos_us=0.0,
            after=-1,
            delay_us=0.0,
            dur_us=50.0 + b / 200.0,
            bytes=b,
        )
        for b in (1000, 4000, 16000, 64000)
    ]
    fit = fit_comm([StepModel(step=0, start_us=0.0, duration_us=1.0, work_us=1.0, ops=ops)])[
        "pg|ag"
    ]
    assert fit.latency_known
    assert fit.alpha_us == pytest.approx(50.0, rel=1e-6)
    assert fit.bytes_per_us == pytest.approx(200.0, rel=1e-6)
    assert fit.error == pytest.approx(0.0, abs=1e-9)


def test_one_message_size_gives_no_latency() -> None:
    ops = [
        ModelOp(
            kind="all_gather",
            lane="pg|ag",
            issue_pos_us=0.0,
            after=-1,
            delay_us=0.0,
            dur_us=d,
            bytes=1000,
        )
        for d in (10.0, 12.0)
    ]
    fit = fit_comm([StepModel(step=0, start_us=0.0, duration_us=1.0, work_us=1.0, ops=ops)])[
        "pg|ag"
    ]
    assert not fit.latency_known and fit.alpha_us == 0.0


def test_platform_on_cpu_follows_the_configuration_then_the_trace() -> None:
    hidden = StepModel(
        step=0, start_us=0.0, duration_us=1.0, work_us=1.0, ops=[gather("a", 0.0, 10.0, 10.0)]
    )
    exposed = StepModel(
        step=0,
        start_us=0.0,
        duration_us=1.0,
        work_us=1.0,
        ops=[msgspec_replace(gather("a", 0.0, 0.0, 10.0), waited_us=10.0)],
    )
    assert platform_of("cuda", [exposed]).gathers_overlap
    assert platform_of("cpu", [hidden]).gathers_overlap
    assert not platform_of("cpu", [exposed]).gathers_overlap
    assert platform_of("cpu", [exposed], unshard_async_op=True).gathers_overlap


def msgspec_replace(op: ModelOp, **kw: object) -> ModelOp:
    import msgspec

    return msgspec.structs.replace(op, **kw)


def test_wrap_prefixes_may_name_several_containers() -> None:
    assert (
        cf.wrap_key("encoder.towers.1.attn.q", "decoder.towers,encoder.towers")
        == "encoder.towers.1"
    )
    assert (
        cf.wrap_key("decoder.towers.0.ffn", "decoder.towers,encoder.towers") == "decoder.towers.0"
    )
    assert cf.wrap_key("head", "decoder.towers,encoder.towers") is None
    assert cf.wrap_key("layers", "layers") is None  # the container itself is not under it


def test_comm_fit_without_growth_keeps_the_fastest_latency() -> None:
    """Latency-bound calls (no growth with size): merging them must not cost more than the
    calls it replaces (a bandwidth from the smallest message's time made a merged call 7x
    slower than all its members together)."""
    sizes = (1024, 65536, 262144, 720896)
    ops = [
        ModelOp(
            kind="all_gather",
            lane="pg|ag",
            issue_pos_us=0.0,
            after=-1,
            delay_us=0.0,
            dur_us=d,
            bytes=b,
        )
        for b, d in zip(sizes, (900.0, 880.0, 870.0, 860.0), strict=True)
    ]
    fit = fit_comm([StepModel(step=0, start_us=0.0, duration_us=1.0, work_us=1.0, ops=ops)])[
        "pg|ag"
    ]
    assert fit.alpha_us == pytest.approx(860.0)
    merged = fit.duration_us(sum(sizes))
    assert merged < sum((900.0, 880.0, 870.0, 860.0))


def _one_call(rank_dur: float, work: float = 100.0) -> list[StepModel]:
    """One step: `work` µs of progress, then one blocking all-reduce of `rank_dur` µs, waited."""
    op = ModelOp(
        kind="all_reduce",
        lane="pg|all_reduce",
        issue_pos_us=work,
        after=-1,
        delay_us=0.0,
        dur_us=rank_dur,
        wait_pos_us=work,
        waited_us=rank_dur,
    )
    return [StepModel(step=5, start_us=0.0, duration_us=work + rank_dur, work_us=work, ops=[op])]


def test_without_a_straggler_the_others_lose_its_lead_over_the_last_of_them() -> None:
    # the call ends together on every rank: rank 1 arrived last (its call is the shortest, 4 µs),
    # rank 2 last of the others (7 µs); rank 1's lead over rank 2 is 3 µs
    models = {0: _one_call(10.0), 1: _one_call(4.0), 2: _one_call(7.0)}
    changed = cf.without_stragglers(models, [1])
    assert set(changed) == {0, 2}  # the straggler's own steps are not replayed
    assert [m[0].ops[0].dur_us for m in (changed[0], changed[2])] == [7.0, 4.0]
    assert replay(changed[0][0]).duration_us == pytest.approx(107.0)
    # a rank that is never last costs nothing when removed
    assert cf.without_stragglers(models, [0])[2][0].ops[0].dur_us == 7.0


def test_a_straggler_removed_runs_as_its_peers_do() -> None:
    from zdiag.analyzers.whatif.run_whatif import Change, WhatIfError, replay_change

    models = {0: _one_call(10.0), 1: _one_call(4.0, work=106.0), 2: _one_call(7.0)}
    result = replay_change(models, "cpu", Change(without_stragglers=(1,)))
    by_rank = {r.rank: r for r in result.ranks}
    assert by_rank[0].predicted_ms == pytest.approx(0.107)
    assert by_rank[2].predicted_ms == pytest.approx(0.104)
    assert by_rank[1].measured_ms == pytest.approx(0.110)
    assert by_rank[1].predicted_ms == pytest.approx((0.107 + 0.104) / 2)  # the peers' median
    assert result.change.label() == "--without-straggler 1"
    with pytest.raises(WhatIfError, match="at least one other modelled rank"):
        replay_change(models, "cpu", Change(without_stragglers=(0, 1, 2)))


def three_blocks() -> StepModel:
    """Forward: layers.0-2 gathered where they run (0, 100, 200 µs of progress, 100 µs of work
    each, 10 µs gathers, exposed); 100 µs of head and loss; backward: layers.2 at 400, layers.1
    at 500 (its gather issued at 400, ahead: hidden), layers.0 at 600; step work 700 µs, five
    exposed gathers: 750 µs."""
    ops = [gather(f"layers.{k}", 100.0 * k, 100.0 * k, 10.0, after=-1) for k in range(3)]
    ops += [
        gather("layers.2", 400.0, 400.0, 10.0, phase="backward", after=-1),
        gather("layers.1", 400.0, 500.0, 10.0, phase="backward", after=-1),
        gather("layers.0", 600.0, 600.0, 10.0, phase="backward", after=-1),
    ]
    return StepModel(step=1, start_us=0.0, duration_us=750.0, work_us=700.0, ops=ops)


def test_checkpointing_runs_each_blocks_forward_again_where_its_backward_starts() -> None:
    model = three_blocks()
    assert replay(model).duration_us == pytest.approx(750.0)
    assert cf.block_forwards(model, "layers") == {
        "layers.0": 100.0,
        "layers.1": 100.0,
        "layers.2": 100.0,  # the last block: the others' median
    }
    changed, unplaced = cf.checkpointed(model, "layers")
    assert unplaced == 0
    assert changed.work_us == pytest.approx(1000.0)
    backward = [op for op in changed.ops if op.phase == "backward"]
    # each recompute comes after its block's gather is consumed, before what follows
    assert [op.wait_pos_us for op in backward] == [400.0, 600.0, 800.0]
    assert backward[1].issue_pos_us == 400.0  # the backward prefetch stays where it was issued
    assert replay(changed).duration_us == pytest.approx(1050.0)


def test_checkpointing_leaves_blocks_kept_unsharded_after_forward_as_measured() -> None:
    changed, unplaced = cf.checkpointed(cf.no_reshard_after_forward(three_blocks()), "layers")
    assert unplaced == 3
    assert changed.work_us == pytest.approx(700.0)


def test_checkpointing_needs_two_blocks_gathered_in_forward() -> None:
    from zdiag.analyzers.whatif.run_whatif import Change, WhatIfError, replay_change

    with pytest.raises(WhatIfError, match="at least two of them gathered"):
        replay_change({0: [three_blocks()]}, "cuda", Change(checkpoint="nowhere"))
    result = replay_change({0: [three_blocks()]}, "cuda", Change(checkpoint="layers"))
    assert result.predicted_ms == pytest.approx(1.050)
    assert result.memory_delta_bytes is None  # the step model holds no activation sizes
    assert result.change.label() == "--checkpoint layers"


def test_a_gather_issued_ahead_but_started_late_moves_on_a_gpu_only() -> None:
    """layers.1's gather was issued while layers.0 ran (position 0) but started only at 100,
    where it was needed. On a GPU the host runs ahead of the device, so only the start counts
    and prefetching moves it; on CPU the training thread issued it ahead already, and it started
    late because gloo's worker thread was busy, which a deeper prefetch does not change."""
    late = msgspec.structs.replace(
        gather("layers.1", 0.0, 100.0, 30.0, after=-1), start_pos_us=100.0, delay_us=100.0
    )
    model = StepModel(
        step=1,
        start_us=0.0,
        duration_us=360.0,
        work_us=300.0,
        ops=[gather("layers.0", 0.0, 0.0, 30.0, after=-1), late],
    )
    cpu = Platform("cpu", True, "test: async unshard")
    assert cf.prefetch(model, 1, cpu).ops[1] == late
    moved = cf.prefetch(model, 1, GPU).ops[1]
    assert moved.issue_pos_us == 0.0 and moved.delay_us == 0.0


def test_blocking_cpu_gathers_issued_when_needed_move_with_the_async_op() -> None:
    """CPU without the async op: each gather blocked the training thread where it was issued,
    when needed. Replayed with the async op and prefetch depth 1, the last two hide."""
    cpu = Platform("cpu", True, "test: the change sets the async op")
    assert replay(cf.prefetch(serialized(), 1, cpu)).duration_us == pytest.approx(330.0)


def test_a_gather_its_own_hooks_issued_before_its_wait_was_not_sent_ahead() -> None:
    """FSDP2 without prefetch on CPU: each unit's pre-forward begins (needed), issues its own
    gather 10 us later and waits for it 15 us after the issue (15 us exposed per unit: 345 us).
    The issue lies before the wait,
    but inside the consumer's own hooks: not a prefetch. With the async op and depth 1 the
    gather moves to where the unit before starts (the ledger's needed position decides; judged
    by the wait alone, it would count as issued one unit ahead and stay)."""
    ops = [
        msgspec.structs.replace(
            gather(f"blocks.{k}", 100.0 * k + 10.0, 100.0 * k + 25.0, 30.0, after=k - 1),
            needed_pos_us=100.0 * k,
        )
        for k in range(3)
    ]
    model = StepModel(step=1, start_us=0.0, duration_us=390.0, work_us=300.0, ops=ops)
    assert replay(model).duration_us == pytest.approx(345.0)
    cpu = Platform("cpu", True, "test: the change sets the async op")
    moved = cf.prefetch(model, 1, cpu)
    assert [op.issue_pos_us for op in moved.ops] == [10.0, 25.0, 125.0]
    assert replay(moved).duration_us == pytest.approx(315.0)  # only the first stays exposed
    unlabelled = [msgspec.structs.replace(op, needed_pos_us=None) for op in ops]
    kept = msgspec.structs.replace(model, ops=unlabelled)
    assert cf.prefetch(kept, 1, cpu) == kept


def test_cutting_progress_moves_measured_starts_with_the_issue_positions() -> None:
    """A gather issued at 60 that started at 80: with the host sync at 10 cut, both positions
    move back by 5, so a later prefetch still sees the start after the issue, not before it."""
    op = msgspec.structs.replace(gather("a", 60.0, 80.0, 30.0), start_pos_us=80.0)
    m = StepModel(
        step=1, start_us=0.0, duration_us=140.0, work_us=100.0, ops=[op], syncs=[(10.0, 5.0, True)]
    )
    out = cf.without_host_syncs(m).ops[0]
    assert (out.issue_pos_us, out.start_pos_us, out.wait_pos_us) == (55.0, 75.0, 75.0)


def test_inserting_progress_moves_every_position_after_it() -> None:
    op = msgspec.structs.replace(gather("b", 60.0, 80.0, 30.0), start_pos_us=70.0)
    m = StepModel(
        step=1, start_us=0.0, duration_us=130.0, work_us=100.0, ops=[op], syncs=[(90.0, 5.0, True)]
    )
    out = cf.expanded(m, [(60.0, 10.0), (75.0, 20.0)])
    moved = out.ops[0]
    assert (moved.issue_pos_us, moved.start_pos_us, moved.wait_pos_us) == (60.0, 80.0, 110.0)
    assert out.syncs == [(120.0, 5.0, True)] and out.work_us == 130.0


def test_units_named_by_position_take_their_module_paths() -> None:
    """FSDP1's trace names units `fsdp1-unit-<k>`; renamed by the captured paths, a coarser
    wrap finds them under their container."""
    from zdiag.analyzers.rank.step_model import with_unit_paths

    m = StepModel(
        step=1,
        start_us=0.0,
        duration_us=390.0,
        work_us=300.0,
        ops=[gather(f"fsdp1-unit-{k}", 100.0 * k, 100.0 * k, 30.0) for k in range(3)],
        unit_chunks=[(5.0, 1.0, "fsdp1-unit-1")],
    )
    paths = {"fsdp1-unit-0": "", "fsdp1-unit-1": "stack.0.fc", "fsdp1-unit-2": "stack.0.out"}
    (named,) = with_unit_paths([m], paths)
    assert [op.unit for op in named.ops] == ["", "stack.0.fc", "stack.0.out"]
    assert named.unit_chunks == [(5.0, 1.0, "stack.0.fc")]
    assert cf.units_under([named], "stack") == {"stack.0.fc", "stack.0.out"}
    assert with_unit_paths([named], paths)[0] is named  # nothing left to rename


def test_the_async_op_on_a_blocking_cpu_run_says_its_gain_ignores_core_sharing() -> None:
    """`--unshard-async-op` on a CPU run whose gathers blocked hides them under compute kept as
    measured; the result says gloo's thread shares the cores, which no blocking run shows. A
    run that already set it, or a GPU run, gets no such note."""
    from zdiag.analyzers.whatif.run_whatif import Change, replay_change

    models = {0: [serialized()], 1: [serialized()]}
    change = Change(prefetch=1, unshard_async_op=True)
    result = replay_change(models, "cpu", change, unshard_async_op=False)
    assert result.ranks[0].predicted_ms < result.ranks[0].measured_ms
    assert any("shares the host's cores" in n for n in result.notes)
    for device, flag in (("cpu", True), ("cuda", None)):
        again = replay_change(models, device, change, unshard_async_op=flag)
        assert not any("shares the host's cores" in n for n in again.notes)
