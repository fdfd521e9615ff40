"""Stored summaries: the summary cache of any folder and in-job summaries beside the traces.

Each test checks where the summaries came from (`SummarySources`) and that the Report is the
one the trace-decoding pipeline (`analyze_paths`) gives.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from support.traces import TraceBuilder
from zdiag.analyzers.engine import summary_store
from zdiag.analyzers.engine.summarize_trace import main as summarize_main
from zdiag.analyzers.engine.summary_pipeline import (
    SummaryOptions,
    analyze_paths,
    analyze_via_summaries,
)
from zdiag.analyzers.engine.summary_store import (
    CACHE_DIR_NAME,
    StoredSummary,
    read_stored,
    summary_path_for,
    write_stored,
)
from zdiag.analyzers.report import encode_report

REPO = REPO_ROOT
SAMPLE = REPO / "sample_traces" / "none"


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.delenv("ZDIAG_CACHE", raising=False)
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    return xdg


def _job(folder: Path, ranks: int = 4) -> Path:
    """A small job: rank 2 arrives 3 ms late at every all-reduce."""
    folder.mkdir()
    for r in range(ranks):
        b = TraceBuilder(rank=r, world_size=ranks)
        for step in range(3):
            t0 = step * 10_000.0
            b.step(step, t0, 9_000)
            b.kernel("sm90_gemm", t0 + 100, 4_000, launch_at=t0 + 50)
            late = 3_000.0 if r == 2 else 0.0
            b.kernel(
                "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                t0 + 4_200 + late,
                3_500 - late,
                stream=20,
                launch_at=t0 + 4_150,
            )
        b.write(folder / f"rank-{r}.json")
    return folder


def _sources(paths: list[Path], **kw: object) -> tuple[int, int, int]:
    run = analyze_via_summaries(paths, SummaryOptions(**kw))  # type: ignore[arg-type]
    return run.sources.in_job, run.sources.cache, run.sources.mapped


def test_second_analysis_reads_the_cache_and_gives_the_same_report(tmp_path: Path) -> None:
    job = _job(tmp_path / "job")
    expected = encode_report(analyze_paths([job]))
    first = analyze_via_summaries([job])
    assert (first.sources.cache, first.sources.mapped) == (0, 4)
    assert sorted(p.name for p in (job / CACHE_DIR_NAME).iterdir()) == [
        f"rank-{r}.json.zds" for r in range(4)
    ]
    second = analyze_via_summaries([job])
    assert (second.sources.cache, second.sources.mapped) == (4, 0)
    assert encode_report(first.report) == encode_report(second.report) == expected
    assert second.report.stragglers[0].rank == 2


def test_changed_trace_is_decoded_again(tmp_path: Path) -> None:
    job = _job(tmp_path / "job")
    analyze_via_summaries([job])
    # same size, same mtime, other content: only the digest tells
    trace = job / "rank-1.json"
    st = trace.stat()
    data = bytearray(trace.read_bytes())
    tail = data.rindex(b"4200")
    data[tail : tail + 4] = b"4201"
    trace.write_bytes(bytes(data))
    os.utime(trace, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _sources([job]) == (0, 3, 1)
    # an edit in the middle, far from both ends (the old edge digest read 64 KiB of each),
    # with size and mtime restored
    big = job / "rank-3.json"
    data = bytearray(big.read_bytes())
    pad = b" " * (300 * 1024)
    body = data.rstrip()[:-1] + b"," + b'"pad":"' + pad + b'"}'
    big.write_bytes(bytes(body))
    assert _sources([job]) == (0, 3, 1)
    st = big.stat()
    middle = len(body) // 2
    body[middle] = ord("x")
    big.write_bytes(bytes(body))
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _sources([job]) == (0, 3, 1)
    # touched only (mtime): the content is the same, so the entry is used
    os.utime(job / "rank-0.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert _sources([job]) == (0, 4, 0)


def test_no_cache_reads_and_writes_nothing(tmp_path: Path) -> None:
    job = _job(tmp_path / "job")
    assert _sources([job], use_stored=False, write_cache=False) == (0, 0, 4)
    assert not (job / CACHE_DIR_NAME).exists()
    analyze_via_summaries([job])
    assert _sources([job], use_stored=False, write_cache=False) == (0, 0, 4)


def test_entries_of_another_version_or_damaged_are_misses(tmp_path: Path) -> None:
    job = _job(tmp_path / "job")
    analyze_via_summaries([job])
    entry = job / CACHE_DIR_NAME / "rank-0.json.zds"
    old = read_stored(entry)
    assert old is not None
    from zdiag import __version__

    old.zdiag_version = f"{__version__}+000000000000"  # same release, other analyzer sources
    assert write_stored(entry, old)
    (job / CACHE_DIR_NAME / "rank-1.json.zds").write_bytes(b"\x93not a summary")
    other = StoredSummary(
        schema="zdiag.rank-summary/0",
        rank=2,
        trace=old.trace,
        context_key=old.context_key,
        summary_msgpack=old.summary_msgpack,
    )
    assert write_stored(job / CACHE_DIR_NAME / "rank-2.json.zds", other)
    assert _sources([job]) == (0, 1, 3)
    assert _sources([job]) == (0, 4, 0)


def test_unwritable_folder_uses_the_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _cache_on: Path
) -> None:
    job = _job(tmp_path / "job")
    real_access = os.access

    def access(path: object, mode: int) -> bool:
        if Path(str(path)).resolve() == job.resolve() and mode == os.W_OK:
            return False
        return real_access(path, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(summary_store.os, "access", access)
    assert _sources([job]) == (0, 0, 4)
    assert not (job / CACHE_DIR_NAME).exists()
    assert len(list((_cache_on / "zdiag").glob("*.zds"))) == 4
    assert _sources([job]) == (0, 4, 0)


def test_in_job_summaries_are_used_when_they_match(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(SAMPLE, run_dir)
    expected = encode_report(analyze_paths([run_dir]))
    for r in (0, 1):
        trace = run_dir / "traces" / f"rank-{r}.json.gz"
        assert summarize_main([str(trace), str(summary_path_for(trace))]) == 0
    run = analyze_via_summaries([run_dir], SummaryOptions(write_cache=False))
    assert (run.sources.in_job, run.sources.mapped) == (2, 0)
    assert encode_report(run.report) == expected
    # a summary whose trace was replaced is not used
    shutil.copy(SAMPLE / "traces" / "rank-0.json.gz", run_dir / "traces" / "rank-1.json.gz")
    assert _sources([run_dir], write_cache=False) == (1, 0, 1)


@pytest.mark.slow  # starts a program
def test_summarizer_refuses_a_bad_trace(tmp_path: Path) -> None:
    bad = tmp_path / "rank-0.json"
    bad.write_text("{not json")
    out = summary_path_for(bad)
    proc = subprocess.run(
        [sys.executable, "-m", "zdiag.analyzers.engine.summarize_trace", str(bad), str(out)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.slow  # starts a program
def test_cli_no_cache_and_engine_options(tmp_path: Path) -> None:
    job = _job(tmp_path / "job")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "zdiag", "analyze", str(job), "-q", "--json"]
    nocache = subprocess.run([*cmd, "--no-cache"], capture_output=True, env=env)
    assert nocache.returncode == 0 and not (job / CACHE_DIR_NAME).exists()
    first = subprocess.run(cmd, capture_output=True, env=env)
    assert first.returncode == 0 and (job / CACHE_DIR_NAME).is_dir()
    assert first.stdout == nocache.stdout
    off = subprocess.run(cmd, capture_output=True, env=dict(env, ZDIAG_CACHE="off"))
    assert off.stdout == nocache.stdout
    bad = subprocess.run([*cmd, "--ray-address", "auto"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--engine ray" in bad.stderr


def test_the_code_version_digests_the_whole_map() -> None:
    """A stored summary is reused only by the code that computed it: the digest covers every
    analyzer source the map calls (the rank's map in rank/, the run's in run/), not only the
    engine's (summary_store moved into engine/ once and digested engine/ alone)."""
    from zdiag.analyzers.engine.summary_store import ANALYZERS_ROOT, digested_sources

    names = {p.relative_to(ANALYZERS_ROOT).as_posix() for p in digested_sources()}
    for source in (
        "rank/step_model.py",
        "rank/rank_analysis.py",
        "rank/fsdp_ledger.py",
        "inputs/loader.py",
        "engine/summary_store.py",
    ):
        assert source in names
