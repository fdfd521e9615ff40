"""`--engine ray`: the map as Ray tasks gives the local engine's Report (skipped without Ray)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from support.traces import small_job
from zdiag.analyzers.engine.summary_engines import RayEngine, make_engine
from zdiag.analyzers.engine.summary_pipeline import SummaryOptions, analyze_via_summaries
from zdiag.analyzers.report import encode_report
from zdiag.errors import ConfigError

pytestmark = pytest.mark.slow  # real processes or engines: seconds per test (make integration)

HAVE_RAY = importlib.util.find_spec("ray") is not None


@pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install 'zdiag[ray]')")
def test_ray_engine_gives_the_local_report(tmp_path: Path) -> None:
    job = small_job(tmp_path / "job")
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

    job = small_job(tmp_path / "job", ranks=2, late=1)
    (job / "rank-1.json").write_text("{not json")
    with pytest.raises(InputError, match=r"rank-1\.json"):
        analyze_via_summaries(
            [job], SummaryOptions(use_stored=False, write_cache=False, engine=RayEngine(num_cpus=1))
        )


@pytest.mark.skipif(HAVE_RAY, reason="ray is installed")
def test_engine_ray_without_ray_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"zdiag\[ray\]"):
        make_engine("ray")
