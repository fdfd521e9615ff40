"""CUDA memory snapshots as `zdiag analyze` input: recognition, breakdown, peak replay, findings.

Snapshots come from tests/support/snapshots.py (torch's format, real harness stacks, a small
caching allocator) or are written by hand where exact numbers are checked.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT
from support.snapshots import generate_snapshot, write_snapshot
from zdiag.analyzers.detectors import run_context
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.inputs.cuda_snapshot import is_snapshot_file
from zdiag.analyzers.memory.snapshot_breakdown import analyze_snapshot
from zdiag.analyzers.report import decode_report, encode_report
from zdiag.cli import main

REPO = REPO_ROOT
MIB = 1024**2
USER = {"filename": "/home/me/train.py", "line": 10, "name": "forward"}
CALL = {
    "filename": "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py",
    "line": 1,
    "name": "_call_impl",
}
OPTIM = {"filename": "/x/site-packages/torch/optim/adamw.py", "line": 5, "name": "_init_group"}


def _frames(*fs: dict[str, Any]) -> list[dict[str, Any]]:
    return list(fs)


def _hand_snapshot() -> dict[str, Any]:
    """Exact numbers: P (10 MiB) alive throughout from before the history; Q (20 MiB) from
    before the history, freed in it; A (100 MiB, activation) and B (50 MiB, optimizer state)
    allocated, then A freed and C (30 MiB, activation) allocated. Peak after B: P+Q+A+B."""
    act = _frames(USER, CALL)
    opt = _frames(OPTIM, USER)
    events = [
        {"action": "alloc", "addr": 1000, "size": 100 * MIB, "time_us": 1_000, "frames": act},
        {"action": "alloc", "addr": 2000, "size": 50 * MIB, "time_us": 2_000, "frames": opt},
        {"action": "free_requested", "addr": 1000, "size": 100 * MIB, "time_us": 3_000},
        {"action": "free_completed", "addr": 1000, "size": 100 * MIB, "time_us": 3_000},
        {"action": "free_completed", "addr": 5000, "size": 20 * MIB, "time_us": 4_000},
        {"action": "segment_free", "addr": 7000, "size": 100 * MIB, "time_us": 4_500},
        {"action": "alloc", "addr": 3000, "size": 30 * MIB, "time_us": 5_000, "frames": act},
        "junk entry",
        {"action": "snapshot", "time_us": 6_000},
    ]
    blocks = [
        {"address": 900, "size": 10 * MIB, "state": "active_allocated", "frames": []},
        {"address": 2000, "size": 50 * MIB, "state": "active_allocated", "frames": opt},
        {"address": 3000, "size": 30 * MIB, "state": "active_allocated", "frames": act},
        {"address": 4000, "size": 6 * MIB, "state": "inactive"},
        {"address": 4100, "size": 4 * MIB, "state": "active_pending_free", "frames": act},
    ]
    return {
        "segments": [{"device": 0, "address": 900, "total_size": 100 * MIB, "blocks": blocks}],
        "device_traces": [events],
    }


def test_peak_is_replayed_from_the_allocator_history_with_what_was_live_then() -> None:
    b, timeline = analyze_snapshot(_hand_snapshot(), rank=0)
    assert b.allocated_bytes == 90 * MIB and b.reserved_bytes == 100 * MIB
    assert b.category_bytes == {
        "PREEXISTING": 10 * MIB,
        "OPTIMIZER_STATE": 50 * MIB,
        "ACTIVATION": 30 * MIB,
    }
    assert b.peak_bytes == 180 * MIB and b.peak_at == "replayed"
    assert b.peak_category_bytes == {
        "PREEXISTING": 30 * MIB,
        "ACTIVATION": 100 * MIB,
        "OPTIMIZER_STATE": 50 * MIB,
    }
    assert b.peak_time_ms == 1.0
    assert b.peak_reserved_bytes == 200 * MIB  # a 100 MiB segment was released after the peak
    assert b.pending_free_bytes == 4 * MIB
    assert b.fragmented_bytes == 6 * MIB and b.largest_free_block_bytes == 6 * MIB
    assert b.top_sites[0].site == "me/train.py:10 in forward" and b.top_sites[0].bytes == 150 * MIB
    assert timeline is not None
    assert timeline.peak_bytes == 180 * MIB
    assert timeline.peak_category_bytes == b.peak_category_bytes
    assert timeline.times_ms[0] == 0.0


def test_older_torch_layouts_are_read_history_frames_free_action_no_times() -> None:
    snap = _hand_snapshot()
    for seg in snap["segments"]:
        for block in seg["blocks"]:
            frames = block.pop("frames", [])
            block["history"] = [{"addr": block["address"], "real_size": 1, "frames": frames}]
    for e in snap["device_traces"][0]:
        if isinstance(e, dict):
            e.pop("time_us", None)
            if e.get("action") == "free_completed":
                e["action"] = "free"
    snap["device_traces"][0] = [
        e
        for e in snap["device_traces"][0]
        if not (isinstance(e, dict) and e.get("action") == "free_requested")
    ]
    b, timeline = analyze_snapshot(snap, rank=0)
    assert b.category_bytes["OPTIMIZER_STATE"] == 50 * MIB
    assert b.peak_bytes == 180 * MIB and b.peak_time_ms is None
    assert timeline is not None and timeline.source == "snapshot (event order)"


def test_generated_snapshot_peak_from_events_equals_peak_from_live_blocks() -> None:
    snap = generate_snapshot(layers=6, steps=2, scale=8)
    b, timeline = analyze_snapshot(snap, rank=0)
    assert timeline is not None
    # Two computations: the cumulative per-category deltas, and the set of blocks live at the
    # peak event (allocs not yet freed + blocks from before the window).
    assert timeline.peak_bytes == b.peak_bytes
    assert timeline.peak_category_bytes == b.peak_category_bytes
    assert b.peak_category_bytes["ACTIVATION"] > b.peak_category_bytes.get("OPTIMIZER_STATE", 0)
    assert b.blocks_with_stacks > 0 and b.allocated_bytes is not None
    assert b.reserved_bytes is not None and b.reserved_bytes >= b.allocated_bytes
    # the end state is what the segments hold
    live = sum(
        blk["size"]
        for seg in snap["segments"]
        for blk in seg["blocks"]
        if blk["state"] == "active_allocated"
    )
    assert b.allocated_bytes == live


def test_analyze_a_snapshot_alone_gives_a_memory_only_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_snapshot(tmp_path / "dump.bin", generate_snapshot(layers=4, stop_in_forward=3))
    assert is_snapshot_file(path)
    assert main(["analyze", str(path), "--json"]) == 0
    report = decode_report(capsys.readouterr().out)
    assert report.ranks == [] and len(report.memory_breakdowns) == 1
    b = report.memory_breakdowns[0]
    assert b.oom and b.oom_request_bytes
    assert report.memory and report.memory[0].source == "snapshot"
    assert str(path) in report.inputs
    assert main(["analyze", str(path)]) == 0
    text = capsys.readouterr().out
    assert "Memory" in text and "activation checkpointing per block" in text


def test_folder_of_rank_snapshots_and_imbalance(tmp_path: Path) -> None:
    write_snapshot(tmp_path / "rank-0.pickle", generate_snapshot(layers=4, scale=4))
    write_snapshot(tmp_path / "rank-1.pickle", generate_snapshot(layers=4, scale=4))
    write_snapshot(
        tmp_path / "rank-2.pickle", generate_snapshot(layers=4, scale=4, activation_scale=2.0)
    )
    (tmp_path / "notes.txt").write_text("not a snapshot")
    report = analyze_paths([tmp_path])
    assert [b.rank for b in report.memory_breakdowns] == [0, 1, 2]
    found = {f.id: f for f in report.findings}
    imb = found["memory-imbalance"]
    assert imb.ranks == [2] and imb.evidence["largest_difference_category"] == "ACTIVATION"
    peaks = [b.peak_bytes or 0 for b in report.memory_breakdowns]
    assert imb.expected_gain_bytes == peaks[2] - sorted(peaks)[1]


def test_balanced_ranks_raise_no_imbalance(tmp_path: Path) -> None:
    for r in range(3):
        write_snapshot(tmp_path / f"rank-{r}.pickle", generate_snapshot(layers=4, scale=4))
    assert "memory-imbalance" not in {f.id for f in analyze_paths([tmp_path]).findings}


def test_snapshot_beside_a_trace_in_a_run_directory(tmp_path: Path) -> None:

    samples = sorted((REPO_ROOT / "sample_traces").glob("*/manifest.json"))
    if not samples:
        pytest.skip("no sample run directory")
    import shutil

    run = tmp_path / "run"
    shutil.copytree(samples[0].parent, run)
    manifest = json.loads((run / "manifest.json").read_text())
    rank = manifest["ranks"][0]["rank"]
    (run / "memory").mkdir(exist_ok=True)
    write_snapshot(run / "memory" / f"rank-{rank}.snapshot.pickle", generate_snapshot(layers=4))
    report = analyze_paths([run])
    sources = {b.rank: b.source for b in report.memory_breakdowns}
    assert report.ranks and sources[rank] == "snapshot"  # the snapshot wins over Kineto events
    assert all(src == "kineto memory events" for r, src in sources.items() if r != rank)


def test_a_pickle_that_names_a_class_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "evil.pickle"
    # a snapshot-looking dict whose payload names a class: never loaded
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [Path("/")]}, protocol=4))
    assert is_snapshot_file(path)
    # beside a trace: a warning, the trace analyzed
    trace = REPO / "sample_traces" / "none" / "traces" / "rank-0.json.gz"
    report = analyze_paths([trace, path])
    assert report.memory_breakdowns == [] and len(report.ranks) == 1
    assert any("memory snapshot skipped" in w and "refusing to load" in w for w in report.warnings)
    # the only input: bad input, one sentence and exit 2
    assert main(["analyze", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing to load pathlib" in err and str(path) in err


def test_not_a_snapshot_is_one_sentence_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "other.pickle"
    path.write_bytes(pickle.dumps([1, 2, 3]))
    assert not is_snapshot_file(path)
    assert main(["analyze", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_fragmentation_from_free_blocks_stranded_beside_live_ones() -> None:
    act = _frames(USER, CALL)
    live = {"size": 64 * MIB, "state": "active_allocated", "frames": act}
    hole = {"size": 900 * MIB, "state": "inactive"}
    empty = {
        "device": 0,
        "total_size": 2048 * MIB,
        "blocks": [{"size": 2048 * MIB, "state": "inactive"}],
    }
    snap = {
        "segments": [
            {"device": 0, "total_size": 964 * MIB, "blocks": [dict(live), dict(hole)]},
            {"device": 0, "total_size": 964 * MIB, "blocks": [dict(hole), dict(live)]},
            empty,
        ],
        "device_traces": [[{"action": "oom", "size": 800 * MIB}]],
    }
    b, _ = analyze_snapshot(snap, rank=0)
    assert b.fragmented_bytes == 1800 * MIB  # the wholly free segment is not counted
    findings = run_context(DetectorContext(ledgers={}, memory_breakdowns=[b])).findings
    frag = next(f for f in findings if f.id == "fragmentation")
    assert frag.severity == "critical"  # the 800 MiB request fits into the stranded bytes
    assert frag.expected_gain_bytes == 1800 * MIB
    # without stranded space: no finding
    snap["segments"] = [empty]
    b2, _ = analyze_snapshot(snap, rank=0)
    ids = {f.id for f in run_context(DetectorContext(ledgers={}, memory_breakdowns=[b2])).findings}
    assert "fragmentation" not in ids


def test_optimizer_state_dominant_and_unknown_world_size_stays_unknown() -> None:
    opt = _frames(OPTIM, USER)
    snap = {
        "segments": [
            {
                "device": 0,
                "total_size": 1024 * MIB,
                "blocks": [
                    {"size": 600 * MIB, "state": "active_allocated", "frames": opt},
                    {"size": 300 * MIB, "state": "active_allocated", "frames": []},
                ],
            }
        ]
    }
    b, _ = analyze_snapshot(snap, rank=0)
    sharded = next(w for w in b.what_if if w.change == "optimizer state sharded")
    assert sharded.predicted_peak_bytes is None and sharded.saved_bytes is None
    f = next(
        f
        for f in run_context(DetectorContext(ledgers={}, memory_breakdowns=[b])).findings
        if f.id == "optimizer-state-dominant"
    )
    assert f.expected_gain_bytes == 600 * MIB  # offload: the state leaves the device
    assert f.severity == "warning"  # fits already (no OOM), but the gain is 2/3 of the peak
    b8, _ = analyze_snapshot(snap, rank=0, world_size=8)
    w8 = next(w for w in b8.what_if if w.change.startswith("optimizer state sharded over 8"))
    assert w8.saved_bytes == 600 * MIB - 600 * MIB // 8
    assert "x (1 - 1/8)" in w8.arithmetic


def test_report_with_breakdowns_round_trips_through_json(tmp_path: Path) -> None:
    path = write_snapshot(tmp_path / "rank-0.pickle", generate_snapshot(layers=4))
    report = analyze_paths([path])
    again = decode_report(encode_report(report))
    assert again.memory_breakdowns == report.memory_breakdowns


def test_memory_views_in_tui_and_html(tmp_path: Path) -> None:
    import asyncio

    from zdiag.render.html import render_html
    from zdiag.tui.report_app import ReportApp

    path = write_snapshot(
        tmp_path / "rank-0.pickle", generate_snapshot(layers=4, stop_in_forward=3)
    )
    report = analyze_paths([path])

    async def drive() -> str:
        app = ReportApp(report)
        async with app.run_test(size=(120, 50)) as pilot:
            await pilot.press("y")
            await pilot.pause()
            assert app.query_one("TabbedContent").active == "memory"  # type: ignore[attr-defined]
            return str(app.query_one("#memory-text").render())

    shown = asyncio.run(drive())
    assert "peak:" in shown and "^ peak" in shown and "activation checkpointing" in shown
    html = render_html(report)
    assert 'class="memory-breakdown"' in html and "triangle-down" in html


def test_damaged_fields_never_crash_the_breakdown() -> None:
    """Wrong types anywhere (None, strings, NaN, 2**70, lists for scalars) are read as absent."""
    import copy
    import random

    base = generate_snapshot(layers=2, steps=1)
    weird: list[Any] = [None, "x", -5, 2**70, 3.5, [], {}, [None], {"a": 1}, True, float("nan")]
    rng = random.Random(0)

    def mutate(obj: Any, depth: int = 0) -> None:
        keys = (
            list(obj) if isinstance(obj, dict) else range(len(obj)) if isinstance(obj, list) else []
        )
        if not keys:
            return
        k = rng.choice(list(keys))
        if rng.random() < 0.5 or depth > 4:
            obj[k] = rng.choice(weird)
        else:
            mutate(obj[k], depth + 1)

    for _ in range(300):
        snap = copy.deepcopy(base)
        for _ in range(rng.randint(1, 6)):
            mutate(snap)
        b, _ = analyze_snapshot(snap, 0, capacity_bytes=rng.choice([None, 10**9]))
        assert b.peak_bytes is None or b.peak_bytes >= 0


def test_reshard_after_forward_prediction_equals_the_resharded_runs_peak() -> None:
    held, _ = analyze_snapshot(generate_snapshot(layers=6, reshard_after_forward=False), 0)
    resharded, _ = analyze_snapshot(generate_snapshot(layers=6, reshard_after_forward=True), 0)
    w = next(w for w in held.what_if if w.change == "reshard_after_forward=True")
    assert held.peak_bytes is not None and resharded.peak_bytes is not None
    assert held.peak_bytes > resharded.peak_bytes
    assert w.predicted_peak_bytes == resharded.peak_bytes
    # a run that already reshards is promised nothing
    again = next(w for w in resharded.what_if if w.change == "reshard_after_forward=True")
    assert again.saved_bytes == 0


def test_generator_reaches_a_target_size_with_shared_frames() -> None:
    from support.snapshots import snapshot_of_size

    snap = snapshot_of_size(2 * MIB, layers=4, scale=1.0)
    size = len(pickle.dumps(snap))
    assert 1.5 * MIB < size < 2.5 * MIB
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["frames"]]
    # as torch writes them: a new list per stack, over frame dicts shared between stacks
    assert allocs[0]["frames"] is not allocs[1]["frames"]
    shared = {id(f) for e in allocs for f in e["frames"]}
    assert len(shared) < sum(len(e["frames"]) for e in allocs) / 10
    assert all(seg["total_size"] % (2 * MIB) == 0 for seg in snap["segments"])


def test_site_is_the_innermost_python_frame_of_the_user_then_a_library() -> None:
    """Issue 30: a snapshot recorded with C frames named CPython's files as the site."""
    from zdiag.analyzers.memory.stack_categorizer import Categorizer

    def frame(filename: str, name: str, line: int) -> dict[str, object]:
        return {"filename": filename, "name": name, "line": line}

    native = [
        frame("Objects/methodobject.c", "cfunction_call", 537),
        frame("??", "at::native::empty_cuda", 0),
        frame("/usr/lib/python3.12/site-packages/torch/nn/functional.py", "linear", 2100),
    ]
    library = frame(
        "/venv/lib/python3.12/site-packages/transformers/masking_utils.py",
        "find_packed_sequence_indices",
        712,
    )
    torch_module = frame("/venv/site-packages/torch/nn/modules/module.py", "_call_impl", 1784)
    user = frame("/home/me/train.py", "forward", 41)
    cat = Categorizer()
    assert cat.site([*native, library, torch_module, user]) == "me/train.py:41 in forward"
    assert cat.site([*native, library, torch_module]) == (
        "transformers/masking_utils.py:712 in find_packed_sequence_indices"
    )
    assert cat.site([*native, torch_module]) == "nn/functional.py:2100 in linear"
    assert cat.site(native[:2]) == "Objects/methodobject.c:537 in cfunction_call"
    # a stack with no Python frame (the autograd engine's thread, stacks="all" on an H100):
    # the autograd node, else the aten op, never the allocator's own frames
    engine = [
        frame("??", "torch::unwind::unwind()", 0),
        frame("CUDACachingAllocator.cpp", "c10::cuda::CUDACachingAllocator::malloc()", 0),
        frame("??", "at::_ops::div_Tensor::call(at::Tensor const&, at::Tensor const&)", 0),
        frame("??", "torch::autograd::generated::MeanBackward0::apply(std::vector<>&&)", 0),
        frame("??", "torch::autograd::Engine::thread_main()", 0),
    ]
    assert cat.site(engine) == "MeanBackward0 (autograd, no Python frame)"
    assert cat.site([*engine[:3], engine[4]]) == "aten::div_Tensor (no Python frame)"
