"""The typed run-directory contract (zdiag.collectors.rundir, run_records): old run directories keep loading,
damaged manifests are warnings or one clear InputError, and the analyzers read run-dir files only
through the confined, capped reader."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT
from support.imports import module_imports
from support.stages import load_run
from zdiag.analyzers.inputs.discovery import discover, manifest_ranks
from zdiag.analyzers.inputs.run_dir import read_run_file, run_file
from zdiag.cli import main
from zdiag.collectors import rundir
from zdiag.collectors.manifest import build_manifest
from zdiag.collectors.record_codec import JsonRecord, at_least, run_path
from zdiag.collectors.run_records import (
    HangRecord,
    LauncherPart,
    Manifest,
    OomRecord,
    RankEntry,
    RankPart,
    SourceLine,
)
from zdiag.errors import InputError

OLD_RUN_DIRS = sorted(
    p.parent
    for p in [
        *REPO_ROOT.glob("sample_traces/*/manifest.json"),
        *REPO_ROOT.glob("sample_traces/gpu/*/manifest.json"),
        *REPO_ROOT.glob("tests/data/*/manifest.json"),
    ]
)
REMOVED_TOP_LEVEL = {"node_rank"}  # dead fields no longer written (docs/run-dir.md)
TINY_TRACE = {
    "traceEvents": [
        {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 0, "dur": 10, "pid": 1, "tid": 1}
    ]
}


def _manifest(**top: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"schema": rundir.MANIFEST_SCHEMA, "world_size": 2}
    data["ranks"] = [{"rank": 0, "trace": "traces/rank-0.json.gz"}, {"rank": 1}]
    data.update(top)
    return data


# --- layering ---------------------------------------------------------------------------------


@pytest.mark.slow  # starts a program
def test_importing_the_contract_does_not_import_torch() -> None:
    code = (
        "import sys, zdiag.collectors.run_records, zdiag.collectors.manifest\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'zmq'))\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_analyzers_take_only_the_contract_from_the_collectors() -> None:
    found = []
    for path in sorted((REPO_ROOT / "analyzers").rglob("*.py")):
        for _, name in module_imports(path):
            if name.startswith("zdiag.collectors"):
                found.append((path.name, name))
    # the run-dir contract, and the model description's schema (stdlib only, issue 12)
    contract = {
        "zdiag.collectors.rundir",
        "zdiag.collectors.run_records",
        "zdiag.collectors.model_schema",
    }
    assert found and {m for _, m in found} <= contract


# --- old run directories --------------------------------------------------------------------


@pytest.mark.parametrize("run_dir", OLD_RUN_DIRS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_old_manifests_load_unchanged(run_dir: Path) -> None:
    raw = json.loads((run_dir / "manifest.json").read_text())
    m = Manifest.from_json(raw)
    assert m.warnings == ()
    assert Manifest.from_json(m.to_json()) == m  # the written form reads back the same
    new = m.to_json()
    for key, value in raw.items():
        if key == "ranks":
            continue
        assert key in REMOVED_TOP_LEVEL or new[key] == value, key
    assert len(new["ranks"]) == len(raw["ranks"])
    for old_entry, new_entry in zip(raw["ranks"], new["ranks"], strict=True):
        assert {k: new_entry[k] for k in old_entry} == old_entry


@pytest.mark.parametrize(
    "run_dir",
    [p for p in OLD_RUN_DIRS if (p / rundir.PARTS_DIR).is_dir()],
    ids=lambda p: p.name,
)
def test_old_parts_merge_into_the_stored_manifest(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    warnings: list[str] = []
    for part in sorted((copy / rundir.PARTS_DIR).glob(rundir.RANK_PART_GLOB)):
        RankPart.from_json(json.loads(part.read_text()), part.name, warnings)
    for part in sorted((copy / rundir.PARTS_DIR).glob(rundir.LAUNCHER_PART_GLOB)):
        LauncherPart.from_json(json.loads(part.read_text()), part.name, warnings)
    assert warnings == []
    merged = build_manifest(copy).to_json()
    stored = json.loads((run_dir / "manifest.json").read_text())
    for key in stored.keys() - REMOVED_TOP_LEVEL - {"zdiag_version", "ranks", "run_info"}:
        assert merged[key] == stored[key], key
    # memory_budget_bytes is no longer repeated in run_info: it has its own field
    assert merged["run_info"] == {
        k: v for k, v in stored["run_info"].items() if k != "memory_budget_bytes"
    }
    for old_entry, new_entry in zip(stored["ranks"], merged["ranks"], strict=True):
        assert {k: new_entry[k] for k in old_entry} == old_entry


def test_old_oom_records_load() -> None:
    run_dir = REPO_ROOT / "sample_traces" / "activation-oom"
    for rank in (0, 1):
        warnings: list[str] = []
        raw = json.loads(read_run_file(run_dir, rundir.oom_relpath(rank)))
        record = OomRecord.from_json(raw, "oom", warnings, world_size=2)
        assert warnings == [] and record.rank == rank
        assert record.error == raw["error"] and record.memory_budget_bytes == 64424509
        assert {k: v for k, v in raw.items() if k in record.to_json()} == record.to_json()


# --- tolerant reading ---------------------------------------------------------------------------


def test_unknown_fields_are_ignored_and_wrong_types_take_defaults() -> None:
    data = _manifest(from_the_future={"x": 1}, nnodes="two", fsdp_units=[{"name": "a"}, 7])
    data["ranks"][0].update(steps="abc", oom="yes", collector_errors="one", new_field=[1])
    m = Manifest.from_json(data)
    assert m.nnodes == 1 and m.ranks[0].steps == 0 and m.ranks[0].oom is False
    assert m.ranks[0].collector_errors == ()
    assert [u.name for u in m.fsdp_units] == ["a"]
    text = "\n".join(m.warnings)
    for named in ("nnodes", "ranks[0]: steps", "ranks[0]: oom", "fsdp_units[1]"):
        assert named in text
    assert "from_the_future" not in text and "new_field" not in text


def test_numbers_beyond_64_bits_are_ignored_with_a_warning(tmp_path: Path) -> None:
    """A whole number past 64 bits (or one too large for a float) is damage, not a crash: the
    report and the summaries store 64-bit integers (found by tests/integration/engines/
    test_fuzz_cli.py: such a manifest made `zdiag analyze` exit 70)."""
    data = _manifest(fsdp_units=[{"name": "a", "param_bytes": 2**70}])
    data["ranks"][0].update(steps=-(2**64))
    m = Manifest.from_json(data)
    assert m.fsdp_units[0].param_bytes is None and m.ranks[0].steps == 0
    text = "\n".join(m.warnings)
    assert "param_bytes" in text and "ranks[0]: steps" in text
    found: list[str] = []
    oom = OomRecord.from_json(
        {"rank": 0, "mem_peak_bytes": 2**64, "time_unix": 10**400}, "memory/rank-0.oom.json", found
    )
    assert oom.mem_peak_bytes is None and oom.time_unix is None
    assert any("mem_peak_bytes" in w for w in found) and any("time_unix" in w for w in found)
    run = tmp_path / "run"
    shutil.copytree(REPO_ROOT / "sample_traces" / "missing-overlap", run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["fsdp_units"][0]["param_bytes"] = 2**70
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert main(["analyze", str(run), "--json", "-o", str(tmp_path / "r.json"), "--no-cache"]) == 0


def test_records_round_trip_through_their_json_with_optional_keys_last() -> None:
    hang = HangRecord(step=3, stalled_s=9.5, timeout_s=5.0, op="all_reduce", group_ranks=(0, 1))
    entry = RankEntry(
        rank=1,
        trace="traces/rank-1.json.gz",
        steps=4,
        error_source=SourceLine("train.py", 12, "main", "loss.backward()"),
        hang=hang,
        collector_errors=("x failed",),
    )
    part = RankPart(entry=entry, world_size=2, command=("python", "t.py"), versions={"torch": "2"})
    manifest = Manifest(world_size=2, ranks=(entry, RankEntry(rank=0, missing=True)))
    oom = OomRecord(rank=1, step=2, error="CUDA out of memory", mem_peak_bytes=10)
    launcher = LauncherPart(node_rank=0, nnodes=2, exit_code=0)
    for record, read in [
        (part, lambda d, w: RankPart.from_json(d, "p", w)),
        (oom, lambda d, w: OomRecord.from_json(d, "o", w, 2)),
        (launcher, lambda d, w: LauncherPart.from_json(d, "l", w)),
    ]:
        warnings: list[str] = []
        assert read(json.loads(json.dumps(record.to_json())), warnings) == record and not warnings
    assert Manifest.from_json(json.loads(json.dumps(manifest.to_json()))) == manifest
    keys = list(entry.to_json())
    assert keys[-2:] == ["error_source", "hang"] and keys.index("ended_at") == len(keys) - 3
    assert "missing" not in entry.to_json() and manifest.to_json()["ranks"][1]["missing"] is True
    assert "warnings" not in manifest.to_json() and list(manifest.to_json())[-2:] == [
        "ranks",
        "exit",
    ]


@dataclass(frozen=True)
class _NewRecord(JsonRecord):
    """A record as a new collector would declare one: the fields say how each is read."""

    name: str
    count: int | None = at_least(1)
    path: str | None = run_path()
    tags: tuple[str, ...] = ()
    hang: HangRecord | None = None


def test_a_new_record_is_read_from_its_field_declarations() -> None:
    warnings: list[str] = []
    data = {"name": 5, "count": 0, "path": "../x", "tags": "a", "hang": 3, "later": 1}
    assert _NewRecord.from_json(data, "new.json", warnings) == _NewRecord(name="")
    assert warnings == [
        "new.json: name is 5, not a string; ignored",
        "new.json: count is 0, not a whole number of at least 1; ignored",
        "new.json: path '../x' points outside the run directory; ignored",
        "new.json: tags is 'a', not a list of strings; ignored",
        "new.json.hang: not an object; ignored",
    ]
    good = _NewRecord(name="n", count=2, path="memory/a", tags=("t",), hang=None)
    assert _NewRecord.from_json(good.to_json(), "new.json", warnings) == good
    with pytest.raises(InputError, match="not a JSON object"):
        _NewRecord.from_json([], "new.json", warnings)


def test_a_newer_schema_loads_with_a_warning_and_a_foreign_one_is_refused() -> None:
    m = Manifest.from_json(_manifest(schema="zdiag.manifest/2"))
    assert any("newer" in w for w in m.warnings)
    with pytest.raises(InputError, match="not a zdiag run manifest"):
        Manifest.from_json(_manifest(schema="something/1"))


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([1, 2], "not a JSON object"),
        (_manifest(ranks={"0": {}}), "ranks is not a list"),
        (_manifest(ranks=["x"]), "ranks[0]: not a JSON object"),
        (_manifest(ranks=[{"rank": -3}]), "rank -3 is not a valid rank (the world size is 2)"),
        (_manifest(ranks=[{"rank": 2}]), "rank 2 is not a valid rank"),
        (_manifest(ranks=[{"rank": 1e30}]), "rank 100... (31 digits) is not a valid rank"),
        (_manifest(ranks=[{"rank": "0"}]), "rank is '0', not a whole number"),
        (_manifest(world_size=10**30), "world_size 100... (31 digits)"),
    ],
)
def test_damage_that_leaves_nothing_to_analyze_is_one_input_error(data: Any, expected: str) -> None:
    with pytest.raises(InputError) as err:
        Manifest.from_json(data)
    assert expected in err.value.message and "\n" not in err.value.message


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.json.gz", "traces/../../x"])
def test_manifest_paths_outside_the_run_directory_are_refused_with_a_warning(path: str) -> None:
    m = Manifest.from_json(_manifest(ranks=[{"rank": 0, "trace": path, "oom_record": path}]))
    assert m.ranks[0].trace is None and m.ranks[0].oom_record is None
    assert sum("points outside the run directory" in w for w in m.warnings) == 2


# --- the confined reader ---------------------------------------------------------------------


def test_run_file_accepts_regular_files_inside_only(tmp_path: Path) -> None:
    run_dir = rundir.make_run_dir(tmp_path / "run")
    inside = run_dir / rundir.oom_relpath(0)
    inside.write_text("{}")
    assert run_file(run_dir, rundir.oom_relpath(0)) == inside.resolve()
    (tmp_path / "secret.json").write_text("{}")
    (run_dir / "memory" / "link.json").symlink_to(tmp_path / "secret.json")
    os.mkfifo(run_dir / "memory" / "fifo.json")
    with pytest.raises(InputError, match="outside the run directory"):
        run_file(run_dir, "memory/link.json")
    with pytest.raises(InputError, match="not a regular file"):
        run_file(run_dir, "memory/fifo.json")  # never opened: a FIFO would block the read
    with pytest.raises(InputError, match="not a regular file"):
        run_file(run_dir, "memory")
    inside.write_bytes(b"x" * 100)
    assert len(read_run_file(run_dir, rundir.oom_relpath(0), max_bytes=100)) == 100
    with pytest.raises(InputError, match="larger than 99 bytes"):
        read_run_file(run_dir, rundir.oom_relpath(0), max_bytes=99)


def _run_dir_with_tiny_traces(root: Path, ranks: int = 2) -> Path:
    run_dir = rundir.make_run_dir(root)
    for r in range(ranks):
        (run_dir / f"traces/rank-{r}.json").write_text(json.dumps(TINY_TRACE))
    data = _manifest(world_size=ranks)
    data["ranks"] = [{"rank": r, "trace": f"traces/rank-{r}.json"} for r in range(ranks)]
    (run_dir / rundir.MANIFEST).write_text(json.dumps(data))
    return run_dir


def test_fifos_and_escaping_links_among_the_traces_are_skipped_with_a_warning(
    tmp_path: Path,
) -> None:
    run_dir = _run_dir_with_tiny_traces(tmp_path / "run")
    os.mkfifo(run_dir / "traces" / "rank-7.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps(TINY_TRACE))
    (run_dir / "traces" / "rank-8.json").symlink_to(tmp_path / "elsewhere.json")
    found = discover([run_dir])
    assert [p.name for p in found.traces] == ["rank-0.json", "rank-1.json"]
    assert any("rank-7.json" in w and "not a regular file" in w for w in found.warnings)
    assert any("rank-8.json" in w and "outside the run directory" in w for w in found.warnings)


def test_a_manifest_trace_linked_outside_is_not_used(tmp_path: Path) -> None:
    run_dir = _run_dir_with_tiny_traces(tmp_path / "run")
    (tmp_path / "elsewhere.json").write_text(json.dumps(TINY_TRACE))
    (run_dir / "traces" / "escape.json").symlink_to(tmp_path / "elsewhere.json")
    m = Manifest.from_json(_manifest(ranks=[{"rank": 1, "trace": "traces/escape.json"}]))
    warnings: list[str] = []
    assert manifest_ranks(m, run_dir, warnings) == {}
    assert warnings and "outside the run directory" in warnings[0]


@pytest.mark.slow  # starts a program
def test_an_oom_record_that_is_a_fifo_is_a_warning_not_a_hang(tmp_path: Path) -> None:
    run_dir = REPO_ROOT / "sample_traces" / "activation-oom"
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / rundir.oom_relpath(1)).unlink()
    os.mkfifo(copy / rundir.oom_relpath(1))
    done = subprocess.run(
        [sys.executable, "-m", "zdiag", "analyze", str(copy), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert any("oom.json" in w and "not a regular file" in w for w in report["warnings"])


# --- discovery ---------------------------------------------------------------------------------


def test_an_unreadable_subfolder_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "rank-0.json").write_text(json.dumps(TINY_TRACE))
    locked = tmp_path / "b"
    locked.mkdir()
    (locked / "rank-1.json").write_text(json.dumps(TINY_TRACE))
    if os.geteuid() != 0:
        locked.chmod(0o000)
    else:  # root reads any folder: make scandir refuse this one as it would for a user
        real = os.scandir

        def scandir(path: Any = ".") -> Any:
            if Path(path) == locked:
                raise PermissionError(13, "Permission denied", str(path))
            return real(path)

        monkeypatch.setattr(os, "scandir", scandir)
    try:
        found = discover([tmp_path])
    finally:
        locked.chmod(0o755)
    assert [p.name for p in found.traces] == ["rank-0.json"]
    assert any(str(locked) in w and "not readable" in w for w in found.warnings)


@pytest.mark.parametrize("name", ["rank-99999999999999999999.json", "rank-5.json"])
def test_a_rank_from_a_file_name_outside_the_job_is_refused(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _run_dir_with_tiny_traces(tmp_path / "run")
    data = json.loads((run_dir / rundir.MANIFEST).read_text())
    data["ranks"][1]["trace"] = None  # rank 1's trace is known by its file name only
    (run_dir / rundir.MANIFEST).write_text(json.dumps(data))
    (run_dir / "traces" / "rank-1.json").rename(run_dir / "traces" / name)
    assert main(["analyze", str(run_dir), "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(file name): rank " in err[0] and "is not a valid rank" in err[0]


def test_manifest_warnings_reach_the_report(tmp_path: Path) -> None:
    run_dir = _run_dir_with_tiny_traces(tmp_path / "run")
    data = json.loads((run_dir / rundir.MANIFEST).read_text())
    data["ranks"][0]["steps"] = "many"
    (run_dir / rundir.MANIFEST).write_text(json.dumps(data))
    run = load_run([run_dir])
    assert any("ranks[0]: steps is 'many'" in w for w in run.warnings)


def test_a_part_beyond_the_world_size_widens_the_merged_manifest(tmp_path: Path) -> None:
    run_dir = rundir.make_run_dir(tmp_path / "run")
    for rank in (0, 3):  # rank 3 left by an earlier, larger run in the same folder
        part = RankPart(entry=RankEntry(rank=rank, exit_code=0), world_size=2)
        rundir.rank_part_path(run_dir, rank).write_text(json.dumps(part.to_json()))
    m = build_manifest(run_dir)
    assert m.world_size == 4 and [r.rank for r in m.ranks] == [0, 1, 2, 3]
    assert [r.missing for r in m.ranks] == [False, True, True, False]
    assert Manifest.from_json(m.to_json()) == m  # and the analyzers accept every rank in it


ODD_VALUES: list[Any] = [
    None,
    "x",
    "",
    -1,
    0,
    2**70,
    -(2**70),
    1e308,
    -0.5,
    True,
    [],
    [1],
    {},
    {"a": 1},
]


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def test_every_field_of_a_real_manifest_set_to_odd_values_loads_or_is_one_input_error() -> None:
    """Seeded mutations: each field of a real manifest replaced by values of every odd type."""
    import copy
    import random

    base = json.loads((REPO_ROOT / "sample_traces/activation-oom/manifest.json").read_text())
    rng = random.Random(0)
    paths = _paths(base)
    outcomes = {"loaded": 0, "refused": 0}
    for path in paths:
        for value in rng.sample(ODD_VALUES, 5):
            data = copy.deepcopy(base)
            node = data
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
            try:
                m = Manifest.from_json(data)
            except InputError as exc:
                assert exc.message.count(".") >= 1 and "\n" not in exc.message
                outcomes["refused"] += 1
                continue
            Manifest.from_json(json.loads(json.dumps(m.to_json())))  # what it writes reads back
            outcomes["loaded"] += 1
    assert outcomes["loaded"] > 10 * outcomes["refused"] > 0
