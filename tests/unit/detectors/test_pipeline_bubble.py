"""Pipeline timings from a trace's micro-batch actions (analyzers/rank/pipeline_times.py), the
stage placement (analyzers/inputs/pipeline_facts.py), the bubble arithmetic and the
`pipeline-bubble` finding (analyzers/detectors/pipeline_bubble.py), on synthetic inputs."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from zdiag.analyzers.detectors import BY_ID, run_context
from zdiag.analyzers.detectors import pipeline_bubble as pb
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.inputs.model_facts import ModelFacts
from zdiag.analyzers.rank.pipeline_times import (
    PipelineAction,
    PipelineStepTimes,
    parse_label,
    pipeline_times,
)
from zdiag.analyzers.rank.rank_analysis import RankFacts
from zdiag.analyzers.rank.steps import find_steps
from zdiag.analyzers.run.core_use import HostCores
from zdiag.analyzers.whatif import pipeline_schedule as ps
from zdiag.analyzers.whatif.pipeline_replay import Move, Replayed, replay_pipeline
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
    # each action in order, with its recv waits: what the schedule replay re-times
    assert t.start_us == 0.0
    assert [(a.kind, a.stage, a.microbatch) for a in t.timeline] == [
        ("F", -1, 0), ("F", -1, 1), ("B", -1, 0), ("B", -1, 1),
    ]  # fmt: skip
    assert [a.recv_us for a in t.timeline] == [1000.0, 1000.0, 0.0, 0.0]
    assert [(a.start_us, a.end_us) for a in t.timeline][2] == (8000.0, 9000.0)


def _one_step(tmp_path: Path, ev: list[dict[str, object]]) -> PipelineStepTimes:
    """The pipeline times of a one-step trace of these events (rank 0)."""
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    trace = load_rank_trace(path)
    (t,) = pipeline_times(trace, find_steps(trace)[0])
    return t


def test_send_waits_between_actions_and_the_host_cost_per_op(tmp_path: Path) -> None:
    """Between actions a schedule waits for its sends (the neighbour taking the tensor): a
    wait on the neighbour, counted in `neighbour_wait_ms`, never an action's recv. Each action's
    host cost per op: the time no op covers, plus one dispatch (a view's time) per op."""
    ev: list[dict[str, object]] = [_x("ProfilerStep#0", 0, 20_000.0)]
    ev.append(_x("Forward 0", 1_000, 4_000.0))
    ev.append(_x("aten::view", 1_000, 10.0, "cpu_op"))
    ev.append(_x("aten::addmm", 2_000, 2_000.0, "cpu_op"))  # 1 000 + 990 uncovered + 3 ops
    ev.append(_x("aten::t", 4_500, 10.0, "cpu_op"))
    ev.append(_x("gloo:send", 4_800, 3_200.0))  # beside the compute, then 3 ms after it
    ev.append(_x("Backward 0", 9_000, 2_000.0))
    ev.append(_x("aten::mm", 9_000, 2_000.0, "cpu_op"))
    t = _one_step(tmp_path, ev)
    assert t.neighbour_wait_ms == pytest.approx(3.0)  # 5 000 .. 8 000
    assert [a.recv_us + a.recv_before_us for a in t.timeline] == [0.0, 0.0]
    # Forward 0: 4 000 - (10 + 2 000 + 10) covered = 1 980 uncovered, + 3 ops x 10 (a view)
    assert t.timeline[0].host_fixed_us == pytest.approx(1_980.0 + 30.0)
    assert t.timeline[1].host_fixed_us == pytest.approx(10.0)  # one op, all covered


def test_receives_and_sends_posted_ahead_wait_only_from_their_consumer(tmp_path: Path) -> None:
    """A runtime schedule posts stage 2's receive (PP:2RECV_F0) before running stage 0's forward,
    and gloo records the receive until its data came (6 ms), while the thread computed. The
    thread waits on it only from its consumer's start (PP:2F0, 5 ms) to then: 1 ms, not 6. The
    send posted after stage 0's forward runs on to 20 ms and is no wait at all."""
    ev: list[dict[str, object]] = [_x("ProfilerStep#0", 0, 20_000.0)]
    ev.append(_x("PP:2RECV_F0", 0, 50.0))
    ev.append(_x("gloo:recv", 30, 5_970.0))  # posted ahead, done at 6 000
    ev.append(_x("PP:0F0", 100, 3_000.0))
    ev.append(_x("aten::addmm", 100, 3_000.0, "cpu_op"))
    ev.append(_x("PP:0SEND_F0", 3_100, 50.0))
    ev.append(_x("gloo:send", 3_120, 16_000.0))  # posted ahead
    ev.append(_x("PP:2F0", 5_000, 3_000.0))
    ev.append(_x("aten::addmm", 6_000, 2_000.0, "cpu_op"))
    t = _one_step(tmp_path, ev)
    assert [(a.kind, a.stage, a.microbatch) for a in t.timeline] == [
        ("", -1, -1), ("F", 0, 0), ("", -1, -1), ("F", 2, 0),
    ]  # fmt: skip
    assert [a.recv_us for a in t.timeline] == [0.0, 0.0, 0.0, 1_000.0]
    assert t.neighbour_wait_ms == pytest.approx(1.0)
    assert t.busy_ms == pytest.approx(6.1 - 1.0)  # the actions' 6.1 ms less the wait


def test_runtime_schedule_labels_name_their_stage() -> None:
    assert parse_label("PP:1B0") == ("B", 1, 0)
    assert parse_label("PP:0W12") == ("W", 0, 12)
    assert parse_label("Forward 3") == ("F", -1, 3)
    assert parse_label("PP:0SEND_F1") == ("", -1, -1)
    assert parse_label("PP:0UNSHARD") == ("", -1, -1)


def test_no_actions_no_times(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps({"traceEvents": [_x("ProfilerStep#0", 0, 100.0)]}))
    trace = load_rank_trace(path)
    assert pipeline_times(trace, find_steps(trace)[0]) == []


def test_the_balanced_bubble() -> None:
    assert pb.ideal_bubble(2, 4) == pytest.approx(1 / 5)
    assert pb.ideal_bubble(4, 8) == pytest.approx(3 / 11)
    assert pb.ideal_bubble(2, 4, v=2) == pytest.approx(1 / 9)  # 2 stages per rank


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


def _two_pipelines(
    t: list[float], m: int = 4, step: float = 70.0, schedule: str = "ScheduleGPipe"
) -> dict[int, list[PipelineStepTimes]]:
    """Three steps of the (2, 2) mesh's two pipelines running `schedule` (its own order on each
    stage), each stage s working t[s] / 2 ms per forward and per backward, every wait a recv
    inside the action (as torch's single-stage schedules receive): the timings the map gives,
    in ms -> µs."""
    f = [x / 2 * 1e3 for x in t]
    ends: dict[tuple[str, int, int], float] = {}
    actions: dict[int, list[PipelineAction]] = {0: [], 1: []}
    free = [0.0, 0.0]
    todo = {s: ps.rank_order(schedule, s, 2, 2, m) for s in (0, 1)}
    while any(todo.values()):
        for s in (0, 1):  # each stage runs its next actions while their inputs are there
            while todo[s]:
                kind, _, i = todo[s][0]
                need = (kind, s - 1, i) if kind == "F" else (kind, s + 1, i)
                if need[1] in (0, 1) and need not in ends:
                    break
                start = free[s]
                wait = max(0.0, ends.get(need, 0.0) - start)
                end = start + wait + f[s]
                actions[s].append(PipelineAction(kind, -1, i, start, end, wait, 0.0))
                ends[(kind, s, i)] = free[s] = end
                todo[s].pop(0)
    out = {}
    for s, acts in actions.items():
        busy = sum(a.end_us - a.start_us - a.recv_us for a in acts) / 1e3
        window = (acts[-1].end_us - acts[0].start_us) / 1e3
        steps = [
            PipelineStepTimes(
                step=k,
                step_ms=step,
                window_ms=window,
                busy_ms=busy,
                wait_ms=step - busy,
                actions=len(acts),
                start_us=0.0,
                timeline=acts,
            )
            for k in range(3)
        ]
        for rank in (s, s + 2):
            out[rank] = steps
    return out


def _ctx(t: list[float], step: float = 70.0, **kw: object) -> DetectorContext:
    schedule = str(kw.get("schedule", "ScheduleGPipe"))
    timed = _two_pipelines(t, step=step, schedule=schedule)
    facts = {r: RankFacts(host="node0", pipeline=p) for r, p in timed.items()}
    return DetectorContext(ledgers={}, facts=facts, model=ModelFacts(_description(**kw)))  # type: ignore[arg-type]


def test_stages_are_placed_on_every_pipeline() -> None:
    pf = ModelFacts(_description()).pipeline
    assert pf is not None and pf.groups == ((0, 1), (2, 3))
    assert pf.ranks_of_stage(0) == (0, 2) and pf.ranks_of_stage(1) == (1, 3)
    assert pf.n_microbatches == 4
    assert ModelFacts(ModelDescription()).pipeline is None


def test_slow_stage_is_named_with_the_bubble_per_stage() -> None:
    # stage 0 works 60 ms per step (15 per micro-batch), stage 1 28 ms (7), in 70 ms steps
    (f,) = pb.detect(_ctx([15.0, 7.0]))
    assert f.id == "pipeline-bubble" and f.ranks == [0, 2]
    assert "stage 0 makes the others wait" in f.title
    ev = f.evidence
    assert ev["slow_stage"] == [0]
    by = {tuple(s["stages"]): s for s in ev["stages"]}
    assert by[(0,)]["ranks"] == [0, 2] and by[(1,)]["ranks"] == [1, 3]
    assert by[(0,)]["bubble_share"] == pytest.approx(10 / 70, abs=1e-4)
    assert by[(1,)]["bubble_share"] == pytest.approx(42 / 70, abs=1e-4)
    assert by[(0,)]["busy_per_microbatch_ms"] == pytest.approx(15.0)
    assert by[(0,)]["submodule_class"] == "TabResNet" and by[(1,)]["submodule_class"] is None
    # the replay of the unchanged step: stage 0's forwards end at 30, its last backward at 67
    assert ev["replayed_phase_ms"] == pytest.approx(67.0) == ev["measured_phase_ms"]
    assert ev["replay_error"] == 0.0 and ev["replay_steps"] == 3
    # balanced (each stage 11 per micro-batch) the phase is 55; 8 micro-batches of half the
    # work: stage 0's forwards end at 30, stage 1's first backward at 33.5, stage 0's last 63.5
    assert ev["replayed_balanced_phase_ms"] == pytest.approx(55.0)
    assert ev["replayed_more_microbatches_phase_ms"] == pytest.approx(63.5)
    assert ev["gain_rebalance_ms"] == pytest.approx(12.0)
    assert ev["gain_more_microbatches_ms"] == pytest.approx(3.5)
    assert f.expected_gain_ms == pytest.approx(12.0)
    assert f.gain_method.startswith("replayed: every pipeline's recorded actions re-timed")
    assert "67.0 ms replayed unchanged against 67.0 ms measured" in f.gain_method
    assert f.code is not None and "n_microbatches=8" in f.code and "ScheduleGPipe" in f.code
    assert "Schedule1F1B" in f.recommendation
    assert f.evidence["blocks_to_move"] is None  # the description lists no repeated blocks


def test_blocks_to_move_from_the_slow_stages_repeated_blocks() -> None:
    pf = ModelFacts(_description()).pipeline
    assert pf is not None
    timings = _two_pipelines([15.0, 7.0])
    pos = pb.positions(pf, timings)
    # t = [15, 7], mean 11; 6 blocks of 2.5 ms each: move round(4 / 2.5) = 2
    b = pb.measure(pf, pos, 4, timings, ("ResidualMLP", "encoder.stages", 6))
    assert b.slow.stages == (0,) and pb.blocks_to_move(b) == 2
    text = pb._recommendation(b)
    assert "about 2 of its 6 `ResidualMLP` blocks (`encoder.stages`), to stage 1" in text
    # the replay moves those 2 blocks: stage 0 works 10, stage 1 12 per micro-batch (now the
    # slower: 2 blocks overshoot the mean). Stage 1's forwards end at 29, its backwards at 35,
    # 41, 47, 53; stage 0's follow each by 5 (the last 53-58): 9 ms under the measured 67, not
    # the 12 of a perfect split
    assert isinstance(b.replayed, Replayed) and b.replayed.move == Move(0, 1, 2, 6)
    assert b.gain_bal == pytest.approx(9.0)
    assert "2 of stage 0's 6 blocks moved to stage 1" in pb.gain_method(b)
    assert "CPU cores" not in pb.gain_method(b)
    # a CPU run's measured cores: full, the rebalance (more ranks busy at once) is an upper bound
    full = pb.gain_method(b, HostCores("vm", (0, 1), 2, 1.9, 30))
    assert "CPU cores are not modelled: the 2 ranks on vm kept 1.9 of its 2 cores busy" in full
    assert "the rebalance's gain is an upper bound" in full
    room = pb.gain_method(b, HostCores("vm", (0, 1), 8, 1.9, 30))
    assert ": not full, though a balanced split keeps more ranks busy at once" in room
    # the captured rank runs stage 0; were stage 1 the slow one, its blocks are unknown
    timings = _two_pipelines([7.0, 15.0])
    pos = pb.positions(pf, timings)
    b = pb.measure(pf, pos, 4, timings, ("ResidualMLP", "encoder.stages", 6))
    assert b.slow.stages == (1,) and pb.blocks_to_move(b) is None
    assert isinstance(b.replayed, Replayed) and b.replayed.move is None  # the mean instead


def test_a_move_the_replay_says_is_slower_is_not_sold_as_a_gain() -> None:
    assert pb._move_gain(9.0) == ": about 9.0 ms per step."
    assert pb._move_gain(-5.8).startswith("; the replay predicts no gain from that move (5.8 ms")
    assert pb._move_gain(None) == "."


def test_no_microbatch_code_when_it_gains_next_to_nothing() -> None:
    # t = [15, 5]: 8 micro-batches replay 2.5 ms faster, under 3% of the 100 ms step
    (f,) = pb.detect(_ctx([15.0, 5.0], step=100.0))
    assert f.evidence["gain_more_microbatches_ms"] == pytest.approx(2.5)
    assert f.evidence["gain_rebalance_ms"] == pytest.approx(15.0)  # 65 -> 50 ms
    assert f.code is None and "micro-batches instead" not in f.recommendation


def test_balanced_stages_get_more_microbatches_not_a_slow_stage() -> None:
    (f,) = pb.detect(_ctx([10.0, 10.0]))
    assert f.evidence["slow_stage"] is None and "makes the others wait" not in f.title
    assert f.evidence["gain_rebalance_ms"] == 0.0
    assert f.expected_gain_ms == pytest.approx(5.0)  # 50 -> 45 ms
    assert f.ranks == [0, 1, 2, 3]
    assert "the stages balanced" not in f.gain_method


def test_no_finding_below_the_bubble_threshold_or_without_capture() -> None:
    assert pb.detect(_ctx([20.0, 20.0], step=85.0)) == []  # each stage waits 5 of 85 ms
    no_model = DetectorContext(
        ledgers={}, facts={0: RankFacts(pipeline=_two_pipelines([10.0, 10.0])[0])}
    )
    assert pb.detect(no_model) == []


def test_a_bubble_the_replay_cannot_time_is_reported_without_a_gain() -> None:
    """Timings without their actions (no replay): the bubble is still reported, as info, with
    no gain and the reason; no code is proposed on a gain nobody computed."""
    facts = {
        r: RankFacts(
            pipeline=[PipelineStepTimes(**{**msgspec.structs.asdict(t), "timeline": []}) for t in p]
        )
        for r, p in _two_pipelines([15.0, 7.0]).items()
    }
    ctx = DetectorContext(ledgers={}, facts=facts, model=ModelFacts(_description()))  # type: ignore[arg-type]
    (f,) = pb.detect(ctx)
    assert f.severity == "info" and f.expected_gain_ms is None and f.code is None
    assert f.gain_method.startswith("not estimated: the schedule replay did not run (no step's")
    assert f.evidence["replay_not_run"].startswith("no step's actions")


def test_a_1f1b_run_is_not_told_to_use_1f1b() -> None:
    (f,) = pb.detect(_ctx([10.0, 10.0], schedule="Schedule1F1B"))
    assert "Schedule1F1B (same arguments)" not in f.recommendation
    assert f.code is not None and "Schedule1F1B(stage, n_microbatches=8" in f.code
    assert "in Schedule1F1B's order" in f.gain_method


def test_registered_and_runs_in_the_registry() -> None:
    assert BY_ID["pipeline-bubble"].detect is pb.detect
    results = run_context(_ctx([15.0, 5.0]))
    assert not results.failed
    assert [f.id for f in results.findings if f.id == "pipeline-bubble"] == ["pipeline-bubble"]


def test_more_micro_batches_repeat_the_fsdp_gathers() -> None:
    """Measured on a user's FSDP2 + Schedule1F1B script (4 gloo ranks): 16 micro-batches instead
    of 8 made the step 2.4x slower, because each micro-batch gathers the stage's parameters
    again. With the gathers inside each action kept whole, doubling replays as a loss."""
    pf = ModelFacts(_description()).pipeline
    assert pf is not None
    timings = _two_pipelines([10.0, 10.0])
    work_only = replay_pipeline(pf, timings)
    assert isinstance(work_only, Replayed) and work_only.gain_mb == pytest.approx(5.0)

    def gathers(rank: int, a: PipelineAction) -> float:
        return 0.8 * (a.end_us - a.start_us - a.recv_us)  # 80% of each action gathers

    gathered = replay_pipeline(pf, timings, gathers)
    assert isinstance(gathered, Replayed) and gathered.gain_mb is not None
    assert gathered.gain_mb < 0 and gathered.unchanged_ms == pytest.approx(50.0)


def test_zdiag_whatif_pipeline_rebalance_states_the_measured_cores() -> None:
    from zdiag.render.pipeline_whatif import pipeline_whatif_json, render_pipeline_whatif_text

    pf = ModelFacts(_description()).pipeline
    assert pf is not None
    timings = _two_pipelines([15.0, 7.0])
    b = pb.measure(pf, pb.positions(pf, timings), 4, timings, ("ResidualMLP", "encoder.stages", 6))
    assert pipeline_whatif_json(b, True)["cores"] is None
    full = HostCores("vm", (0, 1), 2, 1.9, 30)
    assert pipeline_whatif_json(b, True, full)["cores"]["full"] is True
    text = " ".join(render_pipeline_whatif_text(b, True, 100, full).split())
    assert "cores: the 2 ranks on vm kept 1.9 of its 2 cores busy per step" in text
    assert "the rebalance's gain is an upper bound" in text
    # the micro-batch change keeps as many ranks busy: no line
    assert "cores:" not in render_pipeline_whatif_text(b, False, 100, full)
