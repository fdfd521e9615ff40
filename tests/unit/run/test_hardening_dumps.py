"""Issue 24: flight-recorder dumps that are small but cost a lot. Huge `pg_config` member lists,
many dumps of a large job, absurd rank numbers in file names, and damaged entries: each is
refused in one sentence (exit 2) or read with a fallback, and the work grows linearly with what
the dumps hold (asserted by counting executed lines, not by timing)."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT
from support.flight_recorder import FakeJob, frame
from zdiag.analyzers.detectors import hang_finding
from zdiag.analyzers.inputs import flight_dump_parse, flight_dumps
from zdiag.analyzers.inputs.loader import MAX_RANK
from zdiag.analyzers.run import wait_graph
from zdiag.cli import main
from zdiag.errors import InputError

ROOT = REPO_ROOT


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_sentence(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _job(n: int, missing: int = 1) -> dict[int, dict[str, Any]]:
    """Dump dicts of an n-rank job: three all_reduces done, a fourth issued by all but
    `missing`, the default group listing every rank as torch writes it."""
    job = FakeJob(n)
    for _ in range(3):
        job.collective()
    job.collective(ranks=[r for r in range(n) if r != missing], state="scheduled")
    return {r: job.dump_dict(r) for r in range(n)}


NESTED = "@@nested@@"
"""A string that `_write` replaces by a list nested 10^5 deep (pickle cannot write one)."""


def _write(folder: Path, dumps: dict[int, dict[str, Any]], prefix: str = "fr_") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for r, d in dumps.items():
        p = folder / f"{prefix}{r}"
        data = pickle.dumps(d, protocol=2)
        placeholder = b"X" + len(NESTED).to_bytes(4, "little") + NESTED.encode()
        depth = 100_000  # EMPTY_LIST x depth, then APPEND each into the one below
        p.write_bytes(data.replace(placeholder, b"]" * depth + b"a" * (depth - 1)))
        paths.append(p)
    return paths


def _lines_run(fn: Callable[[], object]) -> int:
    """Python lines executed by `fn()` (every loop iteration counts once): a measure of work that
    does not depend on the machine's load, so scaling can be asserted without timing."""
    count = 0

    def tracer(frame_: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def _analyze_work(paths: list[Path]) -> int:
    def run() -> None:
        a = wait_graph.analyze_dumps(flight_dumps.read_dumps(paths))
        hang_finding.hang_findings(a)
        hang_finding.dump_warnings(a)

    return _lines_run(run)


# --- 1. a pg_config listing 10^6 ranks -------------------------------------------------------


def test_a_group_listing_a_million_ranks_is_refused_in_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reported input: two 8 MB dumps whose default group lists 10^6 ranks (over 60 s and
    1.2 GB before). Refused from the text's length, before a list is built."""
    dumps = _job(2, missing=-1)
    for d in dumps.values():
        d["pg_config"]["0"]["ranks"] = str(list(range(10**6)))
    _write(tmp_path, dumps)
    rc, out, err = _cli(["analyze", str(tmp_path)], capsys)
    assert rc == 2 and out == ""
    line = _one_sentence(err)
    assert "lists 1000000 ranks" in line and str(flight_dump_parse.MAX_WORLD_SIZE) in line


def test_work_grows_linearly_with_the_ranks_a_group_lists(tmp_path: Path) -> None:
    """Two dumps of a group listing N ranks (under the cap): every absent rank is a 'no dump'
    suspect, named once; doubling N at most doubles the work (it was quadratic: each culprit
    scanned every rank of every disagreement)."""
    work = {}
    for n in (3000, 6000):
        dumps = _job(2, missing=-1)
        for d in dumps.values():
            d["pg_config"]["0"]["ranks"] = str(list(range(n)))
        paths = _write(tmp_path / str(n), dumps)
        a = wait_graph.analyze_dumps(flight_dumps.read_dumps(paths))
        assert a.culprit_ranks == tuple(range(2, n))
        assert {c.reason for c in a.culprits} == {"no dump"}
        (f,) = hang_finding.hang_findings(a)
        assert f"ranks 2-{n - 1} never arrived" in f.title
        assert any(f"ranks 2-{n - 1} of the {n}" in w for w in hang_finding.dump_warnings(a))
        work[n] = _analyze_work(paths)
    assert work[6000] < 2.5 * work[3000], work


def test_the_cap_on_the_ranks_the_dumps_name_in_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups each under MAX_WORLD_SIZE whose union is over it are refused too."""
    monkeypatch.setattr(wait_graph, "MAX_WORLD_SIZE", 6)
    job = FakeJob(4)
    job.group("7", "TP", [0, 1])
    job.collective()
    dumps = {r: job.dump_dict(r) for r in range(4)}
    dumps[0]["pg_config"]["7"]["ranks"] = "[0, 10, 11, 12, 13, 14]"
    with pytest.raises(InputError, match="more than 6 ranks"):
        wait_graph.analyze_dumps(flight_dumps.read_dumps(_write(tmp_path, dumps)))


def test_many_groups_sharing_one_member_list_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pickle can reference one long member list from thousands of groups for a few bytes
    each: the memberships a dump lists in all are capped."""
    monkeypatch.setattr(flight_dump_parse, "MAX_LISTED_RANKS_PER_DUMP", 100)
    members = str(list(range(40)))
    dumps = _job(2)
    for i in range(3):  # 3 x 40 memberships, sharing one string object
        dumps[0]["pg_config"][f"g{i}"] = {"name": f"g{i}", "desc": "x", "ranks": members}
    with pytest.raises(InputError, match="MAX_LISTED_RANKS_PER_DUMP"):
        flight_dumps.read_dumps(_write(tmp_path, dumps))


# --- 2. many dumps of a large job ------------------------------------------------------------


def test_work_grows_linearly_with_the_number_of_dumps(tmp_path: Path) -> None:
    """N dumps of an N-rank job, all but one rank waiting: doubling N at most doubles the work
    (it was quadratic: each dump re-parsed the N-rank member list, each waiter scanned every
    member)."""
    work = {}
    for n in (150, 300):
        paths = _write(tmp_path / str(n), _job(n, missing=5))
        a = wait_graph.analyze_dumps(flight_dumps.read_dumps(paths))
        assert a.culprit_ranks == (5,) and len(a.waiting) == n - 1
        work[n] = _analyze_work(paths)
    assert work[300] < 2.5 * work[150], work


def test_wait_edges_grow_with_members_not_members_times_waiters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half the ranks stuck in an all-reduce the other half completed, the other half waiting
    in the next one: each waiter waits for every stuck rank. The wait graph shares one node per
    waiting point, so its edges stay linear (n/2 x n/2 edges before)."""
    sizes: dict[int, int] = {}
    real = wait_graph._terminal_components

    def spy(nodes: set[int], edges: dict[int, set[int]]) -> list[set[int]]:
        sizes[len([x for x in nodes if x >= 0])] = sum(map(len, edges.values()))
        return real(nodes, edges)

    monkeypatch.setattr(wait_graph, "_terminal_components", spy)
    for n in (100, 200):
        job = FakeJob(n)
        job.collective()
        job.collective(state={r: "completed" for r in range(n // 2, n)})  # 0..n/2-1 stuck
        job.collective(state="scheduled")
        a = wait_graph.analyze_dumps(flight_dumps.read_dumps(job.write(tmp_path / str(n))))
        assert a.culprit_ranks == tuple(range(n // 2))
        assert {c.reason for c in a.culprits} == {"stuck"}
    assert sizes[200] < 2.5 * sizes[100], sizes
    assert sizes[200] < 4 * 200, sizes


def test_member_lists_repeated_by_every_dump_are_parsed_once(tmp_path: Path) -> None:
    dumps = flight_dumps.read_dumps(_write(tmp_path, _job(8)))
    assert len({id(d.groups[0].ranks) for d in dumps}) == 1


def test_too_many_dump_files_are_refused_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flight_dumps, "MAX_WORLD_SIZE", 3)
    never_read = [tmp_path / f"absent_{r}" for r in range(4)]  # reading any would fail
    with pytest.raises(InputError, match="4 flight-recorder dumps given, more than the 3"):
        flight_dumps.read_dumps(never_read)


@pytest.mark.slow
def test_ten_thousand_dumps_of_a_ten_thousand_rank_job(tmp_path: Path) -> None:
    """The reported size, end to end in a child process with a time limit far above what it
    needs (about 4 s here, over 60 s before): catches a quadratic path coming back. The default
    group is inferred (gloo style, no pg_config) to keep the files small; the listed-group
    path is covered by the scaling tests above."""
    n = 10_000
    entries = [
        {
            "record_id": s,
            "pg_id": 0,
            "process_group": ("0", "default_pg"),
            "collective_seq_id": s + 1,
            "p2p_seq_id": 0,
            "op_id": s + 1,
            "profiling_name": "nccl:all_reduce",
            "input_sizes": [[1024]],
            "output_sizes": [[1024]],
            "input_dtypes": ["Float"],
            "output_dtypes": ["Float"],
            "state": "completed" if s < 3 else "scheduled",
            "retired": s < 3,
            "is_p2p": False,
        }
        for s in range(4)
    ]
    full = pickle.dumps({"version": "2.9", "pg_config": {}, "entries": entries}, protocol=2)
    behind = pickle.dumps({"version": "2.9", "pg_config": {}, "entries": entries[:3]}, protocol=2)
    for r in range(n):
        (tmp_path / f"nccl_trace_rank_{r}").write_bytes(behind if r == 5 else full)
    proc = subprocess.run(
        [sys.executable, "-m", "zdiag", "analyze", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (hang,) = json.loads(proc.stdout)["findings"]
    assert hang["ranks"] == [5] and len(hang["evidence"]["waiting_ranks"]) == n - 1


# --- 3. absurd rank numbers in file names ----------------------------------------------------


@pytest.mark.parametrize(
    "suffix",
    ["99999999999999999999", "-3", str(2**62), str(MAX_RANK + 1), "9" * 5000, "-0"],
)
def test_absurd_rank_in_a_file_name_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    dumps = _job(2)
    _write(tmp_path, dumps, prefix="nccl_trace_rank_")
    (tmp_path / f"nccl_trace_rank_{suffix}"[:255]).write_bytes(pickle.dumps(dumps[0], protocol=2))
    rc, out, err = _cli(["analyze", str(tmp_path)], capsys)
    assert rc == 2 and out == ""
    assert f"outside 0..{MAX_RANK}" in _one_sentence(err)


def test_absurd_rank_on_an_empty_sibling_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty file named like the dumps is read as a frozen rank's: its number is checked."""
    _write(tmp_path, _job(2), prefix="nccl_trace_rank_")
    (tmp_path / f"nccl_trace_rank_{2**62}").write_bytes(b"")
    rc, _, err = _cli(["analyze", str(tmp_path)], capsys)
    assert rc == 2 and "outside" in _one_sentence(err)


def test_the_largest_rank_is_read(tmp_path: Path) -> None:
    p = tmp_path / f"fr_{MAX_RANK}"
    dump = _job(2)[0]
    dump["pg_config"]["0"]["ranks"] = f"[0, {MAX_RANK}]"
    p.write_bytes(pickle.dumps(dump, protocol=2))
    assert flight_dumps.read_dump(p).rank == MAX_RANK


# --- hostile dumps ---------------------------------------------------------------------------


def _set_entry(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        for e in d["entries"]:
            e[field] = value

    return edit


def _set_ranks(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        d["pg_config"]["0"]["ranks"] = value

    return edit


_SHARED_FRAME = frame("train_step", "/work/train.py", 10)
_BIG = list(range(2000))

# (name, edit of rank 0's dump, expected exit status, text in the one sentence when 2)
HOSTILE: list[tuple[str, Callable[[dict[str, Any]], None], int, str]] = [
    ("seq NaN", _set_entry("collective_seq_id", math.nan), 0, ""),
    ("seq huge", _set_entry("collective_seq_id", 10**40), 0, ""),
    ("seq negative", _set_entry("collective_seq_id", -7), 0, ""),
    ("seq digits beyond int()", _set_entry("collective_seq_id", "9" * 5000), 0, ""),
    ("seq non-ascii digits", _set_entry("collective_seq_id", "\u0661\u0662"), 0, ""),
    ("record_id a list", _set_entry("record_id", [1, 2]), 0, ""),
    ("sizes nested", _set_entry("input_sizes", [[[1, 2]], {"a": 1}]), 0, ""),
    ("sizes a string", _set_entry("input_sizes", "1024"), 0, ""),
    ("dtypes not strings", _set_entry("input_dtypes", [[1], {"a": 1}]), 0, ""),
    ("profiling name a list", _set_entry("profiling_name", [_BIG] * 1000), 0, ""),
    ("send to a negative rank", _set_entry("profiling_name", "nccl:send -1->3"), 0, ""),
    ("send to a huge rank", _set_entry("profiling_name", "nccl:send 0->" + "9" * 30), 0, ""),
    ("send rank beyond int()", _set_entry("profiling_name", "nccl:send 0->" + "9" * 5000), 2, ""),
    ("frames: one dict 10^5 times", _set_entry("frames", [_SHARED_FRAME] * 100_000), 0, ""),
    ("frames a string", _set_entry("frames", "x" * 1000), 0, ""),
    ("frames of non-dicts", _set_entry("frames", [1, None, "a"]), 0, ""),
    ("frame name deeply nested", _set_entry("frames", [{"name": NESTED, "line": NESTED}]), 0, ""),
    ("state and retired odd", _set_entry("state", [_BIG] * 1000), 0, ""),
    ("process group not strings", _set_entry("process_group", ([1], {"a": 1})), 0, ""),
    ("one entry 10^5 times", lambda d: d.update(entries=d["entries"][:1] * 100_000), 0, ""),
    ("entry not a dict", lambda d: d["entries"].append([1, 2]), 2, "not a dict"),
    (
        "pg_status numbers beyond int()",
        lambda d: d["pg_status"]["0"].update(
            last_enqueued_collective="9" * 5000, last_completed_collective=math.nan
        ),
        0,
        "",
    ),
    ("ranks an int", _set_ranks(5), 2, "type int"),
    ("ranks a dict", _set_ranks({"a": 1}), 2, "type dict"),
    ("ranks duplicated", _set_ranks("[0, 0, 1]"), 2, "twice"),
    ("ranks duplicated, as a list", _set_ranks([0, 1, 1]), 2, "twice"),
    ("ranks negative", _set_ranks("[-1, 0, 1]"), 2, "not a list of ranks"),
    ("ranks beyond MAX_RANK", _set_ranks(f"[0, 1, {MAX_RANK + 1}]"), 2, "outside"),
    ("ranks of floats", _set_ranks("[0, 1.5]"), 2, "not a list of ranks"),
    ("ranks of booleans", _set_ranks([0, True]), 2, "not integers"),
    ("ranks a huge number", _set_ranks("[0, 1, " + "9" * 5000 + "]"), 2, "outside"),
    ("ranks not a list", _set_ranks("{0: 1}"), 2, "not a list of ranks"),
    (
        "library version a shared list",
        lambda d: d.update(comm_lib_version=[[_BIG] * 1000] * 1000),
        0,
        "",
    ),
    (
        "pg_status keyed by a shared tuple",
        lambda d: d["pg_status"].update({tuple([tuple(_BIG)] * 1000): {}}),
        0,
        "",
    ),
    ("pg_config entry not a dict", lambda d: d["pg_config"].update(x=[1]), 0, ""),
]


@pytest.mark.parametrize(("name", "edit", "status", "text"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_dump(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    edit: Callable[[dict[str, Any]], None],
    status: int,
    text: str,
) -> None:
    """Damaged fields never make an internal error (exit 70): the dump is refused in one
    sentence, or the field is read as absent and the analysis goes on."""
    dumps = _job(3)
    edit(dumps[0])
    _write(tmp_path, dumps)
    rc, out, err = _cli(["analyze", str(tmp_path), "--json"], capsys)
    assert rc == status, (rc, err)
    if rc == 2:
        assert text in _one_sentence(err) and out == ""


def test_dump_named_for_another_rank_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 2's dump renamed as rank 5's: its groups (where it has entries) do not hold 5."""
    job = FakeJob(4)
    job.group("7", "TP", [2, 3])
    job.collective("7")
    dumps = {r: job.dump_dict(r) for r in range(4)}
    dumps[5] = dumps.pop(2)
    _write(tmp_path, dumps)
    rc, _, err = _cli(["analyze", str(tmp_path)], capsys)
    assert rc == 2
    line = _one_sentence(err)
    assert "read as rank 5's dump" in line and "does not list that rank" in line


def test_a_rank_passed_out_of_bounds_is_refused() -> None:
    with pytest.raises(InputError, match="outside"):
        flight_dump_parse.dump_from_dict(_job(2)[0], source="hang/rank-0.json", rank=-1)
