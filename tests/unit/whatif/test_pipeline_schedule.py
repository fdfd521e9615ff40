"""The pipeline schedule replay (analyzers/whatif/pipeline_schedule.py): the schedules' orders,
the cross-rank re-timing, the receive cost, and the two changes, on steps small enough to time
by hand."""

from __future__ import annotations

import pytest

from zdiag.analyzers.rank.pipeline_times import PipelineAction, PipelineStepTimes
from zdiag.analyzers.whatif import pipeline_schedule as ps


def _op(kind: str, stage: int, mb: int, work: float, fixed: float = 0.0) -> ps.Op:
    return ps.Op(kind, stage, mb, work, fixed, 0.0)


def _gpipe(f: list[float], b: list[float], m: int, recv: float = 0.0) -> ps.PipelineStep:
    """A GPipe step, stage s on rank s: every forward of f[s], every backward of b[s]."""
    ops = {
        s: tuple(_op("F", s, i, f[s]) for i in range(m))
        + tuple(_op("B", s, i, b[s]) for i in range(m))
        for s in range(len(f))
    }
    return ps.PipelineStep(0, ops, dict.fromkeys(ops, 0.0), dict.fromkeys(ops, recv))


def _pairs(actions: list[ps.Action]) -> list[tuple[str, int]]:
    return [(kind, mb) for kind, _, mb in actions]


def test_the_single_stage_schedules_orders() -> None:
    assert ps.rank_order("ScheduleGPipe", 0, 2, 2, 2) == [
        ("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1),
    ]  # fmt: skip
    # Schedule1F1B: num_stages - stage forwards first, then a backward and a forward in turn
    assert _pairs(ps.rank_order("Schedule1F1B", 0, 2, 2, 4)) == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3),
    ]  # fmt: skip
    assert _pairs(ps.rank_order("Schedule1F1B", 1, 2, 2, 4)) == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3),
    ]  # fmt: skip
    assert _pairs(ps.rank_order("Schedule1F1B", 0, 4, 4, 2)) == [
        ("F", 0), ("F", 1), ("B", 0), ("B", 1),
    ]  # fmt: skip


def test_the_interleaved_order_is_the_one_a_recorded_run_ran() -> None:
    """Rank 0 of 2, stages 0 and 2, 4 micro-batches: the compute actions a ScheduleInterleaved1F1B
    run recorded (a GPT on 2 gloo ranks, torch 2.13), in order."""
    assert ps.rank_order("ScheduleInterleaved1F1B", 0, 2, 4, 4) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1), ("F", 0, 2), ("B", 2, 0),
        ("F", 0, 3), ("B", 2, 1), ("F", 2, 2), ("B", 0, 0), ("F", 2, 3), ("B", 0, 1),
        ("B", 2, 2), ("B", 2, 3), ("B", 0, 2), ("B", 0, 3),
    ]  # fmt: skip
    # breadth first: every forward of stage 0, of stage 2, then the backwards the other way
    assert ps.rank_order("ScheduleLoopedBFS", 1, 2, 4, 2) == [
        ("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("F", 3, 1),
        ("B", 3, 1), ("B", 3, 0), ("B", 1, 1), ("B", 1, 0),
    ]  # fmt: skip
    # 5 micro-batches on 2 ranks: 2 rounds, which 5 is not a multiple of (torch refuses it)
    with pytest.raises(ps.ScheduleError, match="refuses 5 micro-batches"):
        ps.rank_order("ScheduleInterleaved1F1B", 0, 2, 4, 5)


def _torch_order(name: str, rank: int, pp: int, n_local: int, m: int) -> list[ps.Action] | None:
    """torch's own order for one rank (its `_calculate_single_rank_operations`, idle slots
    left out); None where torch refuses the count."""
    from torch.distributed.pipelining import schedules as tps

    cls = getattr(tps, name)
    sched = object.__new__(cls)  # the order needs no stages, only these counts
    sched.pp_group_size, sched._n_microbatches, sched.n_local_stages = pp, m, n_local
    sched._stages = [None] * n_local
    sched.number_of_rounds = max(1, m // pp)
    if name == "ScheduleInterleaved1F1B" and m % sched.number_of_rounds:
        return None
    sched.microbatches_per_round = m // sched.number_of_rounds
    kinds = {tps._ComputationType.FORWARD: "F", tps._ComputationType.FULL_BACKWARD: "B"}
    return [
        (kinds[a.computation_type], a.stage_index, a.microbatch_index)
        for a in sched._calculate_single_rank_operations(rank)
        if a is not None
    ]


@pytest.mark.parametrize("name", ["ScheduleInterleaved1F1B", "ScheduleLoopedBFS"])
def test_the_runtime_schedules_orders_are_torchs_own(name: str) -> None:
    for pp, n_local, m in [
        (2, 2, 4),
        (2, 3, 6),
        (2, 2, 5),
        (4, 2, 8),
        (4, 2, 6),
        (3, 2, 5),
        (8, 4, 16),
    ]:
        for rank in range(pp):
            expected = _torch_order(name, rank, pp, n_local, m)
            if expected is None:
                with pytest.raises(ps.ScheduleError):
                    ps.rank_order(name, rank, pp, pp * n_local, m)
            else:
                assert ps.rank_order(name, rank, pp, pp * n_local, m) == expected, (pp, m, rank)


def test_replay_derives_every_wait_from_the_dependencies() -> None:
    # stage 0: F 10, B 20; stage 1: F 5, B 10; 2 micro-batches.
    # stage 0 F0 0-10, F1 10-20; stage 1 F0 10-15, F1 20-25, B0 25-35, B1 35-45;
    # stage 0 B0 waits for stage 1's B0: 35-55, B1 55-75.
    step = _gpipe([10.0, 5.0], [20.0, 10.0], 2)
    assert ps.replay(step) == {0: pytest.approx(75.0), 1: pytest.approx(45.0)}
    assert ps.replayed_phase_us(step) == pytest.approx(75.0)


def test_a_receive_costs_only_across_ranks_and_gaps_are_kept() -> None:
    # a receive of 1 on every dependent action, also when its data was sent long before:
    # stage 1 F0 11-16, F1 21-26, B0 26-36, B1 36-46; stage 0 B0 37-57, B1 58-78
    assert ps.replayed_phase_us(_gpipe([10.0, 5.0], [20.0, 10.0], 2, recv=1.0)) == 78.0
    # one rank running both stages receives nothing: the work and the gaps, in order
    ops = (
        ps.Op("F", 0, 0, 10.0, 0.0, 2.0),
        ps.Op("F", 1, 0, 5.0, 0.0, 0.5),
        ps.Op("B", 1, 0, 10.0, 0.0, 0.5),
        ps.Op("B", 0, 0, 20.0, 0.0, 0.0),
    )
    one = ps.PipelineStep(0, {0: ops}, {0: 0.0}, {0: 9.0})
    assert ps.replayed_phase_us(one) == pytest.approx(48.0)


def test_a_backward_for_the_weights_sends_nothing() -> None:
    """Zero-bubble schedules split the backward: stage 0's backward for the input waits for
    stage 1's (I), not for stage 1's backward for the weights (W) that follows it."""
    ops = {
        0: (_op("F", 0, 0, 10.0), _op("I", 0, 0, 4.0), _op("W", 0, 0, 4.0)),
        1: (_op("F", 1, 0, 10.0), _op("I", 1, 0, 5.0), _op("W", 1, 0, 20.0)),
    }
    step = ps.PipelineStep(0, ops, {0: 0.0, 1: 0.0}, {})
    # stage 1: F 10-20, I 20-25, W 25-45; stage 0: I 25-29 (after stage 1's I), W 29-33
    assert ps.replay(step) == {0: pytest.approx(33.0), 1: pytest.approx(45.0)}


def test_an_order_the_dependencies_cannot_run_is_refused() -> None:
    # stage 0 runs its backward before its forward: it waits on stage 1, which waits on it
    ops = {
        0: (_op("B", 0, 0, 1.0), _op("F", 0, 0, 1.0)),
        1: (_op("F", 1, 0, 1.0), _op("B", 1, 0, 1.0)),
    }
    with pytest.raises(ps.ScheduleError, match="circle"):
        ps.replay(ps.PipelineStep(0, ops, {0: 0.0, 1: 0.0}, {}))


def test_twice_the_micro_batches_halve_the_work_but_not_the_gathers() -> None:
    step = _gpipe([10.0, 5.0], [20.0, 10.0], 2)
    doubled = ps.more_microbatches(step, "ScheduleGPipe", 2)
    assert [(op.kind, op.microbatch, op.work_us) for op in doubled.ops[1]] == [
        ("F", 0, 2.5), ("F", 1, 2.5), ("F", 2, 2.5), ("F", 3, 2.5),
        ("B", 0, 5.0), ("B", 1, 5.0), ("B", 2, 5.0), ("B", 3, 5.0),
    ]  # fmt: skip
    # stage 0 F 5 each: 0..20; stage 1 F3 20-22.5, B 22.5..42.5 (B0 ends 27.5);
    # stage 0 B0 27.5-37.5, then 10 each: ends 67.5
    assert ps.replayed_phase_us(doubled) == pytest.approx(67.5)
    # the gathers inside an action stay whole: 4 of stage 0's 10 ms forward
    gathered = ps.PipelineStep(
        0,
        {0: (_op("F", 0, 0, 10.0, fixed=4.0), _op("B", 0, 0, 20.0)), 1: step.ops[1][::2]},
        {0: 0.0, 1: 0.0},
        {},
    )
    works = [op.work_us for op in ps.more_microbatches(gathered, "ScheduleGPipe", 1).ops[0]]
    assert works == [4.0 + 3.0, 4.0 + 3.0, 10.0, 10.0]
    # 1F1B's order for the new count
    one_f = ps.more_microbatches(_recorded("Schedule1F1B", 2, 1, 2), "Schedule1F1B", 2)
    assert [(op.kind, op.microbatch) for op in one_f.ops[0]][:4] == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2),
    ]  # fmt: skip


def _recorded(schedule: str, pp: int, n_local: int, m: int, **extra: float) -> ps.PipelineStep:
    """A step as `schedule` runs it (F 10, B 20 on every stage), with an in-place action (a
    send, 1 µs) after each forward when `extra` says so."""
    ops = {}
    for r in range(pp):
        seq: list[ps.Op] = []
        for kind, stage, mb in ps.rank_order(schedule, r, pp, pp * n_local, m):
            seq.append(_op(kind, stage, mb, 10.0 if kind == "F" else 20.0))
            if kind == "F" and extra.get("send"):
                seq.append(ps.Op("", -1, -1, extra["send"], 0.0, 0.0))
        ops[r] = tuple(seq)
    return ps.PipelineStep(0, ops, dict.fromkeys(ops, 0.0), dict.fromkeys(ops, 0.0))


def test_more_micro_batches_are_refused_for_orders_not_generated() -> None:
    step = _gpipe([10.0, 5.0], [20.0, 10.0], 2)
    with pytest.raises(ps.ScheduleError, match="ScheduleZBVZeroBubble's order"):
        ps.more_microbatches(step, "ScheduleZBVZeroBubble", 2)
    # a run whose recorded order is not the schedule's own (GPipe's, called 1F1B)
    with pytest.raises(ps.ScheduleError, match="not Schedule1F1B's order for 2 micro-batches"):
        ps.more_microbatches(step, "Schedule1F1B", 2)
    # stages that are not a loop over the ranks
    odd = {0: (_op("F", 0, 0, 1.0), _op("F", 1, 0, 1.0)), 1: (_op("F", 2, 0, 1.0),)}
    with pytest.raises(ps.ScheduleError, match="not one stage per rank or a loop"):
        ps.more_microbatches(ps.PipelineStep(0, odd, {}, {}), "ScheduleLoopedBFS", 1)


def test_an_interleaved_run_doubled_keeps_each_micro_batchs_sends() -> None:
    """2 ranks, 2 stages each, 4 micro-batches: doubled, each rank runs its stages' 16 forwards
    and 16 backwards at half the work, in the schedule's order for 8, and each forward keeps the
    1 µs send posted after it (folded into the host time before the next action)."""
    step = _recorded("ScheduleInterleaved1F1B", 2, 2, 4, send=1.0)
    doubled = ps.more_microbatches(step, "ScheduleInterleaved1F1B", 4)
    for r in (0, 1):
        got = [(op.kind, op.stage, op.microbatch) for op in doubled.ops[r]]
        assert got == ps.rank_order("ScheduleInterleaved1F1B", r, 2, 4, 8)
        assert {op.work_us for op in doubled.ops[r]} == {5.0, 10.0}
        sends = sum(op.gap_us for op in doubled.ops[r])  # each send before the next action
        assert sends == pytest.approx(16.0 - (1.0 if got[-1][0] == "F" else 0.0))
    assert ps.replayed_phase_us(doubled) > 0


def test_balanced_gives_every_stage_the_mean_work() -> None:
    step = _gpipe([10.0, 5.0], [20.0, 10.0], 2)  # stage 0 works 60, stage 1 30: mean 45
    even = ps.balanced(step)
    assert sum(op.work_us for op in even.ops[0]) == pytest.approx(45.0)
    assert sum(op.work_us for op in even.ops[1]) == pytest.approx(45.0)
    # F 7.5 / B 15 on stage 0, F 7.5 / B 15 on stage 1: stage 0 F 0..15; stage 1 F1 15-22.5,
    # B 22.5..52.5 (B0 ends 37.5); stage 0 B0 37.5-52.5, B1 52.5-67.5
    assert ps.replayed_phase_us(even) == pytest.approx(67.5)


def _times(
    start: float, actions: list[tuple[str, float, float, float, float]]
) -> PipelineStepTimes:
    """A timed step from (label kind, start, end, recv inside, recv before) per F/B action."""
    timeline = [
        PipelineAction(kind, -1, 0, s, e, inside, before)
        for (kind, s, e, inside, before) in actions
    ]
    return PipelineStepTimes(
        step=3, step_ms=1.0, window_ms=1.0, busy_ms=1.0, wait_ms=0.0, actions=len(actions),
        start_us=start, timeline=timeline,
    )  # fmt: skip


def test_steps_from_timed_actions_and_the_receive_cost() -> None:
    # one micro-batch; stage 0 (rank 0) F 100-110, B 140-160 (waited 4 inside for stage 1's B);
    # stage 1 (rank 1, its step started at 95) waits 5 before its F 115-120, B 132-142
    t0 = _times(100.0, [("F", 100.0, 110.0, 0.0, 0.0), ("B", 140.0, 160.0, 4.0, 0.0)])
    t1 = _times(95.0, [("F", 115.0, 120.0, 0.0, 5.0), ("B", 132.0, 142.0, 0.0, 0.0)])
    timings = {0: [t0], 1: [t1]}

    (aligned,) = ps.pipeline_steps([(0, 1)], timings, same_clock=lambda ranks: True)
    assert [op.work_us for op in aligned.ops[0]] == [10.0, 16.0]
    # rank 0's gap before B: 140 - 110 = 30 of host time (no receive was counted before it)
    assert [op.gap_us for op in aligned.ops[0]] == [0.0, 30.0]
    assert [op.gap_us for op in aligned.ops[1]] == [15.0, 12.0]  # 115 - 95 - 5; 132 - 120
    assert aligned.measured_us == {0: 60.0, 1: 47.0}
    # on one clock: rank 1's F wait 110-115 began when rank 0's F ended (110): 5 after the
    # data; rank 0's B wait 140-144 ended 2 after rank 1's B did (142)
    assert aligned.recv_us == {1: 5.0, 0: 2.0}
    # across clocks the offset is estimated from the receives: rank 1's wait ended 5 after
    # rank 0's F, rank 0's 2 after rank 1's B: rank 1's clock reads (5 - 2) / 2 = 1.5 ahead,
    # and each receive costs 3.5
    (apart,) = ps.pipeline_steps([(0, 1)], timings)
    assert apart.recv_us == {1: 3.5, 0: 3.5}
    # the same step with rank 1's clock 1000 ahead: the same offset found, the same costs
    late = _times(1095.0, [("F", 1115.0, 1120.0, 0.0, 5.0), ("B", 1132.0, 1142.0, 0.0, 0.0)])
    (shifted,) = ps.pipeline_steps([(0, 1)], {0: [t0], 1: [late]})
    assert shifted.recv_us == {1: 3.5, 0: 3.5}
    assert shifted.measured_us == aligned.measured_us
    receives = ps._receives({0: t0, 1: late}, shifted.ops)
    assert ps.clock_offsets([0, 1], receives, lambda ranks: False) == {0: 0.0, 1: 1001.5}
    # gathers inside an action are its fixed part, never above its work
    (fixed,) = ps.pipeline_steps([(0, 1)], timings, fixed_us=lambda r, a: 50.0)
    assert [op.fixed_us for op in fixed.ops[0]] == [10.0, 16.0]
    # a pipeline with an untimed rank gives no step
    assert ps.pipeline_steps([(0, 1)], {0: [t0]}) == []
