"""Pipeline timings from a trace's micro-batch actions (analyzers/rank/pipeline_times.py), the
stage placement (analyzers/inputs/pipeline_facts.py), the bubble arithmetic and the
`pipeline-bubble` finding (analyzers/detectors/pipeline_bubble.py), on synthetic inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zdiag.analyzers.detectors import BY_ID, run_context
from zdiag.analyzers.detectors import pipeline_bubble as pb
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.inputs.model_facts import ModelFacts
from zdiag.analyzers.rank.pipeline_times import PipelineStepTimes, pipeline_times
from zdiag.analyzers.rank.rank_analysis import RankFacts
from zdiag.analyzers.rank.steps import find_steps
from zdiag.collectors.model_schema import (
    DeviceMeshInfo,
    MeshDim,
    ModelDescription,
    PipelineInfo,
    PipelineScheduleInfo,
    PipelineStageInfo,
)


def _x(name: str, ts: float, dur: float, cat: str = "user_annotation") -> dict[str, object]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def _stage_trace(tmp_path: Path) -> Path:
    """Two steps of 10 ms of a last stage: 2 forwards (each waits 1 ms in gloo:recv, works 2 ms),
    a 1 ms gap, 2 backwards of 1 ms (no recv), then the optimizer."""
    ev: list[dict[str, object]] = []
    for step in range(2):
        t0 = step * 10_000.0
        ev.append(_x(f"ProfilerStep#{step}", t0, 10_000.0))
        for i in range(2):
            s = t0 + 1_000 + i * 3_000
            ev.append(_x(f"Forward {i}", s, 3_000.0))
            ev.append(_x("c10d::recv_", s, 30.0, "cpu_op"))
            ev.append(_x("gloo:recv", s + 30, 970.0))
            ev.append(_x("aten::addmm", s + 1_000, 2_000.0, "cpu_op"))
        for i in range(2):
            ev.append(_x(f"Backward {i}", t0 + 8_000 + i * 1_000, 1_000.0))
        ev.append(_x("Optimizer.step#AdamW.step", t0 + 9_900, 50.0))
    path = tmp_path / "rank-1.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    return path


def test_times_split_the_phase_into_work_and_wait(tmp_path: Path) -> None:
    trace = load_rank_trace(_stage_trace(tmp_path))
    windows, _ = find_steps(trace)
    times = pipeline_times(trace, windows)
    assert [t.step for t in times] == [0, 1]
    t = times[0]
    assert t.actions == 4 and t.step_ms == pytest.approx(10.0)
    assert t.window_ms == pytest.approx(9.0)  # 1 ms .. 10 ms
    assert t.busy_ms == pytest.approx(6.0)  # 2 x 2 ms forward work + 2 x 1 ms backward
    assert t.wait_ms == pytest.approx(3.0)  # 2 x 1 ms recv + the 1 ms gap


def test_no_actions_no_times(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps({"traceEvents": [_x("ProfilerStep#0", 0, 100.0)]}))
    trace = load_rank_trace(path)
    assert pipeline_times(trace, find_steps(trace)[0]) == []


def test_fill_and_drain_arithmetic() -> None:
    assert pb.ideal_bubble(2, 4) == pytest.approx(1 / 5)
    assert pb.ideal_bubble(4, 8) == pytest.approx(3 / 11)
    # balanced: T = (m + p - 1) t, and the idle share of T is the ideal bubble
    t = [10.0, 10.0, 10.0, 10.0]
    assert pb.phase_ms(t, 8) == pytest.approx(110.0)
    assert 1 - 8 * 10.0 / pb.phase_ms(t, 8) == pytest.approx(pb.ideal_bubble(4, 8))
    # doubling m: (sum - max) * (1 - m / m') = 30 * 0.5
    assert pb.more_microbatches_gain(t, 8, 16) == pytest.approx(15.0)
    assert pb.phase_ms(t, 8) - pb.phase_ms([5.0] * 4, 16) == pytest.approx(15.0)
    # imbalanced 30 / 10: balancing to 20 each gains (m - 1) * (30 - 20)
    assert pb.rebalance_gain([30.0, 10.0], 4) == pytest.approx(30.0)
    assert pb.phase_ms([30.0, 10.0], 4) - pb.phase_ms([20.0, 20.0], 4) == pytest.approx(30.0)
    assert pb.rebalance_gain([10.0, 10.0], 4) == 0.0


def _description(schedule: str = "ScheduleGPipe", m: int = 4) -> ModelDescription:
    """Rank 0 of a (2, 2) ("dp", "pp") mesh: stage 0 of 2, pipelines {0,1} and {2,3}."""
    return ModelDescription(
        rank=0,
        mesh=DeviceMeshInfo(
            shape=(2, 2),
            dim_names=("dp", "pp"),
            device_type="cpu",
            ranks=(0, 1, 2, 3),
            dims=(MeshDim("dp", 2, "shard", (0, 2)), MeshDim("pp", 2, "pp", (0, 1))),
        ),
        pipeline=PipelineInfo(
            stages=(PipelineStageInfo(0, 2, 0, (0, 1), "3", "TabResNet", 10, 40),),
            schedules=(PipelineScheduleInfo(schedule, "", m, (0,), 2),),
        ),
    )


def _steps(busy: float, wait: float, step: float = 100.0) -> list[PipelineStepTimes]:
    return [
        PipelineStepTimes(
            step=k, step_ms=step, window_ms=busy + wait, busy_ms=busy, wait_ms=wait, actions=8
        )
        for k in range(3)
    ]


def _ctx(busy: dict[int, float], wait: dict[int, float], **kw: object) -> DetectorContext:
    facts = {r: RankFacts(pipeline=_steps(busy[r], wait[r])) for r in busy}
    return DetectorContext(ledgers={}, facts=facts, model=ModelFacts(_description(**kw)))  # type: ignore[arg-type]


def test_stages_are_placed_on_every_pipeline() -> None:
    pf = ModelFacts(_description()).pipeline
    assert pf is not None and pf.groups == ((0, 1), (2, 3))
    assert pf.ranks_of_stage(0) == (0, 2) and pf.ranks_of_stage(1) == (1, 3)
    assert pf.n_microbatches == 4
    assert ModelFacts(ModelDescription()).pipeline is None


def test_slow_stage_is_named_with_the_bubble_per_stage() -> None:
    # stage 0 works 60 ms per step (15 per micro-batch), stage 1 28 ms (7) and waits 45 ms
    ctx = _ctx({0: 60.0, 2: 60.0, 1: 28.0, 3: 28.0}, {0: 10.0, 2: 10.0, 1: 45.0, 3: 45.0})
    (f,) = pb.detect(ctx)
    assert f.id == "pipeline-bubble" and f.ranks == [0, 2]
    assert "stage 0 makes the others wait" in f.title
    ev = f.evidence
    assert ev["slow_stage"] == [0]
    by = {tuple(s["stages"]): s for s in ev["stages"]}
    assert by[(0,)]["ranks"] == [0, 2] and by[(1,)]["ranks"] == [1, 3]
    assert by[(0,)]["bubble_share"] == pytest.approx(0.10)
    assert by[(1,)]["bubble_share"] == pytest.approx(0.45)
    assert by[(0,)]["busy_per_microbatch_ms"] == pytest.approx(15.0)
    assert by[(0,)]["submodule_class"] == "TabResNet" and by[(1,)]["submodule_class"] is None
    # t = [15, 7]: balancing gains 3 * (15 - 11) = 12 ms; 8 micro-batches gain 7 * 0.5 = 3.5 ms
    assert ev["gain_rebalance_ms"] == pytest.approx(12.0)
    assert ev["gain_more_microbatches_ms"] == pytest.approx(3.5)
    assert f.expected_gain_ms == pytest.approx(12.0)
    assert f.code is not None and "n_microbatches=8" in f.code and "ScheduleGPipe" in f.code
    assert "Schedule1F1B" in f.recommendation
    assert f.evidence["blocks_to_move"] is None  # the description lists no repeated blocks


def test_blocks_to_move_from_the_slow_stages_repeated_blocks() -> None:
    pf = ModelFacts(_description()).pipeline
    assert pf is not None
    pos = pb.positions(pf, {r: _steps(60.0 if r in (0, 2) else 28.0, 10.0) for r in range(4)})
    # t = [15, 7], mean 11; 6 blocks of 2.5 ms each: move round(4 / 2.5) = 2
    b = pb.measure(pf, pos, 4, ("ResidualMLP", "encoder.stages", 6))
    assert b.slow.stages == (0,) and pb.blocks_to_move(b) == 2
    assert "about 2 of its 6 `ResidualMLP` blocks (`encoder.stages`)" in pb._recommendation(b)
    # the captured rank runs stage 0; were stage 1 the slow one, its blocks are unknown
    pos = pb.positions(pf, {r: _steps(28.0 if r in (0, 2) else 60.0, 10.0) for r in range(4)})
    b = pb.measure(pf, pos, 4, ("ResidualMLP", "encoder.stages", 6))
    assert b.slow.stages == (1,) and pb.blocks_to_move(b) is None


def test_no_microbatch_code_when_it_gains_next_to_nothing() -> None:
    # t = [15, 5]: 8 micro-batches gain 5 * 0.5 = 2.5 ms, under 3% of the 100 ms step
    ctx = _ctx({0: 60.0, 2: 60.0, 1: 20.0, 3: 20.0}, {0: 10.0, 2: 10.0, 1: 45.0, 3: 45.0})
    (f,) = pb.detect(ctx)
    assert f.evidence["gain_rebalance_ms"] == pytest.approx(15.0)
    assert f.code is None and "micro-batches instead" not in f.recommendation


def test_balanced_stages_get_more_microbatches_not_a_slow_stage() -> None:
    ctx = _ctx({r: 40.0 for r in range(4)}, {r: 30.0 for r in range(4)})
    (f,) = pb.detect(ctx)
    assert f.evidence["slow_stage"] is None and "makes the others wait" not in f.title
    assert f.evidence["gain_rebalance_ms"] == 0.0
    assert f.expected_gain_ms == pytest.approx(5.0)  # (20 - 10) * (1 - 4 / 8)
    assert f.ranks == [0, 1, 2, 3]


def test_no_finding_below_the_bubble_threshold_or_without_capture() -> None:
    assert pb.detect(_ctx({r: 80.0 for r in range(4)}, {r: 5.0 for r in range(4)})) == []
    no_model = DetectorContext(ledgers={}, facts={0: RankFacts(pipeline=_steps(10.0, 50.0))})
    assert pb.detect(no_model) == []


def test_a_1f1b_run_is_not_told_to_use_1f1b() -> None:
    ctx = _ctx({r: 40.0 for r in range(4)}, {r: 30.0 for r in range(4)}, schedule="Schedule1F1B")
    (f,) = pb.detect(ctx)
    assert "Schedule1F1B (same arguments)" not in f.recommendation
    assert f.code is not None and "Schedule1F1B(stage, n_microbatches=8" in f.code


def test_registered_and_runs_in_the_registry() -> None:
    assert BY_ID["pipeline-bubble"].detect is pb.detect
    ctx = _ctx({0: 60.0, 2: 60.0, 1: 20.0, 3: 20.0}, {0: 10.0, 2: 10.0, 1: 45.0, 3: 45.0})
    results = run_context(ctx)
    assert not results.failed
    assert [f.id for f in results.findings if f.id == "pipeline-bubble"] == ["pipeline-bubble"]


def test_more_micro_batches_repeat_the_fsdp_gathers() -> None:
    """Measured on a user's FSDP2 + Schedule1F1B script (4 gloo ranks): 16 micro-batches instead
    of 8 made the step 2.4x slower, because each micro-batch gathers the stage's parameters
    again. With the gathers in the model, doubling is a loss, not the 33 ms gain the work-only
    model predicted."""
    from zdiag.analyzers.detectors.pipeline_bubble import more_microbatches_gain, phase_ms

    per_mb, m = [66.1, 85.0], 8
    work_only = more_microbatches_gain(per_mb, m, 2 * m)
    assert work_only == pytest.approx((sum(per_mb) - max(per_mb)) * (1 - m / (2 * m)))
    assert work_only > 0
    fixed = [58.0, 60.0]  # the stages' all-gather time per step / m
    assert more_microbatches_gain(per_mb, m, 2 * m, fixed) < 0
    # no gathers: the same as the work-only model; gathers never above t
    assert more_microbatches_gain(per_mb, m, 2 * m, [0.0, 0.0]) == pytest.approx(work_only)
    assert more_microbatches_gain(per_mb, m, 2 * m, [500.0, 500.0]) == pytest.approx(
        phase_ms(per_mb, m) - phase_ms(per_mb, 2 * m)
    )
