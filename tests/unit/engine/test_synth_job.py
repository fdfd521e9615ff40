"""bench/synth_job.py: the injected faults are in the traces, and the analysis names the straggler."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import orjson
import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.engine.summary_pipeline import analyze_paths

REPO = REPO_ROOT


def _synth():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("synth_job", REPO / "bench" / "synth_job.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["synth_job"] = mod
    spec.loader.exec_module(mod)
    return mod


synth = _synth()


def _collectives(path: Path) -> list[dict]:
    doc = orjson.loads(path.read_bytes())
    return [e for e in doc["traceEvents"] if synth.is_collective(e)]


def _all_timed(path: Path) -> list[dict]:
    doc = orjson.loads(path.read_bytes())
    return [e for e in doc["traceEvents"] if e.get("ph") != "M"]


def test_faults_are_written_into_the_traces(tmp_path: Path) -> None:
    faults = synth.write_job(tmp_path, 16, faults=synth.Faults(ranks_per_node=4))
    assert faults.stragglers == [6] and faults.slow_node == 3 and faults.hung == 14
    healthy = _collectives(tmp_path / "rank-0.json")
    late = _collectives(tmp_path / "rank-6.json")
    slow = _collectives(tmp_path / "rank-13.json")
    hung = _collectives(tmp_path / "rank-14.json")
    assert len(healthy) == len(late) == len(slow) > len(hung) >= 1
    # the straggler starts every collective later and ends it at the same time (within jitter)
    assert all(b["ts"] - a["ts"] > 100 for a, b in zip(healthy, late, strict=True))
    assert all(
        abs((a["ts"] + a["dur"]) - (b["ts"] + b["dur"])) < 1
        for a, b in zip(healthy, late, strict=True)
    )
    # the slow node's collectives last longer
    assert sum(e["dur"] for e in slow) > 2.5 * sum(e["dur"] for e in healthy)
    # the hung rank's last collective runs to the end of the span; nothing starts after it
    doc = orjson.loads((tmp_path / "rank-14.json").read_bytes())
    last = max(hung, key=lambda e: e["ts"])
    assert all(e["ts"] <= last["ts"] for e in doc["traceEvents"] if e.get("ph") != "M")
    span_end = max(e["ts"] + e.get("dur", 0) for e in _all_timed(tmp_path / "rank-0.json"))
    assert last["ts"] + last["dur"] == pytest.approx(span_end, abs=1)
    info = orjson.loads((tmp_path / "rank-13.json").read_bytes())
    assert info["distributedInfo"]["rank"] == 13 and info["distributedInfo"]["world_size"] == 16
    assert info["host_name"] == "node-3"
    assert "stragglers: [6]" in (tmp_path / "synth-job.txt").read_text()


def test_bad_ranks_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="outside"):
        synth.write_job(tmp_path, 8, faults=synth.Faults(stragglers=[8]))
    with pytest.raises(ValueError, match="at least 2"):
        synth.write_job(tmp_path, 1)


def _named_straggler(folder: Path) -> tuple[int, list[int]]:
    report = analyze_paths([folder])
    finding = next(f for f in report.findings if f.id == "straggler")
    return report.stragglers[0].rank, finding.ranks


def test_16_rank_job_names_its_straggler(tmp_path: Path) -> None:
    synth.write_job(tmp_path, 16, faults=synth.Faults(stragglers=[5]))
    assert _named_straggler(tmp_path) == (5, [5])


@pytest.mark.slow
def test_256_rank_job_names_its_straggler(tmp_path: Path) -> None:
    faults = synth.write_job(tmp_path, 256)
    assert faults.stragglers == [86]
    assert _named_straggler(tmp_path) == (86, [86])
