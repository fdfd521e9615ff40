"""Interval math, step windows and per-step breakdown on hand-built traces with known answers."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from support.traces import TraceBuilder
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.rank import intervals as iv
from zdiag.analyzers.rank import verdict
from zdiag.analyzers.report import StepBreakdown


def _set(pairs: list[tuple[float, float]]) -> iv.IntervalSet:
    return iv.union(np.array([p[0] for p in pairs], float), np.array([p[1] for p in pairs], float))


def _pairs(s: iv.IntervalSet) -> list[tuple[float, float]]:
    return [(float(a), float(b)) for a, b in zip(s[0], s[1], strict=True)]


# --- intervals ------------------------------------------------------------------------------


def test_union_merges_overlapping_and_nested_and_drops_empty() -> None:
    s = _set([(5, 8), (0, 2), (1, 3), (6, 7), (10, 10), (3, 4)])
    # [0,2)+[1,3) -> [0,3); [3,4) touches -> [0,4); [5,8) holds [6,7); [10,10) is empty.
    assert _pairs(s) == [(0, 4), (5, 8)]
    assert iv.total(s) == 7


def test_intersect_and_subtract() -> None:
    a = _set([(0, 10), (20, 30)])
    b = _set([(5, 25)])
    assert _pairs(iv.intersect(a, b)) == [(5, 10), (20, 25)]
    assert _pairs(iv.subtract(a, b)) == [(0, 5), (25, 30)]
    assert _pairs(iv.subtract(b, a)) == [(10, 20)]
    assert iv.total(iv.intersect(a, iv.EMPTY)) == 0
    assert _pairs(iv.subtract(a, iv.EMPTY)) == _pairs(a)


def test_clip_and_clipped_totals_per_window() -> None:
    a = _set([(0, 10), (20, 30), (35, 40)])
    assert _pairs(iv.clip(a, 5, 25)) == [(5, 10), (20, 25)]
    totals = iv.clipped_totals(a, np.array([0.0, 5, 12, 25, 50]), np.array([5.0, 25, 18, 38, 60]))
    assert totals.tolist() == [5, 10, 0, 8, 0]


def test_clipped_totals_matches_clip_on_random_sets() -> None:
    rng = np.random.default_rng(7)
    starts = rng.uniform(0, 1000, 300)
    a = iv.union(starts, starts + rng.uniform(0, 30, 300))
    edges = np.sort(rng.uniform(-50, 1050, 21))
    got = iv.clipped_totals(a, edges[:-1], edges[1:])
    want = [iv.total(iv.clip(a, lo, hi)) for lo, hi in itertools.pairwise(edges)]
    assert np.allclose(got, want)


# --- one GPU step, every category, hand-computed -------------------------------------------


def _one_step(tmp_path: Path) -> StepBreakdown:
    b = TraceBuilder(rank=0)
    b.step(1, 0, 1000)
    b.kernel("sm90_xmma_gemm_bf16", 100, 300, stream=7, launch_at=10)  # [100, 400)
    b.kernel("elementwise_kernel", 350, 250, stream=8, launch_at=20)  # [350, 600)
    b.kernel("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 500, 300, stream=20, launch_at=30)
    b.memcpy(850, 50)  # [850, 900): not covered by anything
    b.memcpy(150, 50)  # [150, 200): under compute, not counted as memcpy
    report = analyze_paths([b.write(tmp_path / "t.json")])
    (rank,) = report.ranks
    (step,) = rank.steps
    return step


def test_breakdown_of_a_hand_built_step(tmp_path: Path) -> None:
    s = _one_step(tmp_path)
    assert s.step == 1
    assert s.duration_ms == pytest.approx(1.0)
    assert s.compute_ms == pytest.approx(0.5)  # [100, 600)
    assert s.comm_ms == pytest.approx(0.3)  # [500, 800)
    assert s.overlapped_ms == pytest.approx(0.1)  # [500, 600)
    assert s.exposed_comm_ms == pytest.approx(0.2)  # [600, 800)
    assert s.memcpy_ms == pytest.approx(0.05)  # [850, 900)
    assert s.idle_ms == pytest.approx(0.25)  # 1000 - 500 - 200 - 50
    assert s.kernel_count == 3
    assert s.host_launch_ms == pytest.approx(0.015)  # three 5 us launch calls
    total = s.compute_ms + s.exposed_comm_ms + s.memcpy_ms + s.idle_ms
    assert total == pytest.approx(s.duration_ms)
    # idle 25% < 40%, comm/compute 0.6 < 1, exposed 20% >= 15%
    assert s.verdict == "exposed-comm"
    assert "20%" in s.verdict_reason


def test_gpu_lag_moves_the_step_boundary_to_the_device(tmp_path: Path) -> None:
    """Step 1's kernel runs after its CPU range ended; it still belongs to step 1."""
    b = TraceBuilder(rank=0)
    b.step(1, 0, 100)
    b.step(2, 100, 100)
    b.kernel("gemm_a", 150, 100, launch_at=10)  # launched in step 1, runs [150, 250)
    b.kernel("gemm_b", 250, 50, launch_at=110)  # launched in step 2, runs [250, 300)
    report = analyze_paths([b.write(tmp_path / "t.json")])
    s1, s2 = report.ranks[0].steps
    assert (s1.start_ms, s1.duration_ms) == (pytest.approx(0.0), pytest.approx(0.25))
    assert (s1.compute_ms, s1.idle_ms) == (pytest.approx(0.1), pytest.approx(0.15))
    assert (s2.start_ms, s2.duration_ms) == (pytest.approx(0.25), pytest.approx(0.05))
    assert (s2.compute_ms, s2.idle_ms) == (pytest.approx(0.05), pytest.approx(0.0))


def test_host_only_run_threads_are_lanes_and_blocked_time_is_not_compute(tmp_path: Path) -> None:
    b = TraceBuilder(rank=1, backend="gloo", gpu_name=None)
    b.step(3, 0, 1000)
    b.cpu_op("aten::mm", 0, 400)
    b.cpu_op("c10d::allreduce_", 400, 300)
    b.cpu_op("aten::copy_", 450, 50)  # inside the blocked collective on the same thread
    b.annotation("gloo:all_reduce", 410, 280, tid=9001)  # the worker thread does the transfer
    b.cpu_op("aten::add", 800, 100, tid=9002)  # another thread computing
    report = analyze_paths([b.write(tmp_path / "t.json")])
    (rank,) = report.ranks
    assert rank.device == "cpu"
    (s,) = rank.steps
    assert s.compute_ms == pytest.approx(0.5)  # [0,400) + [800,900)
    assert s.comm_ms == pytest.approx(0.3)  # [400, 700)
    assert s.exposed_comm_ms == pytest.approx(0.3)
    assert s.idle_ms == pytest.approx(0.2)  # [700,800) + [900,1000)
    assert any("CPU-only" in w for w in rank.warnings)
    (coll,) = report.collectives
    assert (coll.kind, coll.count) == ("all_reduce", 1)  # the gloo op, not also the c10d op


def test_breakdown_sums_to_duration_on_a_random_trace(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    b = TraceBuilder(rank=0)
    for k in range(4):
        b.step(k, k * 1000, 1000)
    names = ["gemm", "ncclDevKernel_ReduceScatter_RING", "softmax", "ncclKernel_AllReduce_RING"]
    for j in range(200):
        start = float(rng.uniform(0, 4000))
        b.kernel(names[j % 4], start, float(rng.uniform(1, 60)), stream=7 + j % 3, launch_at=start)
    for _ in range(20):
        b.memcpy(float(rng.uniform(0, 4000)), 10)
    report = analyze_paths([b.write(tmp_path / "t.json")])
    for s in report.ranks[0].steps:
        parts = s.compute_ms + s.exposed_comm_ms + s.memcpy_ms + s.idle_ms
        assert parts == pytest.approx(s.duration_ms, abs=1e-5)
        assert s.overlapped_ms + s.exposed_comm_ms == pytest.approx(s.comm_ms, abs=1e-5)
        assert s.verdict in ("compute-bound", "comm-bound", "exposed-comm", "host-bound")


# --- steps ---------------------------------------------------------------------------------


def test_optimizer_step_fallback_and_whole_trace_fallback(tmp_path: Path) -> None:
    b = TraceBuilder(rank=0)
    b.kernel("gemm", 0, 50, launch_at=0)
    b.annotation("Optimizer.step#AdamW.step", 80, 20)
    b.kernel("gemm", 120, 50, launch_at=110)
    b.annotation("Optimizer.step#AdamW.step", 180, 20)
    report = analyze_paths([b.write(tmp_path / "opt.json")])
    steps = report.ranks[0].steps
    assert [s.step for s in steps] == [0, 1]
    assert any("optimizer-step" in w for w in report.ranks[0].warnings)

    b = TraceBuilder(rank=0)
    b.kernel("gemm", 0, 50, launch_at=0)
    b.kernel("gemm", 100, 50, launch_at=90)
    report = analyze_paths([b.write(tmp_path / "none.json")])
    (only,) = report.ranks[0].steps
    assert only.duration_ms == pytest.approx(0.15)
    assert only.compute_ms == pytest.approx(0.1)
    assert any("one window" in w for w in report.ranks[0].warnings)


def test_fsdp_forward_marker_fallback(tmp_path: Path) -> None:
    b = TraceBuilder(rank=0, backend="gloo", gpu_name=None)
    for k in range(3):
        b.annotation("FSDP::root_pre_forward", k * 100, 5)
        b.cpu_op("aten::mm", k * 100 + 10, 50)
    report = analyze_paths([b.write(tmp_path / "fwd.json")])
    assert len(report.ranks[0].steps) == 3


def test_profiler_step_on_gpu_lane_is_not_a_step_or_activity(tmp_path: Path) -> None:
    b = TraceBuilder(rank=0)
    b.step(1, 0, 100)
    b.kernel("ProfilerStep#1", 0, 100, cat="gpu_user_annotation")
    b.kernel("gemm", 10, 20, launch_at=5)
    trace = load_rank_trace(b.write(tmp_path / "t.json"))
    report = analyze_paths([trace.source])
    (s,) = report.ranks[0].steps
    assert s.compute_ms == pytest.approx(0.02)


# --- verdicts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("duration", "compute", "comm", "exposed", "idle", "expected"),
    [
        (100, 20, 5, 5, 50, "host-bound"),  # idle 50% >= 40%
        (100, 30, 60, 40, 10, "comm-bound"),  # comm/compute 2 and exposed 40%
        (100, 60, 40, 20, 10, "exposed-comm"),  # comm/compute 0.67, exposed 20%
        (100, 85, 30, 5, 10, "compute-bound"),
        (100, 0.5, 1, 1, 5, "compute-bound"),  # comm > compute but harmless (exposed 1%)
    ],
)
def test_verdict_rules(
    duration: float, compute: float, comm: float, exposed: float, idle: float, expected: str
) -> None:
    got, reason = verdict.decide(duration, compute, comm, exposed, idle)
    assert got == expected
    assert reason


def test_thresholds_are_reported(tmp_path: Path) -> None:
    b = TraceBuilder(rank=0)
    b.step(1, 0, 100)
    report = analyze_paths([b.write(tmp_path / "t.json")])
    assert report.thresholds == verdict.thresholds()
    assert report.thresholds["host_bound_idle_fraction"] == verdict.HOST_BOUND_IDLE_FRACTION


def test_two_gpus_in_one_trace_are_flagged(tmp_path: Path) -> None:
    b = TraceBuilder(rank=0)
    b.step(1, 0, 100)
    b.kernel("gemm", 10, 20, launch_at=5)
    b.kernel("gemm", 10, 20, launch_at=6)
    b.events[-2]["pid"] = 1  # the second kernel ran on GPU 1
    report = analyze_paths([b.write(tmp_path / "t.json")])
    assert any("2 GPUs" in w for w in report.ranks[0].warnings)


def test_timeline_of_the_median_step_and_rank_cap(tmp_path: Path) -> None:
    from zdiag.analyzers.rank.timeline import MAX_TIMELINE_RANKS

    for r in range(MAX_TIMELINE_RANKS + 2):
        b = TraceBuilder(rank=r)
        t = 0.0
        for k, length in enumerate((100, 300, 200)):  # median: step 2 (200 us + 10 us x rank)
            b.step(k, t, length + 10 * r)
            b.kernel("gemm", t + 5, length - 10, launch_at=t + 1)  # ends inside its step
            if k == 2:
                b.annotation("FSDP::pre_forward (layers.0)", t + 1, 50)
            t += length + 10 * r
        b.write(tmp_path / f"rank-{r}.json")
    report = analyze_paths([tmp_path])
    assert len(report.timelines) == MAX_TIMELINE_RANKS
    ranks = [tl.rank for tl in report.timelines]
    assert ranks[0] == 0 and ranks[-1] == MAX_TIMELINE_RANKS + 1  # rank 0 and the slowest
    assert 1 not in ranks  # one of the fastest is left out
    tl = report.timelines[0]
    assert tl.step == 2 and not tl.truncated
    lanes = {(s.lane, s.name) for s in tl.spans}
    assert ("compute", "gemm") in lanes and ("fsdp", "FSDP::pre_forward (layers.0)") in lanes
    gemm = next(s for s in tl.spans if s.lane == "compute")
    assert (gemm.start_ms, gemm.dur_ms) == (pytest.approx(0.005), pytest.approx(0.19))


def test_host_wrapper_ops_blocked_in_a_hook_are_not_compute(tmp_path: Path) -> None:
    """An autograd node spans FSDP's pre-backward hook waiting for a gloo all-gather."""
    b = TraceBuilder(rank=0, backend="gloo", gpu_name=None)
    b.step(1, 0, 1000)
    b.cpu_op("autograd::engine::evaluate_function: AddBackward0", 0, 900)
    b.cpu_op("AddBackward0", 10, 100)  # an autograd node: only its children compute
    b.cpu_op("aten::add", 20, 50)
    b.cpu_op("aten::mm", 200, 300)  # self time is the matmul...
    b.cpu_op("aten::resolve_conj", 210, 5)  # ...around a tiny child
    # [500, 900): the hook waits for the all-gather running on the gloo thread
    b.annotation("gloo:all_gather", 480, 420, tid=9001)
    report = analyze_paths([b.write(tmp_path / "t.json")])
    (s,) = report.ranks[0].steps
    assert s.compute_ms == pytest.approx(0.35)  # aten::add 50 + aten::mm 300 (child included)
    assert s.comm_ms == pytest.approx(0.42)
    assert s.overlapped_ms == pytest.approx(0.02)  # [480, 500) under aten::mm
    assert s.exposed_comm_ms == pytest.approx(0.40)
