"""`--engine ray`: the map as Ray tasks gives the local engine's Report (skipped without Ray)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from zdiag.analyzers.report import encode_report
from zdiag.analyzers.summary_engines import RayEngine, make_engine
from zdiag.analyzers.summary_pipeline import SummaryOptions, analyze_via_summaries
from zdiag.analyzers.synthetic import TraceBuilder
from zdiag.errors import ConfigError

HAVE_RAY = importlib.util.find_spec("ray") is not None


def _job(folder: Path, ranks: int = 6, late: int = 4) -> Path:
    folder.mkdir()
    for r in range(ranks):
        b = TraceBuilder(rank=r, world_size=ranks)
        for step in range(3):
            t0 = step * 10_000.0
            b.step(step, t0, 9_000)
            b.kernel("sm90_gemm", t0 + 100, 4_000, launch_at=t0 + 50)
            delay = 2_500.0 if r == late else 0.0
            b.kernel(
                "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                t0 + 4_200 + delay,
                3_500 - delay,
                stream=20,
                launch_at=t0 + 4_150,
            )
        b.write(folder / f"rank-{r}.json")
    return folder


@pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install 'zdiag[ray]')")
def test_ray_engine_gives_the_local_report(tmp_path: Path) -> None:
    job = _job(tmp_path / "job")
    local = analyze_via_summaries([job], SummaryOptions(use_stored=False, write_cache=False))
    ray = analyze_via_summaries(
        [job],
        SummaryOptions(use_stored=False, write_cache=False, engine=RayEngine(num_cpus=2)),
    )
    assert ray.sources.mapped == 6
    assert encode_report(ray.report) == encode_report(local.report)
    assert ray.report.stragglers[0].rank == 4


@pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install 'zdiag[ray]')")
def test_ray_engine_reports_a_bad_trace_as_input_error(tmp_path: Path) -> None:
    from zdiag.errors import InputError

    job = _job(tmp_path / "job", ranks=2, late=1)
    (job / "rank-1.json").write_text("{not json")
    with pytest.raises(InputError, match=r"rank-1\.json"):
        analyze_via_summaries(
            [job], SummaryOptions(use_stored=False, write_cache=False, engine=RayEngine(num_cpus=1))
        )


@pytest.mark.skipif(HAVE_RAY, reason="ray is installed")
def test_engine_ray_without_ray_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"zdiag\[ray\]"):
        make_engine("ray")
