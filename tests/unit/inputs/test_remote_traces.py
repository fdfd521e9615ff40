"""Traces read through fsspec (object storage): fsspec's in-memory filesystem stands in for S3."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.traces import small_job
from zdiag.analyzers.engine.summary_pipeline import SummaryOptions, analyze_via_summaries
from zdiag.analyzers.inputs.remote_traces import is_url, list_remote_traces
from zdiag.analyzers.report import encode_report
from zdiag.errors import InputError

fsspec = pytest.importorskip("fsspec")


def test_is_url() -> None:
    assert is_url("s3://bucket/job") and is_url("memory://x")
    assert not is_url("/data/job") and not is_url("file:///data/job") and not is_url(Path("a"))


def test_traces_in_object_storage_give_the_local_report(tmp_path: Path) -> None:
    job = small_job(tmp_path / "job", ranks=4, late=2)
    fs = fsspec.filesystem("memory")
    for f in sorted(job.iterdir()):
        fs.pipe(f"/zdiag-test-job/{f.name}", f.read_bytes())
    fs.pipe("/zdiag-test-job/manifest.json", b"{}")  # not a trace: left out
    try:
        urls = list_remote_traces("memory://zdiag-test-job")
        assert [u.rsplit("/", 1)[1] for u in urls] == [f"rank-{r}.json" for r in range(4)]
        remote = analyze_via_summaries(["memory://zdiag-test-job"])
        local = analyze_via_summaries([job], SummaryOptions(use_stored=False, write_cache=False))
        assert remote.sources.mapped == 4
        assert remote.report.stragglers[0].rank == 2
        assert [r.source for r in remote.report.ranks] == urls
        # the same analysis: only where the traces came from differs
        same = remote.report.__class__(
            **{
                **{f: getattr(remote.report, f) for f in remote.report.__struct_fields__},
                "inputs": local.report.inputs,
                "ranks": local.report.ranks,
            }
        )
        assert encode_report(same) == encode_report(local.report)
        with pytest.raises(InputError, match="no trace files"):
            analyze_via_summaries(["memory://zdiag-empty-job"])
    finally:
        fs.rm("/zdiag-test-job", recursive=True)


def test_unknown_protocol_is_one_input_error() -> None:
    with pytest.raises(InputError, match="cannot be listed"):
        list_remote_traces("nosuchprotocol://bucket/job")


def test_urls_and_local_paths_are_not_mixed(tmp_path: Path) -> None:
    job = small_job(tmp_path / "job", ranks=2, late=1)
    with pytest.raises(InputError, match="cannot be mixed"):
        analyze_via_summaries(["memory://x", job])
