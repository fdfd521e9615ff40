"""`crash` and `hang` findings from the run manifest, and the world-size check (no processes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from conftest import REPO_ROOT
from zdiag.analyzers.detectors import crash, hang
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.collectors.run_records import Manifest

GLOO_PEER = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:36027"
)


def ctx(*ranks: dict[str, Any]) -> DetectorContext:
    manifest = Manifest.from_json(
        {"schema": "zdiag.manifest/1", "world_size": len(ranks), "ranks": list(ranks)}, []
    )
    return DetectorContext(ledgers={}, manifest=manifest)


def src(line: int, code: str) -> dict[str, Any]:
    return {"file": "/home/me/train.py", "line": line, "function": "main", "code": code}


def test_crash_names_the_raising_rank_not_the_torn_down_peers() -> None:
    (f,) = crash.detect(
        ctx(
            {"rank": 0, "exit_code": 1, "steps": 4, "error": GLOO_PEER},
            {
                "rank": 1,
                "exit_code": 1,
                "steps": 3,
                "error": "ValueError: bad batch",
                "error_source": src(70, "raise ValueError('bad batch')"),
            },
            {"rank": 2, "exit_code": None, "steps": 3, "ended_by": "SIGTERM"},
            {"rank": 3, "exit_code": 0, "steps": 8},
        )
    )
    assert f.id == "crash" and f.severity == "critical"
    assert f.ranks == [1] and f.steps == [3]
    assert f.evidence["torn_down"] == [0, 2]
    assert "train.py:70" in f.title and "ValueError at step 3" in f.title
    assert f.evidence["raised"][0]["line"] == 70


def test_crash_when_every_failure_is_a_consequence_names_the_first_to_end() -> None:
    (f,) = crash.detect(
        ctx(
            {"rank": 0, "exit_code": 1, "error": "DistBackendError: timed out", "ended_at": "T2"},
            {"rank": 1, "exit_code": 1, "error": "DistBackendError: timed out", "ended_at": "T1"},
        )
    )
    assert f.ranks == [1] and f.evidence["torn_down"] == [0]


def test_no_crash_finding_for_clean_runs_oom_or_bare_traces() -> None:
    assert crash.detect(ctx({"rank": 0, "exit_code": 0}, {"rank": 1, "exit_code": 0})) == []
    assert crash.detect(ctx({"rank": 0, "exit_code": 1, "oom": True, "error": "OOM"})) == []
    assert crash.detect(DetectorContext(ledgers={})) == []


def hang_record(**kw: Any) -> dict[str, Any]:
    return {"step": 3, "stalled_s": 300.0, "timeout_s": 300.0, **kw}


def test_hang_culprits_are_the_members_missing_from_the_collective() -> None:
    waiting = {"op": "all_gather_into_tensor", "group_name": "0", "group_ranks": [0, 1, 2, 3]}
    (f,) = hang.detect(
        ctx(
            {"rank": 0, "hang": hang_record(sequence_number=34, **waiting)},
            {"rank": 1, "hang": hang_record(user_file="/a/t.py", user_line=9, user_code="q.get()")},
            {"rank": 2, "hang": hang_record(sequence_number=34, **waiting)},
            {"rank": 3, "hang": hang_record(sequence_number=33, **waiting)},  # one behind
        )
    )
    assert f.id == "hang" and f.ranks == [1, 3]
    assert f.evidence["waiting_ranks"] == [0, 2]
    assert f.evidence["sequence_number"] == 34
    assert "t.py:9 `q.get()`" in f.title
    assert [c["in_collective"] for c in f.evidence["culprits"]] == [None, "all_gather_into_tensor"]


def test_hang_with_no_rank_in_a_collective_blames_every_hung_rank() -> None:
    (f,) = hang.detect(ctx({"rank": 0, "hang": hang_record()}, {"rank": 1, "hang": hang_record()}))
    assert f.ranks == [0, 1] and f.evidence["waiting_ranks"] == []
    assert hang.detect(ctx({"rank": 0, "exit_code": 0})) == []


def test_world_size_beyond_the_ranks_found_is_a_warning(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(REPO_ROOT / "sample_traces" / "none", run)
    (run / "traces" / "rank-1.json.gz").unlink()
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    report = analyze_paths([run])
    assert [r.rank for r in report.ranks] == [0]
    (warning,) = [w for w in report.warnings if w.startswith("world size 2")]
    assert "traces of only 1 rank(s)" in warning and "rank 1:" in warning


def test_a_hang_ended_by_a_collective_timeout_names_the_rank_stopped_outside_it() -> None:
    """The collective timeout fired before zdiag's hang watchdog: the waiting rank raised a
    timeout, torchrun SIGTERMed the stuck one, whose stack at the signal is outside any
    collective. That is a hang (culprit: the stuck rank), not a crash of the waiting rank."""
    timeout = (
        "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 20000ms"
    )
    stuck = {"step": 3, "stalled_s": 20.7, "timeout_s": 0.0, "user_file": "/a/kit.py",
             "user_line": 91, "user_code": "time.sleep(10**6)", "dump": "hang/rank-1.json"}  # fmt: skip
    c = ctx(
        {"rank": 0, "exit_code": 1, "steps": 3, "error": timeout},
        {"rank": 1, "exit_code": None, "steps": 3, "ended_by": "SIGTERM", "stopped_in": stuck},
    )
    (f,) = hang.detect(c)
    assert f.ranks == [1] and f.evidence["waiting_ranks"] == [0]
    assert "kit.py:91 `time.sleep(10**6)`" in f.title
    assert crash.detect(c) == []  # the timeout is the hang's consequence
    # the same timeout with the other rank torn down inside a collective stays a crash
    inside = {**stuck, "op": "all_reduce"}
    c2 = ctx(
        {"rank": 0, "exit_code": 1, "steps": 3, "error": timeout},
        {"rank": 1, "exit_code": None, "steps": 3, "ended_by": "SIGTERM", "stopped_in": inside},
    )
    assert hang.detect(c2) == [] and [f.ranks for f in crash.detect(c2)] == [[0]]
