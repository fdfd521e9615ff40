"""`zdiag analyze RUN_DIR` reports each triggered capture as its own window: its steps, verdict
and findings in the text and the JSON, a damaged one said in one line, never fatal."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from zdiag.cli import main

SAMPLES = REPO_ROOT / "sample_traces"


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A healthy run whose capture 1 holds serialized gathers and capture 2 a damaged trace."""
    monkeypatch.setenv("ZDIAG_CACHE", "off")
    run = tmp_path / "run"
    shutil.copytree(SAMPLES / "none", run)
    one, two = run / "captures" / "capture-1", run / "captures" / "capture-2"
    one.mkdir(parents=True)
    two.mkdir()
    for trace in (SAMPLES / "missing-overlap" / "traces").glob("rank-*.json.gz"):
        shutil.copy(trace, one / trace.name)
    (two / "rank-0.json.gz").write_bytes(gzip.compress(b"not a trace"))
    return run


def test_each_capture_is_analyzed_and_reported(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["analyze", str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    main_ids = {f["id"] for f in report["findings"]}
    first, second = report["run"]["captures"]
    assert first["capture"] == "captures/capture-1"
    assert first["ranks"] == [0, 1] and first["steps"]
    ids = {f["id"] for f in first["findings"]}
    assert "missing-overlap" in ids and "missing-overlap" not in main_ids  # its own window
    assert second["capture"] == "captures/capture-2" and "is not JSON" in second["error"]


def test_the_text_lists_the_captures_after_the_findings(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["analyze", str(run_dir)]) == 0
    text = capsys.readouterr().out
    section = text[text.index("Triggered captures (2)") :]
    assert text.index("Findings (") < text.index("Triggered captures (2)")
    assert "- captures/capture-1: steps " in section
    assert "warning missing-overlap (ranks 0–1)" in section
    assert "- captures/capture-2: not analyzed: " in section


def test_a_run_without_captures_has_no_capture_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ZDIAG_CACHE", "off")
    run = tmp_path / "run"
    shutil.copytree(SAMPLES / "none", run)
    assert main(["analyze", str(run), "--json"]) == 0
    assert "captures" not in (json.loads(capsys.readouterr().out)["run"] or {})


def test_the_page_has_a_captures_section(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "report.html"
    assert main(["analyze", str(run_dir), "--html", str(page)]) == 0
    html = page.read_text()
    section = html[html.index('<section id="captures">') :]
    section = section[: section.index("</section>")]
    assert "<code>captures/capture-1</code>" in section and "warning missing-overlap" in section
    assert "not analyzed: " in section
    run_table = html[html.index('<section id="run">') :]
    assert "capture-1" not in run_table[: run_table.index("</section>")]
