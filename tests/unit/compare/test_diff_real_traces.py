"""`zdiag diff` on real traces: HTA's trace-diff control trace (TorchRec on 8x A100) against
itself and against edited copies whose changes are known, and the recorded GPU pair; each
checked against a computation that does not go through zdiag (the raw events)."""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.compare.diff import diff_reports
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.report import Report

CONTROL = "hta/a100_torchrec_rank3_of_8.json.gz"
DILATION = 1.1
RENAMED = "aten::index_select"


def _load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        data: dict[str, Any] = json.load(f)
    return data


def _profiler_steps(trace: dict[str, Any]) -> list[float]:
    """The ProfilerStep spans' durations in ms, from the raw events."""
    return [
        e["dur"] / 1000.0
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
    ]


def _write(trace: dict[str, Any], path: Path) -> Path:
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    return path


@pytest.fixture(scope="module")
def control(request: pytest.FixtureRequest) -> tuple[dict[str, Any], Report]:
    real = REPO_ROOT.parent / "shared" / "real_traces"
    if not (real / CONTROL).is_file():
        pytest.skip("the real traces live in ../shared next to the checkout")
    return _load(real / CONTROL), analyze_paths([real / CONTROL])


def test_the_control_trace_against_itself_is_no_change(
    control: tuple[dict[str, Any], Report],
) -> None:
    _, report = control
    d = diff_reports(report, report)
    assert d.headline.startswith("no change")
    assert not d.operators and d.operators_unchanged > 300


def test_a_slower_copy_gives_the_step_delta_the_raw_events_give(
    control: tuple[dict[str, Any], Report], tmp_path: Path
) -> None:
    raw, report = control
    slow = json.loads(json.dumps(raw))
    origin = min(e["ts"] for e in slow["traceEvents"] if "ts" in e)
    for e in slow["traceEvents"]:
        if "ts" in e:
            e["ts"] = origin + (e["ts"] - origin) * DILATION
        if "dur" in e:
            e["dur"] = e["dur"] * DILATION
    b = analyze_paths([_write(slow, tmp_path / "slow.json.gz")])
    d = diff_reports(report, b)
    expected = statistics.median(_profiler_steps(slow)) - statistics.median(_profiler_steps(raw))
    step = d.step_time()
    assert step is not None and step.change == "up"
    assert step.delta == pytest.approx(expected, rel=0.03)
    assert step.pct == pytest.approx(100 * (DILATION - 1), abs=0.5)
    # same calls, each longer: no name added, deleted, increased or decreased
    assert {o.change for o in d.operators} <= {"slower"}


def test_a_renamed_operator_is_deleted_and_added_with_its_counts(
    control: tuple[dict[str, Any], Report], tmp_path: Path
) -> None:
    raw, report = control
    edited = json.loads(json.dumps(raw))
    steps = [
        (e["ts"], e["ts"] + e["dur"])
        for e in edited["traceEvents"]
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
    ]
    in_steps = 0
    for e in edited["traceEvents"]:
        if e.get("name") == RENAMED and e.get("cat") == "cpu_op":
            e["name"] = "user::renamed_op"
            in_steps += any(s <= e["ts"] < t for s, t in steps)
    assert in_steps > 0
    d = diff_reports(report, analyze_paths([_write(edited, tmp_path / "renamed.json.gz")]))
    changes = {(o.name, o.change): o for o in d.operators}
    gone, new = changes[(RENAMED, "deleted")], changes[("user::renamed_op", "added")]
    assert gone.count_a == pytest.approx(in_steps / len(steps), rel=1e-3)
    assert new.count_b == gone.count_a and gone.count_b == 0
    assert d.headline.startswith("no change"), d.headline  # a name changed, not the time


def test_the_gpu_pair_names_the_whole_model_wrap_first() -> None:
    gpu = REPO_ROOT / "sample_traces" / "gpu"
    a = analyze_paths([gpu / "healthy-gloo"])
    b = analyze_paths([gpu / "whole-model-wrap-gloo"])
    d = diff_reports(a, b)
    assert "whole-model-wrap" in d.headline
    assert any(c.key == "harness wrap" and c.b == "whole" for c in d.config)
    units_a = {u.unit for u in d.units if u.only_in == "A"}
    assert {f"layers.{i}" for i in range(8)} <= units_a  # B has only the root unit
    kernels = [o for o in d.operators if o.device == "gpu"]
    assert kernels, "GPU kernels compared"
