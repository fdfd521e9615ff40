"""`zdiag analyze` on real traces recorded by other teams (../shared/real_traces).

Each trace must load and give self-consistent numbers; steps must be found where the trace has
ProfilerStep markers, communication where it has collectives. Expected facts come from the
traces' own content (SOURCES.md), not from tuning to the outputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO_ROOT
from support.stages import load_run
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.inputs.events import EventKind
from zdiag.analyzers.rank.collective_table import collectives_of
from zdiag.analyzers.report import VERDICTS, Report, decode_report, encode_report

# path -> (rank, device, ProfilerStep numbers or None, collective kinds expected on the device)
EXPECTED: dict[str, tuple[int, str, list[int] | None, set[str]]] = {
    "hta/v100_ddp_rank1_of_2.json.gz": (1, "cuda", [2, 3, 4, 5, 6], {"all_reduce"}),
    "hta/a100_torchrec_rank3_of_8.json.gz": (
        3,
        "cuda",
        list(range(1009, 1015)),
        {"all_to_all", "all_reduce"},
    ),
    "hta/a100_ddp_collective_args_rank0_of_2.json.gz": (
        0,
        "cuda",
        [4, 5, 6],
        {"all_reduce", "broadcast"},
    ),
    "hta/cpu_only_gloo_rank34_of_300.json.gz": (34, "cpu", [551], {"all_reduce"}),
    "hta/mi250_single_gpu.json.gz": (0, "rocm", [1, 2], set()),
    "hta/no_distributed_info.json.gz": (0, "cpu", [1009], {"all_to_all"}),
    "hta/a100_alexnet_single.json.gz": (0, "cuda", None, set()),
    "tracelens/b200_inference_rank0_of_8.json.gz": (0, "cuda", None, {"all_reduce"}),
}


def _check_consistent(report: Report) -> None:
    assert decode_report(encode_report(report)) == report  # the --json form round-trips
    for rank in report.ranks:
        assert rank.steps
        for s in rank.steps:
            assert s.duration_ms > 0
            for v in (
                s.compute_ms,
                s.comm_ms,
                s.overlapped_ms,
                s.exposed_comm_ms,
                s.idle_ms,
                s.memcpy_ms,
            ):
                assert v >= 0
            parts = s.compute_ms + s.exposed_comm_ms + s.memcpy_ms + s.idle_ms
            assert parts == pytest.approx(s.duration_ms, rel=1e-6, abs=1e-4)
            assert s.overlapped_ms + s.exposed_comm_ms == pytest.approx(s.comm_ms, abs=1e-4)
            assert s.overlapped_ms <= min(s.compute_ms, s.comm_ms) + 1e-6
            assert s.verdict in VERDICTS and s.verdict_reason


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_trace(name: str, real_traces: Path) -> None:
    rank, device, steps, kinds = EXPECTED[name]
    report = analyze_paths([real_traces / name])
    (summary,) = report.ranks
    assert summary.rank == rank
    assert summary.device == device
    if steps is not None:
        assert [s.step for s in summary.steps] == steps
    else:
        assert len(summary.steps) == 1
        assert any("no step markers" in w for w in summary.warnings)
    found = {c.kind for c in report.collectives}
    assert kinds <= found
    if kinds:
        assert sum(s.comm_ms for s in summary.steps) > 0
    else:
        assert sum(s.comm_ms for s in summary.steps) == 0
    _check_consistent(report)


def test_sampled_128_rank_job(real_traces: Path) -> None:
    run = load_run([real_traces / "hta" / "sampled_128"])
    assert [t.rank for t in run.ranks] == [0, 1]
    assert all(t.world_size == 128 for t in run.ranks)
    report = analyze_paths([real_traces / "hta" / "sampled_128"])
    assert [[s.step for s in r.steps] for r in report.ranks] == [[551, 552], [551, 552]]
    assert {c.kind for c in report.collectives} >= {"all_to_all", "all_reduce", "all_gather"}
    _check_consistent(report)


def test_ddp_allreduce_has_sizes_from_collective_args(real_traces: Path) -> None:
    run = load_run([real_traces / "hta" / "a100_ddp_collective_args_rank0_of_2.json.gz"])
    t = run.ranks[0]
    c = collectives_of(t)
    ar = [i for i in range(len(c)) if c.kind_name(i) == "all_reduce"]
    assert ar and all(c.bytes[i] > 0 and c.dtype[i] == "Float" for i in ar)
    assert all(c.group_size[i] == 2 for i in ar)
    # every comm kernel is an NCCL kernel on a GPU stream
    assert all(t.lanes[int(t.lane_id[int(e)])].is_device for e in c.event)
    assert len(t.of_kind(EventKind.COMM_KERNEL)) == len(c)


def test_gloo_cpu_only_comm_is_on_worker_threads(real_traces: Path) -> None:
    run = load_run([real_traces / "hta" / "cpu_only_gloo_rank34_of_300.json.gz"])
    t = run.ranks[0]
    lanes = {t.lanes[int(t.lane_id[int(e)])].tid for e in collectives_of(t).event}
    assert lanes == {3553, 3554}  # the worker threads, not the main thread 1074


SAMPLES = REPO_ROOT / "sample_traces"


@pytest.mark.parametrize(
    "scenario",
    sorted(p.name for p in SAMPLES.iterdir() if (p / "traces").is_dir())
    if SAMPLES.is_dir()
    else [],
)
def test_own_harness_samples(scenario: str) -> None:
    """The project's own FSDP2 runs (CPU/gloo, 2 ranks): steps, gloo comm, FSDP units."""
    run = load_run([SAMPLES / scenario])
    assert run.manifest is not None and run.run_dir is not None
    report = analyze_paths([SAMPLES / scenario])
    assert len(report.ranks) >= 2
    assert all(r.step_source == "ProfilerStep" for r in report.ranks)
    assert all(r.device == "cpu" for r in report.ranks)
    assert sum(s.comm_ms for r in report.ranks for s in r.steps) > 0
    assert report.fsdp_units  # FSDP2 labels joined to the gloo collectives
    _check_consistent(report)
