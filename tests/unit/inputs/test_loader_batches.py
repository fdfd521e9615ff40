"""The batched and parallel decode (analyzers/inputs/decode_batches.py) gives the one-shot RankTrace.

"One shot" is `batch_events` larger than the trace in this process: one batch of every event,
as the whole-document decode did. Small batches (forced through `batch_events`) and forked
workers (`workers=2`) must give identical columns, lanes, args, collectives and warnings, and
the same bad-input sentences.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support.traces import TraceBuilder
from zdiag.analyzers.inputs import decode_batches
from zdiag.analyzers.inputs.events import RankTrace
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.rank.collective_table import collectives_of
from zdiag.errors import InputError

ONE_SHOT = 10**9
SCALARS = (
    "rank",
    "rank_source",
    "device",
    "names",
    "lanes",
    "distributed_info",
    "device_properties",
    "host",
    "trace_start_us",
    "base_time_ns",
    "warnings",
)
COLUMNS = ("name_id", "ts_us", "dur_us", "lane_id", "kind", "correlation", "external_id")


def assert_same_trace(a: RankTrace, b: RankTrace) -> None:
    """Every column, table, kept args and collective of `a` and `b` are identical."""
    for name in SCALARS:
        assert getattr(a, name) == getattr(b, name), name
    for name in COLUMNS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert list(a.args) == list(b.args)
    assert all(a.args[i] == b.args[i] for i in a.args)
    for f in dataclasses.fields(collectives_of(a)):
        x, y = getattr(collectives_of(a), f.name), getattr(collectives_of(b), f.name)
        same = np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        assert same, f"collectives.{f.name}"


def _real_trace_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.json.gz") if "memory" not in p.name)


# --- identical results ----------------------------------------------------------------------


@pytest.mark.slow
def test_batches_and_workers_match_one_shot_on_real_traces(real_traces: Path) -> None:
    files = _real_trace_files(real_traces)
    assert files
    for path in files:
        one_shot = load_rank_trace(path, workers=1, batch_events=ONE_SHOT)
        small = max(7, len(one_shot) // 40)  # ~40-100 batches per trace: quick, still many
        assert_same_trace(one_shot, load_rank_trace(path, workers=1, batch_events=small))
        assert_same_trace(one_shot, load_rank_trace(path, workers=2, batch_events=small + 3))


def _synthetic() -> dict[str, Any]:
    """A trace exercising every per-batch rule: metadata spread over batches, unsorted times,
    numeric strings, negative durations, events without args, kept args with raw shape lists,
    the profiler's own span, non-complete events, names shared across batches."""
    b = TraceBuilder(rank=3)
    for step in range(4):
        t0 = 1000.0 * step
        b.step(step, t0, 900)
        b.annotation(f"FSDP::all_gather (layers.{step})", t0 + 5, 20)
        b.cpu_op(
            "record_param_comms",
            t0 + 10,
            5,
            args={
                "Collective name": "_allgather_base",
                "In msg nelems": 1024 + step,
                "dtype": "BFloat16",
                "Group size": 2,
                "Input Dims": [[1024], [step]],
            },
        )
        b.kernel("ncclDevKernel_AllGather_RING_LL(x)", t0 + 30, 40, stream=20)
        b.kernel("gemm", t0 + 400 - 100 * step, 50, launch_at=t0 + 1)  # out of time order
        b.memcpy(t0 + 600, 10)
    doc = b.to_dict()
    events = doc["traceEvents"]
    events[3]["ts"] = str(events[3]["ts"])  # numeric strings are accepted
    events[5]["dur"] = -4  # a negative duration: warning, clamped to zero
    events[6].pop("args", None)
    extra = [
        {
            "ph": "X",
            "cat": "Trace",
            "name": "PyTorch Profiler (0)",
            "pid": 1,
            "tid": 1,
            "ts": 0,
            "dur": 5000,
        },
        {"ph": "i", "cat": "cpu_op", "name": "marker", "pid": 1, "tid": 1, "ts": 7},
        {"ph": "f", "cat": "ac2g", "name": "flow", "pid": 1, "tid": 1, "ts": 8, "id": 3},
        {"ph": "X", "cat": "cpu_op", "name": "no ts", "pid": 1, "tid": 1, "dur": 1},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": " main "}},
    ]
    # Metadata first and in the middle, so thread names come from several batches.
    doc["traceEvents"] = [extra[4], *events[:9], *extra[:4], *events[9:]]
    doc["baseTimeNanoseconds"] = 1_700_000_000_000_000_000
    doc["host_name"] = "node-7"
    return doc


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("batch_events", [1, 2, 5, 16])
def test_batches_match_one_shot_on_synthetic_trace(
    tmp_path: Path, workers: int, batch_events: int
) -> None:
    path = tmp_path / "rank-3.json"
    path.write_text(json.dumps(_synthetic()))
    one_shot = load_rank_trace(path, workers=1, batch_events=ONE_SHOT)
    assert len(one_shot) > 20 and len(one_shot.args) > 0
    assert any("negative duration" in w for w in one_shot.warnings)
    got = load_rank_trace(path, workers=workers, batch_events=batch_events)
    assert_same_trace(one_shot, got)


def test_gzip_bytes_and_mapped_file_give_the_same_trace(tmp_path: Path) -> None:
    data = json.dumps(_synthetic()).encode()
    (tmp_path / "t.json").write_bytes(data)
    (tmp_path / "t.json.gz").write_bytes(gzip.compress(data))
    plain = load_rank_trace(tmp_path / "t.json", workers=2, batch_events=3)
    packed = load_rank_trace(tmp_path / "t.json.gz", workers=2, batch_events=3)
    assert_same_trace(dataclasses.replace(plain, source=packed.source), packed)


def test_id_columns_fall_back_to_careful_conversion_trace_wide(tmp_path: Path) -> None:
    """A non-integer id in one batch switches every batch to `as_int` (as one column did)."""
    ev = [
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": f"op{i}",
            "pid": 1,
            "tid": 1,
            "ts": i,
            "dur": 1,
            "args": {"External id": ext},
        }
        for i, ext in enumerate([1, 2.5, True, " 7 ", "x", None, 9])
    ]
    path = tmp_path / "ids.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    one_shot = load_rank_trace(path, workers=1, batch_events=ONE_SHOT)
    assert one_shot.external_id.tolist() == [1, -1, -1, 7, -1, -1, 9]
    for batch_events in (1, 2, 3):
        got = load_rank_trace(path, workers=1, batch_events=batch_events)
        assert got.external_id.tolist() == one_shot.external_id.tolist()


# --- bad input ------------------------------------------------------------------------------


def _events(n: int) -> list[dict[str, Any]]:
    return [
        {"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": i, "dur": 1}
        for i in range(n)
    ]


@pytest.mark.parametrize("workers", [1, 2])
def test_wrong_type_names_the_event_index_in_the_file(tmp_path: Path, workers: int) -> None:
    ev = _events(10)
    ev[7]["ph"] = 1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    with pytest.raises(InputError, match=r"bad\.json: is JSON but not a Kineto trace") as exc:
        load_rank_trace(path, workers=workers, batch_events=3)
    assert "$.traceEvents[7].ph" in str(exc.value)
    (tmp_path / "arr.json").write_text(json.dumps(ev))
    with pytest.raises(InputError, match=r"at `\$\[7\]\.ph`"):
        load_rank_trace(tmp_path / "arr.json", workers=workers, batch_events=3)


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_ts_anywhere_is_reported_before_bad_dur(tmp_path: Path, workers: int) -> None:
    ev = _events(10)
    ev[1]["dur"] = "soon"
    ev[8]["ts"] = "later"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    with pytest.raises(InputError, match=r"non-numeric 'ts' \('later'\)"):
        load_rank_trace(path, workers=workers, batch_events=2)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (lambda s: s[: len(s) - 40], "the JSON is truncated"),
        (lambda s: s.replace('"ts": 5,', '"ts": NaN,'), "NaN or Infinity"),
        (lambda s: s.replace('"ts": 5,', '"ts": 5,,'), "not valid JSON"),
        (lambda s: s.replace('"traceEvents"', '"events"'), "no 'traceEvents' list"),
    ],
)
def test_bad_json_sentences_with_small_batches(tmp_path: Path, text: Any, problem: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text(json.dumps({"traceEvents": _events(10)})))
    with pytest.raises(InputError, match=problem):
        load_rank_trace(path, workers=2, batch_events=2)


def test_small_files_decode_in_process() -> None:
    assert decode_batches.auto_workers(1024) == 1


def test_big_files_use_the_cores_they_are_given() -> None:
    big = decode_batches.PARALLEL_MIN_BYTES
    assert decode_batches.auto_workers(big, cores=1) == 1
    if decode_batches.fork_available():
        assert decode_batches.auto_workers(big, cores=3) == 3
        assert decode_batches.auto_workers(big, cores=64) == decode_batches.MAX_WORKERS


def test_gzip_members_and_padding_decompress_as_gzip_does(tmp_path: Path) -> None:
    events = _events(50)
    text = json.dumps({"traceEvents": events}).encode()
    half = len(text) // 2
    path = tmp_path / "multi.json.gz"
    path.write_bytes(gzip.compress(text[:half]) + b"\0\0" + gzip.compress(text[half:]) + b"\0")
    assert load_rank_trace(path).ts_us.tolist() == [float(e["ts"]) for e in events]
    path.write_bytes(gzip.compress(text)[:-12])
    with pytest.raises(InputError, match="gzip data is truncated or corrupt"):
        load_rank_trace(path)


def test_no_fork_while_other_threads_run(tmp_path: Path) -> None:
    import threading

    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert not decode_batches.fork_available()
        path = tmp_path / "t.json"
        path.write_text(json.dumps(_synthetic()))
        one_shot = load_rank_trace(path, workers=1, batch_events=ONE_SHOT)
        assert_same_trace(one_shot, load_rank_trace(path, workers=2, batch_events=3))
    finally:
        release.set()
        other.join()
