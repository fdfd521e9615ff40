"""The map's step model on recorded traces: replayed unchanged, it gives back each measured step
(the project's own traces and the real ones in ../shared/real_traces), and its parts add up."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.engine.summary_pipeline import SummaryOptions, analyze_via_summaries
from zdiag.analyzers.rank.step_model import END_MATCH_US
from zdiag.analyzers.rank.summary import RankSummary
from zdiag.analyzers.whatif.replay import replay

SAMPLES = sorted(
    p.parent.parent for p in (REPO_ROOT / "sample_traces").glob("**/traces/rank-0.json.gz")
)
REAL = [
    "hta/v100_ddp_rank1_of_2.json.gz",
    "hta/a100_torchrec_rank3_of_8.json.gz",
    "hta/a100_ddp_collective_args_rank0_of_2.json.gz",
    "hta/cpu_only_gloo_rank34_of_300.json.gz",
    "tracelens/b200_inference_rank0_of_8.json.gz",
]
TOLERANCE = 1e-6  # relative: the model is exact by construction; this catches engine bugs


def summaries_of(paths: list[Path]) -> list[RankSummary]:
    """The rank summaries of `paths`, every trace decoded (no cache read or written)."""
    options = SummaryOptions(use_stored=False, write_cache=False)
    return analyze_via_summaries(paths, options).summaries


def _check(paths: list[Path]) -> int:
    summaries = summaries_of(paths)
    checked = 0
    for s in summaries:
        assert s.step_models, f"rank {s.rank}: no step model"
        for m in s.step_models:
            r = replay(m)
            # a wait ends at its collective's end, which may lie END_MATCH_US from the interval's
            waits = sum(1 for op in m.ops if op.waited_us > 0)
            slack = END_MATCH_US * waits
            assert r.duration_us == pytest.approx(m.duration_us, rel=TOLERANCE, abs=slack)
            waited = sum(op.waited_us for op in m.ops)
            assert m.work_us + waited == pytest.approx(m.duration_us, rel=1e-6, abs=0.01)
            assert r.waited_us == pytest.approx(waited, rel=1e-6, abs=0.01 + slack)
            checked += 1
    return checked


@pytest.mark.parametrize("run_dir", SAMPLES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_unchanged_replay_of_the_sample_traces(run_dir: Path) -> None:
    assert _check([run_dir]) > 0


@pytest.mark.parametrize("name", REAL)
def test_unchanged_replay_of_real_traces(real_traces: Path, name: str) -> None:
    assert _check([real_traces / name]) > 0


def test_fsdp_collectives_carry_their_units() -> None:
    summaries = summaries_of([REPO_ROOT / "sample_traces" / "tiny-layer-wrap"])
    ops = [op for s in summaries for m in s.step_models for op in m.ops]
    units = {op.unit for op in ops if op.family == "all_gather"}
    assert "layers.0.attention.wq" in units
    # every forward gather of a unit has a consumer position, where the lane waits for it
    assert all(op.wait_pos_us is not None for op in ops if op.family == "all_gather")
    chunks = [c for s in summaries for m in s.step_models for c in m.unit_chunks]
    assert {c[2] for c in chunks} >= units


def test_a_lane_that_wakes_after_its_collective_ended_waited_on_it(tmp_path: Path) -> None:
    """CPU/gloo, DDP-like: two bucket all-reduces run on gloo's worker threads; the training
    thread blocks on the first and resumes 100 µs after it ends (a thread's wake-up), while the
    second still runs. The exposed interval ends at that resumption, at no collective's end; it
    is a wait on the first all-reduce all the same (the wake-up stays the lane's own time)."""
    from support.traces import TraceBuilder

    b = TraceBuilder(rank=0, backend="gloo", gpu_name=None)
    b.step(1, 0, 1000)
    b.cpu_op("aten::mm", 0, 100)
    b.annotation("gloo:all_reduce", 100, 605, tid=9001)  # bucket 1: [100, 705)
    b.cpu_op("aten::mm", 110, 90)
    b.annotation("gloo:all_reduce", 200, 700, tid=9002)  # bucket 2: [200, 900)
    b.cpu_op("aten::copy_", 805, 45)  # woken 100 µs after bucket 1 ended
    b.cpu_op("aten::add", 900, 100)  # after bucket 2
    (summary,) = summaries_of([b.write(tmp_path / "rank-0.json")])
    (model,) = summary.step_models
    first, second = sorted(model.ops, key=lambda op: op.start_us)
    assert first.waited_us == pytest.approx(705 - 200)  # [200, 705): not the wake-up
    assert first.wait_pos_us == pytest.approx(200)
    assert second.waited_us == pytest.approx(900 - 850)
    assert replay(model).duration_us == pytest.approx(model.duration_us)
    assert model.work_us == pytest.approx(1000 - 505 - 50)


def test_the_optimizer_steps_are_kept_as_progress_less_the_waits_inside_them(
    tmp_path: Path,
) -> None:
    """The `Optimizer.step#` range runs [600, 900); a collective the lane waited on inside it,
    [700, 750), is not the optimizer's work."""
    from support.traces import TraceBuilder

    b = TraceBuilder(rank=0, backend="gloo", gpu_name=None)
    b.step(1, 0, 1000)
    b.cpu_op("aten::mm", 0, 700)
    b.annotation("Optimizer.step#AdamW.step", 600, 300)
    b.annotation("gloo:all_reduce", 700, 50, tid=9001)
    b.cpu_op("aten::add", 750, 250)
    (summary,) = summaries_of([b.write(tmp_path / "rank-0.json")])
    (model,) = summary.step_models
    assert model.optimizer == [(600.0, 100.0), (700.0, 150.0)]
