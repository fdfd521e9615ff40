"""Issue 24: CUDA memory snapshots that are small but cost a lot, and damaged numbers in them.

Each reported failure is reproduced here on a pickle written opcode by opcode (pickle's memo
lets a few bytes reference one object millions of times) or on a hand-built snapshot:

1. one frame dict repeated by reference (DUP) in a stack: 1.2 GB and 29 s from 8 MiB before;
   now a stack is read up to MAX_STACK_FRAMES frames (a warning says so);
2. the bounds on items, memory and time: each fires, as a warning naming the file;
3. sizes of 10**100, NaN, infinities, negative sizes, alloc/free mismatches: a warning and a
   fallback the report says, never an internal error.
"""

from __future__ import annotations

import copy
import gc
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import fuzz_inputs as fz
import pytest

from conftest import REPO_ROOT
from support.snapshots import generate_snapshot
from zdiag.analyzers.inputs import plain_pickle as pp
from zdiag.analyzers.inputs.cuda_snapshot import MAX_DEVICE_BYTES, MAX_STACK_FRAMES, read_snapshot
from zdiag.analyzers.inputs.plain_pickle import PickleTimeError, PlainUnpickler, memory_budget
from zdiag.analyzers.inputs.safe_read import use_limits
from zdiag.analyzers.memory import stack_categorizer as sc
from zdiag.analyzers.memory.memory_snapshot import summarize_snapshot
from zdiag.analyzers.memory.snapshot_breakdown import analyze_snapshot
from zdiag.analyzers.memory.snapshot_input import load_breakdowns
from zdiag.analyzers.memory.snapshot_replay import Damage, device_states
from zdiag.analyzers.memory.stack_categorizer import (
    MAX_LABEL_CHARS,
    MAX_MODULE_DEPTH,
    Categorizer,
)
from zdiag.analyzers.report import MemoryTimeline
from zdiag.errors import InputError
from zdiag.render.memory_view import stacked_bar, timeline_lines

REPO = REPO_ROOT
MIB = 1024**2
USER = {"filename": "/home/me/train.py", "line": 10, "name": "forward"}
CALL = {"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}
OPTIM = {"filename": "/x/site-packages/torch/optim/adamw.py", "line": 5, "name": "_init_group"}


def _op(value: Any) -> bytes:
    """The opcodes that push `value` (a pickle protocol 4 body, no PROTO, no STOP)."""
    return pickle.dumps(value, protocol=4)[2:-1]


def dup_frames_snapshot(refs: int, *, in_history: bool = False) -> bytes:
    """A snapshot whose one stack is `refs` references to one frame dict (DUP opcodes: one
    byte each), in a live block or (`in_history`) in an alloc event of the history."""
    frame = _op({"filename": "/home/me/model.py", "line": 7, "name": "forward"})
    frames = b"(" + frame + b"2" * (refs - 1) + b"l"
    if in_history:
        event = b"}(" + _op("action") + _op("alloc") + _op("addr") + _op(0)
        event += _op("size") + _op(512) + _op("frames") + frames + b"u"
        blocks, traces = b"(l", b"((" + event + b"ll"
    else:
        block = b"}(" + _op("size") + _op(512) + _op("state") + _op("active_allocated")
        block += _op("frames") + frames + b"u"
        blocks, traces = b"(" + block + b"l", b"((ll"
    seg = b"}(" + _op("device") + _op(0) + _op("total_size") + _op(512) + _op("blocks")
    seg += blocks + b"u"
    doc = b"}(" + _op("segments") + b"(" + seg + b"l" + _op("device_traces") + traces + b"u"
    return b"\x80\x04" + doc + b"."


def tuple_hash_bomb(levels: int) -> bytes:
    """A ~250-byte snapshot-looking pickle with a dict key that is a tuple holding the previous
    tuple twice, `levels` deep: hashing it visits 2**levels items, inside the C unpickler."""
    ops = bytearray(b"\x80\x04N\x94")  # memo 0 = None
    for i in range(levels):  # memo i+1 = (memo i, memo i)
        ops += b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94"
    ops += b"}(" + _op("segments") + b"]" + b"h" + bytes([levels]) + b"Nu."
    return bytes(ops)


def hand_snapshot() -> dict[str, Any]:
    """Exact numbers (as in test_snapshot_analysis.py): peak 180 MiB after B is allocated."""
    act, opt = [USER, CALL], [OPTIM, USER]
    events: list[Any] = [
        {"action": "alloc", "addr": 1000, "size": 100 * MIB, "time_us": 1_000, "frames": act},
        {"action": "alloc", "addr": 2000, "size": 50 * MIB, "time_us": 2_000, "frames": opt},
        {"action": "free_completed", "addr": 1000, "size": 100 * MIB, "time_us": 3_000},
        {"action": "free_completed", "addr": 5000, "size": 20 * MIB, "time_us": 4_000},
        {"action": "alloc", "addr": 3000, "size": 30 * MIB, "time_us": 5_000, "frames": act},
    ]
    blocks = [
        {"address": 900, "size": 10 * MIB, "state": "active_allocated", "frames": []},
        {"address": 2000, "size": 50 * MIB, "state": "active_allocated", "frames": opt},
        {"address": 3000, "size": 30 * MIB, "state": "active_allocated", "frames": act},
        {"address": 4000, "size": 10 * MIB, "state": "inactive"},
    ]
    return {
        "segments": [{"device": 0, "address": 900, "total_size": 100 * MIB, "blocks": blocks}],
        "device_traces": [events],
    }


def analyze_json(tmp_path: Path, path: Path) -> dict[str, Any]:
    """`zdiag analyze --json` of `path`: exit 0, no internal error, the report."""
    out = tmp_path / "report.json"
    rc, stderr, _ = fz.run_zdiag(["analyze", "-q", "--json", "-o", str(out), str(path)])
    assert fz.verdict(rc, stderr) is None, stderr
    assert rc == 0, stderr
    rc, stderr, _ = fz.run_zdiag(["analyze", "-q", str(path)])  # and the text report
    assert fz.verdict(rc, stderr) is None and rc == 0, stderr
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def write(tmp_path: Path, doc: Any, name: str = "rank-0.pickle") -> Path:
    path = tmp_path / name
    path.write_bytes(doc if isinstance(doc, bytes) else pickle.dumps(doc, protocol=4))
    return path


needs_fork = pytest.mark.skipif(
    not pp.fork_available(), reason="the time bound on a snapshot needs a forked child"
)


# --- 1. one frame referenced millions of times ----------------------------------------------


def test_a_stack_of_one_frame_repeated_is_read_up_to_the_frame_cap() -> None:
    data = pickle.loads(dup_frames_snapshot(1_000_000))
    stack = data["segments"][0]["blocks"][0]["frames"]
    assert len(stack) == 1_000_000 and all(f is stack[0] for f in stack[:10])
    cat = Categorizer()
    category, site, module = cat.describe(stack)
    assert cat.items == MAX_STACK_FRAMES and cat.truncated == 1
    assert category == "UNKNOWN" and site == "me/model.py:7 in forward"
    # the chain of forward calls stops at MAX_MODULE_DEPTH (it was 1M entries, 11 MB)
    assert module.count(" > ") == MAX_MODULE_DEPTH and module.endswith(" > ...")


@pytest.mark.parametrize("in_history", [False, True], ids=["live-block", "history"])
def test_a_dup_frame_bomb_is_analyzed_with_a_warning(tmp_path: Path, in_history: bool) -> None:
    path = write(tmp_path, dup_frames_snapshot(2_000_000, in_history=in_history))
    report = analyze_json(tmp_path, path)
    warnings = "\n".join(report["warnings"])
    assert f"more than {MAX_STACK_FRAMES} frames" in warnings and str(path) in warnings
    for b in report["memory_breakdowns"]:
        for name in [*b["peak_activation_by_module"], *(s["site"] for s in b["top_sites"])]:
            assert len(name) < 2000


def test_the_summary_reader_copies_a_repeated_frame_once(tmp_path: Path) -> None:
    path = write(tmp_path, dup_frames_snapshot(1_000_000))
    data = read_snapshot(path)
    frames = data["segments"][0]["blocks"][0]["frames"]
    assert len(frames) == MAX_STACK_FRAMES and all(f is frames[0] for f in frames)
    assert summarize_snapshot(data).in_use_bytes == 512


# --- 2. the bounds: items, memory, time -----------------------------------------------------


def test_the_item_cap_skips_a_snapshot_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snap = generate_snapshot(layers=2, steps=1)
    events = len(snap["device_traces"][0])
    monkeypatch.setattr(sc, "MAX_SNAPSHOT_ITEMS", events // 2)
    with pytest.raises(InputError, match="more than"):
        analyze_snapshot(snap, 0)
    path = write(tmp_path, snap)
    result = load_breakdowns({0: path})
    assert not result.breakdowns
    (warning,) = result.warnings
    assert warning.startswith(f"memory snapshot skipped: {path}: ") and "events" in warning


def test_memory_budget_is_per_byte_with_a_fixed_cap() -> None:
    small = memory_budget(10 * MIB)
    assert small == pp.PICKLE_MEMORY_BASE_BYTES + pp.PICKLE_MEMORY_PER_BYTE * 10 * MIB
    huge = memory_budget(100 << 30)
    assert huge <= pp.PICKLE_MEMORY_MAX_BYTES
    assert huge < pp.PICKLE_MEMORY_PER_BYTE * (100 << 30)
    with use_limits(max_bytes=200 << 30):  # the user vouches for the input: per byte only
        assert memory_budget(100 << 30) == (
            pp.PICKLE_MEMORY_BASE_BYTES + pp.PICKLE_MEMORY_PER_BYTE * (100 << 30)
        )


@pytest.mark.slow  # starts a program
@pytest.mark.skipif(sys.platform != "linux", reason="the memory budget is an RLIMIT_AS (Linux)")
def test_a_load_beyond_the_memory_budget_is_refused(tmp_path: Path) -> None:
    """In a fresh interpreter: the budget limits address-space growth, and a process that has
    run other tests may hold freed heap the load could reuse without growing."""
    path = tmp_path / "dup.pickle"
    path.write_bytes(dup_frames_snapshot(4 * MIB))  # a 32 MiB list from a 4 MiB pickle
    code = f"""
        import io
        from zdiag.analyzers.inputs import plain_pickle as pp
        pp.PICKLE_MEMORY_BASE_BYTES = 8 * 2**20
        pp.PICKLE_MEMORY_PER_BYTE = 1
        try:
            pp.PlainUnpickler(io.BytesIO(open({str(path)!r}, "rb").read())).load()
            print("loaded")
        except pp.PickleMemoryError as exc:
            print("refused:", exc)
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.stdout.startswith("refused:") and "more memory" in proc.stdout, proc


def test_an_in_process_load_stops_at_its_deadline() -> None:
    data = pickle.dumps(generate_snapshot(layers=2, steps=1), protocol=4)
    with pytest.raises(PickleTimeError, match="longer than 0 s"):
        PlainUnpickler(io.BytesIO(data), seconds=0.0).load()
    # the flight-recorder reader's call: no keyword, default deadline, same result
    assert PlainUnpickler(io.BytesIO(data)).load() == pickle.loads(data)


@needs_fork
def test_a_tuple_hash_bomb_is_stopped_at_the_time_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 300-byte pickle whose dict key hashes 2**45 items (days): killed after the bound."""
    path = write(tmp_path, tuple_hash_bomb(45))
    monkeypatch.setattr(pp, "MAX_SNAPSHOT_SECONDS", 1.0)
    # the only input and unreadable: one sentence and exit 2 (beside a trace: a warning); the
    # message says the time bound stopped it (without the bound it would run for days)
    rc, stderr, _ = fz.run_zdiag(["analyze", "-q", str(path)])
    assert fz.verdict(rc, stderr) is None and rc == 2, stderr
    assert "longer than the 1 s" in stderr and str(path) in stderr


@needs_fork
def test_the_summary_reader_is_time_bounded_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, tuple_hash_bomb(45))
    monkeypatch.setattr(pp, "MAX_SNAPSHOT_SECONDS", 1.0)
    with pytest.raises(InputError, match="longer than the 1 s"):
        read_snapshot(path)


def test_segments_sharing_one_blocks_list_are_read_once(tmp_path: Path) -> None:
    block = {"size": 512, "state": "active_allocated", "frames": [USER, CALL]}
    blocks = [block] * 2000
    segs = [{"device": 0, "total_size": 1 << 20, "blocks": blocks} for _ in range(20_000)]
    cat = Categorizer()
    devices = device_states({"segments": segs}, cat, Damage())
    assert devices[0].blocks == 1 and devices[0].segments == 20_000
    assert cat.items < 30_000  # not 40M: the shared list is walked once


# --- 3. damaged numbers and histories that do not add up -------------------------------------


def _event(snap: dict[str, Any], i: int) -> dict[str, Any]:
    return snap["device_traces"][0][i]  # type: ignore[no-any-return]


def _set_event(i: int, key: str, value: Any) -> Any:
    return lambda s: _event(s, i).__setitem__(key, value)


def _set_block(i: int, key: str, value: Any) -> Any:
    return lambda s: s["segments"][0]["blocks"][i].__setitem__(key, value)


def _insert(i: int, event: dict[str, Any]) -> Any:
    return lambda s: s["device_traces"][0].insert(i, event)


def _reverse(s: dict[str, Any]) -> None:
    s["device_traces"][0].reverse()


def _overflow(s: dict[str, Any]) -> None:  # each size < 2**62, their sum beyond int64
    s["device_traces"][0] = [
        {"action": "alloc", "addr": i, "size": 2**62 - 1, "time_us": i} for i in range(8)
    ]


def _huge_frees(s: dict[str, Any]) -> None:  # frees of 1 PiB of blocks never allocated
    s["device_traces"][0] += [
        {"action": "free_completed", "addr": 10**6 + i, "size": 2**49, "time_us": 9_000 + i}
        for i in range(4)
    ]


VALUES = "not numbers in range"
DAMAGED: dict[str, tuple[Any, str]] = {
    "size 10**100": (_set_block(1, "size", 10**100), VALUES),
    "size nan": (_set_event(1, "size", float("nan")), VALUES),
    "size inf": (_set_event(0, "size", float("inf")), VALUES),
    "size -inf": (_set_block(0, "size", float("-inf")), VALUES),
    "negative size": (_set_event(4, "size", -30 * MIB), VALUES),
    "negative total_size": (lambda s: s["segments"][0].__setitem__("total_size", -1), VALUES),
    "address nan": (_set_event(0, "addr", float("nan")), VALUES),
    "device 10**100": (lambda s: s["segments"][0].__setitem__("device", 10**100), VALUES),
    "oom size nan": (_insert(5, {"action": "oom", "size": float("nan")}), VALUES),
    "sum beyond int64": (_overflow, VALUES),
    "alloc missing from the end state": (
        _insert(4, {"action": "alloc", "addr": 8888, "size": 500 * MIB, "time_us": 4500}),
        "blocks hold 513,802,240 bytes less than its events leave allocated",
    ),
    "double free": (
        _insert(3, {"action": "free_completed", "addr": 1000, "size": 100 * MIB, "time_us": 3000}),
        "freed a block already freed",
    ),
    "free of another size": (_set_event(2, "size", 7), "another size than their allocation"),
    "alloc over a live block": (
        _insert(1, {"action": "alloc", "addr": 1000, "size": MIB, "time_us": 1500}),
        "reused the address of a block still live",
    ),
    "entries out of order": (_reverse, "timed before the event preceding them"),
    "frees beyond any device": (_huge_frees, "more than any device holds"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_numbers_are_a_warning_never_an_internal_error(tmp_path: Path, case: str) -> None:
    mutate, expected = DAMAGED[case]
    snap = hand_snapshot()
    mutate(snap)
    warnings: list[str] = []
    b, timeline = analyze_snapshot(copy.deepcopy(snap), 0, warnings=warnings)
    assert any(expected in w for w in warnings), warnings
    assert b.peak_bytes is not None and 0 <= b.peak_bytes <= MAX_DEVICE_BYTES
    if timeline is not None:
        assert all(0 <= v for series in timeline.bytes_by_category.values() for v in series)
        assert timeline.times_ms == sorted(timeline.times_ms)
    report = analyze_json(tmp_path, write(tmp_path, snap))
    (said,) = [w for w in report["warnings"] if expected in w]
    assert said.startswith(str(tmp_path / "rank-0.pickle"))


def test_the_hand_snapshot_itself_has_no_warning() -> None:
    warnings: list[str] = []
    b, _ = analyze_snapshot(hand_snapshot(), 0, warnings=warnings)
    assert warnings == [] and b.peak_bytes == 180 * MIB


def test_a_free_of_a_block_never_allocated_is_one_from_before_the_history() -> None:
    """The ring buffer drops the oldest events: a free without its alloc is a block allocated
    before the window, counted in the bytes at its start (no warning: nothing is damaged)."""
    snap = hand_snapshot()
    _insert(0, {"action": "free_completed", "addr": 77, "size": 99 * MIB, "time_us": 1})(snap)
    warnings: list[str] = []
    b, timeline = analyze_snapshot(snap, 0, warnings=warnings)
    assert warnings == [] and b.peak_bytes == 180 * MIB and timeline is not None
    # 129 MiB at the start (P, Q and the block freed first), 30 MiB after its free
    assert timeline.bytes_by_category["PREEXISTING"][0] == 30 * MIB


@pytest.mark.parametrize("cpp_frames", [0, 16])
def test_generated_snapshots_raise_no_damage_warning(cpp_frames: int) -> None:
    warnings: list[str] = []
    b, timeline = analyze_snapshot(
        generate_snapshot(layers=4, steps=2, cpp_frames=cpp_frames), 0, warnings=warnings
    )
    assert warnings == [] and b.peak_at == "replayed" and timeline is not None


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("size", 10**100, "more than any device holds"),
        ("size", -5, "negative"),
        ("size", float("nan"), "float"),
        ("size", float("inf"), "float"),
    ],
)
def test_the_summary_reader_refuses_impossible_sizes_in_one_sentence(
    tmp_path: Path, field: str, value: Any, said: str
) -> None:
    snap = hand_snapshot()
    snap["segments"][0]["blocks"][1][field] = value
    with pytest.raises(InputError, match=said) as err:
        read_snapshot(write(tmp_path, snap))
    assert "\n" not in err.value.message and "re-create it" in err.value.message


def test_the_summary_reader_refuses_device_totals_beyond_any_device(tmp_path: Path) -> None:
    snap = hand_snapshot()
    for b in snap["segments"][0]["blocks"]:
        b["size"] = MAX_DEVICE_BYTES
    with pytest.raises(InputError, match="more than any device holds"):
        read_snapshot(write(tmp_path, snap))


# --- hostile shapes beyond the reports ------------------------------------------------------


def _deep_list(depth: int) -> bytes:
    return b"]" * depth + b"a" * (depth - 1)


def test_a_frame_field_nested_100k_deep_is_read_as_absent(tmp_path: Path) -> None:
    deep = _deep_list(100_000)
    frame = b"}(" + _op("filename") + deep + _op("name") + deep + _op("line") + deep + b"u"
    block = b"}(" + _op("size") + _op(4096) + _op("state") + _op("active_allocated")
    block += _op("frames") + b"(" + frame + b"l" + b"u"
    seg = b"}(" + _op("device") + _op(0) + _op("total_size") + _op(4096) + _op("blocks")
    seg += b"(" + block + b"lu"
    path = write(tmp_path, b"\x80\x04}(" + _op("segments") + b"(" + seg + b"lu.")
    report = analyze_json(tmp_path, path)
    (b,) = report["memory_breakdowns"]
    assert b["allocated_bytes"] == 4096 and b["category_bytes"] == {"UNKNOWN": 4096}
    assert summarize_snapshot(read_snapshot(path)).category_bytes == {"UNKNOWN": 4096}


@pytest.mark.skipif(not pp.fork_available(), reason="the isolated reader forks only on Linux")
def test_the_isolated_reader_keeps_the_inherited_heap_out_of_its_collector(tmp_path: Path) -> None:
    """The test above once died of a segfault in a pytest worker's child, garbage-collecting
    during the load: a collection there walked the whole heap the worker had built. The child
    freezes what it inherited first, so its collections walk only what it makes."""
    path = tmp_path / "any.pickle"
    path.write_bytes(b"")
    assert pp.run_isolated(gc.get_freeze_count, path=path, what="test") > 0


def test_giant_strings_in_frames_make_short_labels(tmp_path: Path) -> None:
    long_name = "/home/me/" + "d" * 5_000_000 + "/model.py"
    frames = [{"filename": long_name, "line": 3, "name": "f" * 1_000_000}] * 50
    snap = hand_snapshot()
    snap["segments"][0]["blocks"][0]["frames"] = frames  # P: live at the peak
    b, _ = analyze_snapshot(snap, 0)
    (site,) = [s.site for s in b.top_sites if "model.py" in s.site]
    assert site.startswith("...ddd") and "d/model.py:3 in ...fff" in site
    assert len(site) <= 2 * MAX_LABEL_CHARS + 20


@pytest.mark.parametrize(
    "frame",
    [
        {"filename": 5, "name": [1], "line": "x"},
        {"filename": None, "name": None, "line": 10**100},
        {"filename": {"a": 1}, "name": b"bytes", "line": float("nan")},
        "not a dict",
    ],
    ids=["int-list-str", "none-huge-line", "dict-bytes-nan", "string"],
)
def test_frames_of_the_wrong_types_are_read_as_absent(tmp_path: Path, frame: Any) -> None:
    snap = hand_snapshot()
    for e in snap["device_traces"][0]:
        if e.get("frames"):
            e["frames"] = [frame, *e["frames"]]
    snap["segments"][0]["blocks"][2]["frames"] = [frame]
    report = analyze_json(tmp_path, write(tmp_path, snap))
    (b,) = report["memory_breakdowns"]
    assert b["peak_bytes"] == 180 * MIB


def test_the_sparkline_and_bar_draw_damaged_series() -> None:
    tl = MemoryTimeline(
        rank=0,
        source="snapshot",
        times_ms=[0.0, 1.0, 2.0, 3.0],
        bytes_by_category={"ACTIVATION": [-(2**62), 5, 2**62, -1], "UNKNOWN": [2**62, 0, 1, 1]},
        capacity_bytes=None,
    )
    spark, marker = timeline_lines(tl)
    assert len(spark) == len("    |") + 4 + len("|  top = peak")
    assert "^ peak" in marker
    bar = stacked_bar({"ACTIVATION": 10**30, "GRADIENT": 5}, 10, width=20)[0]
    assert len(bar) == len("    [") + 20 + 1


@needs_fork
def test_a_reader_killed_or_failing_is_a_sentence_or_a_reported_bug(tmp_path: Path) -> None:
    path = write(tmp_path, hand_snapshot())

    def killed() -> None:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would

    def buggy() -> None:
        raise KeyError("a bug, not the input's fault")

    with pytest.raises(InputError, match=r"stopped without a result \(signal 9\)"):
        pp.run_isolated(killed, path=path, what="CUDA memory snapshot")
    with pytest.raises(RuntimeError, match="KeyError"):
        pp.run_isolated(buggy, path=path, what="CUDA memory snapshot")
    assert pp.run_isolated(len, [1, 2], path=path, what="CUDA memory snapshot") == 2
