"""Issue 14, parts 4 and 6: damaged input is one sentence and exit 2 (never an internal error),
and no data is lost silently. Each case reproduces one reported failure on a small real trace."""

from __future__ import annotations

import gzip
import json
import pickle
import re
from pathlib import Path
from typing import Any

import fuzz_inputs as fz
import numpy as np
import pytest

from zdiag.analyzers.inputs.cuda_snapshot import read_snapshot
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.inputs.memory_timeline import load_memory_timeline
from zdiag.analyzers.memory.memory_snapshot import summarize_snapshot
from zdiag.errors import InputError


def analyze(path: Path, *extra: str) -> tuple[int, str]:
    rc, stderr, _ = fz.run_zdiag(["analyze", "-q", *extra, str(path)])
    assert fz.verdict(rc, stderr) is None, stderr
    return rc, stderr


def write_trace(tmp_path: Path, doc: Any, name: str = "rank-0.json") -> Path:
    path = tmp_path / name
    path.write_bytes(fz.dumps(doc))
    return path


def one_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


# --- part 4: damaged input is exit 2 -------------------------------------------------------


def test_invalid_utf8_in_a_name_is_one_sentence(tmp_path: Path) -> None:
    text = fz.trace_bytes(fz.base_trace())
    at = text.index(b'"name": "') + len(b'"name": "')
    damaged = text[:at] + b"\xff\xc0" + text[at + 2 :]  # two bytes flipped inside a name
    path = tmp_path / "rank-0.json"
    path.write_bytes(damaged)
    rc, stderr = analyze(path)
    assert rc == 2 and "not UTF-8" in one_error(stderr)


@pytest.mark.parametrize(
    "doc",
    [
        {"traceEvents": fz.deep(50_000)},
        {"traceEvents": [{"ph": "X", "name": "k", "ts": 1, "dur": 1, "args": fz.deep(5000)}]},
        {"traceEvents": [], "distributedInfo": {"rank": fz.deep(5000)}},
    ],
    ids=["events", "args", "header"],
)
def test_nesting_deeper_than_the_decoder_is_one_sentence(tmp_path: Path, doc: Any) -> None:
    rc, stderr = analyze(write_trace(tmp_path, doc))
    assert rc == 2 and "nested deeper" in one_error(stderr)


def _with_collective_args(**args: Any) -> dict[str, Any]:
    doc = fz.base_trace()
    for e in doc["traceEvents"]:  # the record_param_comms op and its NCCL kernel
        if "Collective name" in e.get("args", {}):
            e["args"].update(args)
    return doc


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (_with_collective_args(**{"External id": 2**63}), "External id"),
        (_with_collective_args(**{"In msg nelems": 2**64}), "In msg nelems"),
        (_with_collective_args(**{"Group size": 2**63}), "Group size"),
        (_with_collective_args(**{"In msg nelems": 1e300}), "In msg nelems"),
        (None, "ProfilerStep"),
        (None, "Input Dims"),
    ],
    ids=["external-id", "in-msg-nelems", "group-size", "float-nelems", "step-number", "dims"],
)
def test_integers_beyond_64_bits_are_one_sentence(tmp_path: Path, doc: Any, field: str) -> None:
    if field == "ProfilerStep":
        doc = fz.base_trace()
        step = next(e for e in doc["traceEvents"] if e["name"].startswith("ProfilerStep#"))
        step["name"] = f"ProfilerStep#{2**64}"
    elif field == "Input Dims":  # gloo runs: sizes from the op's largest input
        ev = {"ph": "X", "cat": "cpu_op", "pid": 1, "tid": 1, "dur": 5.0}
        doc = {
            "traceEvents": [
                dict(ev, name="ProfilerStep#1", cat="user_annotation", ts=0.0, dur=100.0),
                dict(ev, name="gloo:all_reduce", ts=1.0, args={"Input Dims": [[2**40, 2**40]]}),
            ]
        }
    rc, stderr = analyze(write_trace(tmp_path, doc))
    line = one_error(stderr)
    assert rc == 2 and "64-bit" in line and field in line


@pytest.mark.parametrize(
    "args",
    ["oops", [1, 2], {"Collective name": {"a": 1}, "dtype": [], "Group size": "x"}, 7],
    ids=["string", "list", "mistyped-values", "number"],
)
def test_wrong_types_in_args_are_not_internal_errors(tmp_path: Path, args: Any) -> None:
    doc = _with_collective_args()
    next(e for e in doc["traceEvents"] if e.get("name") == "record_param_comms")["args"] = args
    rc, stderr = analyze(write_trace(tmp_path, doc))
    assert rc in (0, 2)
    if rc == 2:
        assert "Kineto trace" in one_error(stderr)


@pytest.mark.parametrize(
    "timeline",
    [
        fz.deep(20_000),
        [[1, 2], [[2**63] * 9, [0] * 9]],
        [[[1, 2]], [[0] * 9]],
        [[1, 2, 3], [[0] * 9]],
        "not a list",
    ],
    ids=["deep", "int64-overflow", "2d-times", "length-mismatch", "string"],
)
def test_memory_timeline_problems_are_warnings(tmp_path: Path, timeline: Any) -> None:
    run = fz.make_run_dir(tmp_path / "run")
    path = run / "memory" / "rank-0.timeline.json.gz"
    path.write_bytes(gzip.compress(fz.dumps(timeline)))
    with pytest.raises(InputError):
        load_memory_timeline(path, 0)
    out = tmp_path / "report.json"
    rc, stderr, _ = fz.run_zdiag(["analyze", "-q", "--json", "-o", str(out), str(run)])
    assert rc == 0, stderr
    assert "memory timeline skipped" in json.dumps(json.loads(out.read_text()))


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("segment.device", "x"),
        ("segment.total_size", [1]),
        ("block.size", "big"),
        ("block.size", 2**70),
        ("block.state", 3),
        ("block.frames", "frames"),
        ("segments", {"a": 1}),
        ("oom.size", "x"),
    ],
)
def test_snapshot_fields_of_the_wrong_type_are_input_errors(
    tmp_path: Path, where: str, value: Any
) -> None:
    doc = fz.snapshot_doc()
    seg = doc["segments"][0]
    target, key = {
        "segment.device": (seg, "device"),
        "segment.total_size": (seg, "total_size"),
        "block.size": (seg["blocks"][0], "size"),
        "block.state": (seg["blocks"][0], "state"),
        "block.frames": (seg["blocks"][0], "frames"),
        "segments": (doc, "segments"),
        "oom.size": (doc["device_traces"][0][0], "size"),
    }[where]
    target[key] = value
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(doc))
    with pytest.raises(InputError, match="snapshot"):
        summarize_snapshot(read_snapshot(path))


def test_a_good_snapshot_still_summarizes(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(fz.snapshot_doc()))
    mem = summarize_snapshot(read_snapshot(path))
    assert mem.in_use_bytes == 1 << 20 and mem.category_bytes == {"ACTIVATION": 1 << 20}
    assert mem.oom_request_bytes == 1 << 21 and mem.oom_device_free_bytes == 100


# --- part 6: no silent data loss -------------------------------------------------------------

EV = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7}


def test_events_without_ts_are_counted_and_warned(tmp_path: Path) -> None:
    doc = {"traceEvents": [dict(EV, ts=None, dur=1.0), dict(EV, ts=5.0, dur=2.0), dict(EV, dur=1)]}
    trace = load_rank_trace(write_trace(tmp_path, doc))
    assert len(trace) == 1
    assert any("2 complete events without a 'ts'" in w for w in trace.warnings)


def test_a_ts_far_outside_the_trace_is_left_out_with_a_warning(tmp_path: Path) -> None:
    doc = fz.base_trace()
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    before = load_rank_trace(write_trace(tmp_path, doc, "a.json"))
    spans[5]["ts"] = 1e300
    after = load_rank_trace(write_trace(tmp_path, doc, "b.json"))
    assert len(after) == len(before) - 1
    assert any("far outside" in w and "1e+300" in w for w in after.warnings)
    # the other durations are intact (1e300 in the column made every duration 0 before)
    assert np.count_nonzero(after.dur_us) >= np.count_nonzero(before.dur_us) - 1
    assert analyze(tmp_path / "b.json")[0] == 0


def test_a_ts_of_1e18_among_real_events_is_left_out(tmp_path: Path) -> None:
    doc = fz.base_trace()
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    spans[3]["ts"] = spans[3]["ts"] + 1e13  # ~4 months after a trace of a few seconds
    trace = load_rank_trace(write_trace(tmp_path, doc))
    assert any("far outside" in w for w in trace.warnings)


@pytest.mark.parametrize("rank", [1e30, -3, 2**40, "x", 1.5])
def test_impossible_distributed_info_ranks_are_refused(tmp_path: Path, rank: Any) -> None:
    doc = fz.base_trace()
    doc["distributedInfo"]["rank"] = rank
    rc, stderr = analyze(write_trace(tmp_path, doc))
    line = one_error(stderr)
    assert rc == 2 and "distributedInfo.rank" in line
    assert re.search(r"not a rank", line)
