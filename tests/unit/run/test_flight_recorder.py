"""Flight-recorder dumps: reading (restricted, bounded), the culprit analysis, `zdiag analyze`."""

from __future__ import annotations

import json
import pickle
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest

from conftest import REAL_TRACES, REPO_ROOT
from support.flight_recorder import TORCH_PY, FakeJob, frame
from zdiag.analyzers.detectors import hang_finding
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.inputs import flight_dump_parse, flight_dumps
from zdiag.analyzers.run import wait_graph
from zdiag.cli import main
from zdiag.errors import InputError

FR_REAL = REAL_TRACES / "flight_recorder"
GROUND_TRUTH = {"gpu_error_1st": (12, 14), "lock_gil_1st": (9, 14)}


def _analyze(paths: list[Path]) -> wait_graph.HangAnalysis:
    return wait_graph.analyze_dumps(flight_dumps.read_dumps(paths))


def _four_ranks_hung_at_4(missing: tuple[int, ...] = (2,)) -> FakeJob:
    """4 ranks, 3 all_reduces done, the 4th issued by all but `missing`."""
    job = FakeJob(4)
    for _ in range(3):
        job.collective()
    job.collective(ranks=[r for r in range(4) if r not in missing], state="scheduled")
    return job


# --- reading ---------------------------------------------------------------------------------


def test_dump_is_recognised_by_content_not_name(tmp_path: Path) -> None:
    (path,) = FakeJob(1).write(tmp_path, prefix="whatever_")
    assert flight_dumps.is_flight_recorder_dump(path)
    other = tmp_path / "trace.json"
    other.write_text("{}")
    snapshot = tmp_path / "snap.pickle"
    snapshot.write_bytes(pickle.dumps({"segments": [], "version": "2.9"}, protocol=2))
    plain_list = tmp_path / "list.pickle"
    plain_list.write_bytes(pickle.dumps(["version", "2.9"], protocol=2))
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    for p in (other, snapshot, plain_list, empty, tmp_path):
        assert not flight_dumps.is_flight_recorder_dump(p), p


def test_read_dump_fields(tmp_path: Path) -> None:
    job = FakeJob(2)
    pp = job.group("5", "PIPELINE_MODEL_PARALLEL_GROUP", [0, 1])
    job.collective(sizes=[[4, 8]], dtype="BFloat16")
    job.p2p(pp, 0, 1, state="scheduled")
    d = flight_dumps.read_dump(job.write(tmp_path)[0])
    assert d.rank == 0 and d.readable and d.version == "2.9"
    assert d.comm_lib_version == "2.27.3"
    assert {g.name: g.ranks for g in d.groups} == {"0": (0, 1), "5": (0, 1)}
    coll, send = d.entries
    assert (coll.op, coll.collective_seq_id, coll.completed) == ("all_reduce", 1, True)
    assert coll.input_sizes == ((4, 8),) and coll.input_dtypes == ("BFloat16",)
    assert (send.op, send.is_p2p, send.src, send.dst, send.p2p_seq_id) == ("send", True, 0, 1, 1)
    assert send.pg_desc == "PIPELINE_MODEL_PARALLEL_GROUP" and not send.completed
    assert {s.pg_id: s.last_enqueued for s in d.pg_status} == {"0": 1, "1": 1}


def test_gloo_style_version_2_10_reads(tmp_path: Path) -> None:
    job = FakeJob(2, version="2.10", backend="gloo")
    job.collective()
    d = flight_dumps.read_dump(job.write(tmp_path)[1])
    assert d.version == "2.10" and d.comm_lib_version == "2.27.3"
    assert d.entries[0].profiling_name == "gloo:all_reduce"


def test_early_2x_entries_with_one_seq_id(tmp_path: Path) -> None:
    """Early 2.x writers had `seq_id`, no `p2p_seq_id`, `is_p2p`, dtypes or pg_status."""
    for rank, seqs in ((0, (1, 2)), (1, (1,))):
        entries = [
            {
                "record_id": k,
                "pg_id": 0,
                "process_group": ("0", "default_pg"),
                "seq_id": seq,
                "profiling_name": "nccl:all_reduce",
                "input_sizes": [[4]],
                "output_sizes": [[4]],
                "state": "completed" if seq == 1 else "scheduled",
            }
            for k, seq in enumerate(seqs)
        ]
        dump = {"version": "2.2", "pg_config": {"0": {"desc": "default_pg", "ranks": "[0, 1]"}}}
        dump["entries"] = entries
        (tmp_path / f"trace_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    a = _analyze(sorted(tmp_path.iterdir()))
    assert a.culprit_ranks == (1,)
    assert a.disagreements[0].seq == 2


def test_json_form_of_the_dump(tmp_path: Path) -> None:
    """The JSON dump (`_dump_fr_trace_json`, kept by zdiag run's hang watchdog) reads the same."""
    job = _four_ranks_hung_at_4()
    dumps = []
    for rank in range(4):
        raw = json.loads(json.dumps(job.dump_dict(rank)))  # tuples become lists
        for e in raw["entries"]:
            e["time_discovered_completed_ns"] = e["time_discovered_completed_ns"] or 0
        raw["pg_status"] = {
            k: {n: str(v) for n, v in st.items()} for k, st in raw["pg_status"].items()
        }
        dumps.append(
            flight_dump_parse.dump_from_dict(raw, source=f"hang/rank-{rank}.json", rank=rank)
        )
    assert dumps[0].pg_status[0].last_enqueued == 4
    assert wait_graph.analyze_dumps(dumps).culprit_ranks == (2,)


def test_empty_and_cut_short_dumps_are_suspects_not_errors(tmp_path: Path) -> None:
    paths = FakeJob(3).write(tmp_path, empty=(1,), truncated=(2,))
    dumps = flight_dumps.read_dumps(paths)
    assert [(d.rank, d.readable, d.problem) for d in dumps] == [
        (0, True, ""),
        (1, False, "empty"),
        (2, False, "cut short"),
    ]


def test_a_pickle_naming_a_class_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "fr_0"
    bad.write_bytes(pickle.dumps(OrderedDict(version="2.9", entries=[]), protocol=2))
    # OrderedDict is rebuilt through a global: not a plain dump. It does not even sniff as one.
    assert not flight_dumps.is_flight_recorder_dump(bad)
    evil = tmp_path / "fr_1"
    evil.write_bytes(pickle.dumps({"version": "2.9", "entries": [OrderedDict(a=1)]}, protocol=2))
    assert flight_dumps.is_flight_recorder_dump(evil)
    with pytest.raises(InputError, match="plain"):
        flight_dumps.read_dump(evil)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"version": "3.0", "entries": []}, "not supported"),
        ({"version": "2.9", "entries": {}}, "no 'entries' list"),
        ({"version": "2.9", "entries": [{"profiling_name": "nccl:x"}]}, "process_group"),
    ],
)
def test_bad_dumps_name_the_problem(tmp_path: Path, data: dict[str, object], match: str) -> None:
    p = tmp_path / "fr_0"
    p.write_bytes(pickle.dumps(data, protocol=2))
    with pytest.raises(InputError, match=match):
        flight_dumps.read_dump(p)


def test_oversized_dump_is_refused_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (path,) = FakeJob(1).write(tmp_path)
    monkeypatch.setattr(flight_dumps, "MAX_DUMP_BYTES", 100)
    with pytest.raises(InputError, match="limit"):
        flight_dumps.read_dump(path)


def test_rank_from_a_name_with_an_extension(tmp_path: Path) -> None:
    p = tmp_path / "fr_dump_7.pkl"
    p.write_bytes(pickle.dumps(FakeJob(8).dump_dict(7), protocol=2))
    assert flight_dumps.read_dump(p).rank == 7


def test_rank_from_pg_config_when_the_name_has_none(tmp_path: Path) -> None:
    job = FakeJob(4)
    job.group("7", "TP", [2, 3])
    job.group("8", "DP", [0, 2])
    job.collective()
    data = pickle.dumps(job.dump_dict(2), protocol=2)
    p = tmp_path / "dump.pkl"
    p.write_bytes(data)
    assert flight_dumps.read_dump(p).rank == 2
    q = tmp_path / "other.pkl"
    q.write_bytes(pickle.dumps(job.dump_dict(3), protocol=2))  # in TP [2, 3] and default only
    with pytest.raises(InputError, match="which rank"):
        flight_dumps.read_dump(q)


def test_two_dumps_of_one_rank_and_all_empty_are_errors(tmp_path: Path) -> None:
    a = FakeJob(1).write(tmp_path / "a")
    b = FakeJob(1).write(tmp_path / "b")
    with pytest.raises(InputError, match="both are dumps of rank 0"):
        flight_dumps.read_dumps(a + b)
    with pytest.raises(InputError, match="every flight-recorder dump"):
        flight_dumps.read_dumps(FakeJob(2).write(tmp_path / "c", empty=(0, 1)))


# --- the analysis ----------------------------------------------------------------------------


def test_missing_rank_is_the_culprit(tmp_path: Path) -> None:
    a = _analyze(_four_ranks_hung_at_4().write(tmp_path))
    assert a.culprit_ranks == (2,)
    assert a.culprits[0].reason == "missing"
    assert a.waiting == (0, 1, 3)
    (d,) = a.disagreements
    assert (d.pg_desc, d.kind, d.seq, d.profiling_name) == (
        "default_pg",
        "missing",
        4,
        "nccl:all_reduce",
    )
    assert d.with_status("waiting") == (0, 1, 3) and d.with_status("missing") == (2,)
    assert {x.rank: x.last_seq for x in d.ranks}[2] == 3


def test_rank_behind_by_two_is_named_with_its_lag(tmp_path: Path) -> None:
    """Ranks 0-2 enqueued collectives #3 and #4 (asynchronously); rank 3 stopped after #2."""
    job = FakeJob(4)
    for _ in range(2):
        job.collective()
    job.collective(ranks=[0, 1, 2], state="scheduled")
    job.collective(ranks=[0, 1, 2], state="scheduled")
    a = _analyze(job.write(tmp_path))
    assert a.culprit_ranks == (3,)
    (finding,) = hang_finding.hang_findings(a)
    assert finding.evidence["first_group"]["seq"] == 3
    assert finding.evidence["first_group"]["behind_by"] == {"3": 2}


def test_only_active_dumps_give_the_same_answer(tmp_path: Path) -> None:
    a = _analyze(_four_ranks_hung_at_4().write(tmp_path, only_active=True))
    assert a.culprit_ranks == (2,)


def test_mismatched_sizes_name_the_odd_rank(tmp_path: Path) -> None:
    job = FakeJob(4)
    job.collective()
    job.collective(state="scheduled", sizes={0: [[64]], 1: [[64]], 2: [[64]], 3: [[65]]})
    a = _analyze(job.write(tmp_path))
    assert a.culprit_ranks == (3,) and a.culprits[0].reason == "mismatched"
    (d,) = a.disagreements
    assert d.kind == "mismatch" and d.with_status("mismatched") == (3,)


def test_mismatched_op_names_the_odd_rank(tmp_path: Path) -> None:
    job = FakeJob(3)
    job.collective(state="scheduled", op="all_reduce", op_by_rank={1: "broadcast"})
    assert _analyze(job.write(tmp_path)).culprit_ranks == (1,)


def test_all_to_all_sizes_may_differ(tmp_path: Path) -> None:
    job = FakeJob(2)
    job.collective(op="all_to_all", sizes={0: [[10, 4]], 1: [[12, 4]]})
    a = _analyze(job.write(tmp_path))
    assert a.culprits == () and hang_finding.hang_findings(a) == []


def test_empty_dump_of_a_frozen_rank_makes_it_the_suspect(tmp_path: Path) -> None:
    job = _four_ranks_hung_at_4()
    a = _analyze(job.write(tmp_path, empty=(2,)))
    assert a.culprit_ranks == (2,) and a.culprits[0].reason == "no dump"
    assert a.unreadable == (2,)
    (finding,) = hang_finding.hang_findings(a)
    assert finding.evidence["unreadable_dumps"] == [2]


def test_missing_dump_file_is_named_too(tmp_path: Path) -> None:
    a = _analyze(_four_ranks_hung_at_4().write(tmp_path, skip=(2,)))
    assert a.culprit_ranks == (2,) and a.culprits[0].reason == "no dump"
    assert a.expected_ranks == (0, 1, 2, 3) and a.ranks == (0, 1, 3)


def test_unpaired_send_blames_the_receiver(tmp_path: Path) -> None:
    job = FakeJob(2)
    pp = job.group("9", "PIPELINE_MODEL_PARALLEL_GROUP", [0, 1])
    job.p2p(pp, 0, 1)
    job.p2p(pp, 0, 1, sides=("send",), state="scheduled")
    a = _analyze(job.write(tmp_path))
    assert a.culprit_ranks == (1,) and a.waiting == (0,)
    (d,) = a.disagreements
    assert d.kind == "p2p" and d.profiling_name == "nccl:send 0->1"


def test_paired_pending_p2p_is_not_a_disagreement(tmp_path: Path) -> None:
    job = FakeJob(2)
    pp = job.group("9", "PIPELINE_MODEL_PARALLEL_GROUP", [0, 1])
    job.p2p(pp, 1, 0, state="scheduled")
    assert _analyze(job.write(tmp_path)).disagreements == ()


def test_waiting_in_another_group_is_not_a_culprit(tmp_path: Path) -> None:
    """Rank 3 never arrives; rank 2 waits for it in TP and so misses DP: only 3 is named."""
    job = FakeJob(4)
    tp0, tp1 = job.group("10", "TP", [0, 1]), job.group("11", "TP", [2, 3])
    dp0, dp1 = job.group("12", "DP", [0, 2]), job.group("13", "DP", [1, 3])
    for g in (tp0, tp1, dp0, dp1):
        job.collective(g)
    job.collective(tp1, op="_all_gather_base", ranks=[2], state="scheduled")
    job.collective(dp0, ranks=[0], state="scheduled")
    job.collective(dp1, ranks=[1], state="scheduled")
    a = _analyze(job.write(tmp_path))
    assert a.culprit_ranks == (3,)
    assert set(a.waiting) == {0, 1, 2}
    assert {d.pg_name for d in a.disagreements} == {tp1, dp0, dp1}


def test_crossed_order_is_a_deadlock_of_both(tmp_path: Path) -> None:
    job = FakeJob(2)
    a_grp, b_grp = job.group("20", "A", [0, 1]), job.group("21", "B", [0, 1])
    job.collective(a_grp, ranks=[0], state="scheduled")
    job.collective(b_grp, ranks=[1], state="scheduled")
    a = _analyze(job.write(tmp_path))
    assert a.culprit_ranks == (0, 1)
    assert {c.reason for c in a.culprits} == {"deadlock"}


def test_stuck_rank_behind_in_completion(tmp_path: Path) -> None:
    """A GPU fault: rank 1 issued every op but stopped completing the ones rank 0 completed."""
    job = FakeJob(2)
    tp = job.group("30", "TENSOR_MODEL_PARALLEL_GROUP", [0, 1])
    for k in range(6):
        job.collective(
            tp,
            op="_all_gather_base",
            state={
                0: "completed" if k < 5 else "scheduled",
                1: "completed" if k < 2 else "scheduled",
            },
        )
    a = _analyze(job.write(tmp_path, only_active=True))
    assert a.culprit_ranks == (1,) and a.culprits[0].reason == "stuck"
    (d,) = a.disagreements
    assert (d.kind, d.seq) == ("stuck", 3)
    assert d.with_status("stuck") == (1,) and d.with_status("completed") == (0,)


def test_broadcast_receivers_behind_the_root_are_not_blamed(tmp_path: Path) -> None:
    """A broadcast root may complete before its receivers: that alone names nobody stuck."""
    job = FakeJob(2)
    job.collective(op="broadcast", state={0: "completed", 1: "scheduled"})
    job.collective(op="broadcast", ranks=[0], state="scheduled")
    a = _analyze(job.write(tmp_path))
    assert all(c.reason != "stuck" for c in a.culprits)


def test_healthy_dumps_have_no_finding(tmp_path: Path) -> None:
    job = FakeJob(4)
    pp = job.group("9", "PIPELINE_MODEL_PARALLEL_GROUP", [0, 1, 2, 3])
    for _ in range(5):
        job.collective()
        job.p2p(pp, 0, 1)
    job.collective(state="scheduled")  # in flight on every rank: no disagreement
    a = _analyze(job.write(tmp_path))
    assert a.culprits == () and a.disagreements == ()
    assert hang_finding.hang_findings(a) == []


def test_gloo_dumps_without_pg_config(tmp_path: Path) -> None:
    """torch 2.13's gloo writes a placeholder pg_config: the default group is every dump."""
    job = FakeJob(3, version="2.10", backend="gloo")
    job.collective()
    job.collective(ranks=[0, 2], state="scheduled")
    paths = job.write(tmp_path)
    for p in paths:  # what gloo writes instead of the group list
        d = pickle.loads(p.read_bytes())
        d["pg_config"] = {"": {"name": "", "desc": "", "ranks": "[]"}}
        p.write_bytes(pickle.dumps(d, protocol=2))
    assert _analyze(paths).culprit_ranks == (1,)


def test_culprit_frame_is_the_innermost_user_frame(tmp_path: Path) -> None:
    job = FakeJob(2)
    stack = [
        frame("all_reduce", TORCH_PY, 3245),
        frame("wrapper", "/x/site-packages/torch/distributed/c10d_logger.py", 81),
        frame("train_step", "/home/me/train.py", 42),
        frame("<module>", "/home/me/train.py", 90),
    ]
    job.collective(frames={0: stack, 1: stack})
    job.collective(ranks=[0], state="scheduled", frames={0: stack})
    a = _analyze(job.write(tmp_path))
    assert a.culprit_ranks == (1,)
    assert str(a.culprits[0].frame) == "/home/me/train.py:42 in train_step"
    (finding,) = hang_finding.hang_findings(a)
    assert finding.evidence["culprit_frames"] == {"1": "/home/me/train.py:42 in train_step"}
    assert finding.evidence["first_group"]["frames"] == {
        "0": "/home/me/train.py:42 in train_step",  # waiting there
        "1": "/home/me/train.py:42 in train_step",  # its last op in the group
    }


def test_hang_finding_fields(tmp_path: Path) -> None:
    (f,) = hang_finding.hang_findings(
        _analyze(_four_ranks_hung_at_4(missing=(1, 3)).write(tmp_path))
    )
    assert f.id == "hang" and f.severity == "critical"
    assert f.ranks == [1, 3]
    assert "ranks 1, 3 never arrived" in f.title and "collective #4" in f.title
    assert f.evidence["culprit_ranks"] == [1, 3] and f.evidence["waiting_ranks"] == [0, 2]
    assert f.evidence["first_group"]["missing"] == [1, 3]
    json.dumps(f.evidence)  # plain values only


# --- discovery and the command ---------------------------------------------------------------


def test_find_dumps_in_folders_and_beside_traces(tmp_path: Path) -> None:
    paths = _four_ranks_hung_at_4().write(tmp_path / "fr", prefix="_dump_", empty=(2,))
    (tmp_path / "fr" / "notes.txt").write_text("hello")
    dumps, rest = flight_dumps.find_dumps([tmp_path / "fr"])
    assert sorted(dumps) == sorted(paths) and rest == []  # the empty _dump_2 included
    (tmp_path / "fr" / "rank-0.json").write_text("{}")
    dumps, rest = flight_dumps.find_dumps([tmp_path / "fr"])
    assert len(dumps) == 4 and rest == [tmp_path / "fr"]
    dumps, rest = flight_dumps.find_dumps([paths[0], tmp_path / "fr" / "notes.txt"])
    assert dumps == [paths[0]] and rest == [tmp_path / "fr" / "notes.txt"]
    dumps, rest = flight_dumps.find_dumps(paths)  # `zdiag analyze fr/_dump_*`: the empty one too
    assert dumps == sorted(paths) and rest == []


def test_find_dumps_below_a_run_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    (run / "traces" / "rank-0.json.gz").write_bytes(b"")
    paths = _four_ranks_hung_at_4().write(run / "hang" / "flight_recorder", prefix="fr_")
    dumps, rest = flight_dumps.find_dumps([run])
    assert dumps == sorted(paths) and rest == [run]


def test_analyze_paths_on_a_folder_of_dumps(tmp_path: Path) -> None:
    _four_ranks_hung_at_4().write(tmp_path, prefix="nccl_trace_rank_", empty=(3,))
    report = analyze_paths([tmp_path])
    (f,) = report.findings
    assert f.id == "hang" and f.ranks == [2, 3]
    assert report.run is not None and report.run["world_size"] == 4
    assert any("rank 3" in w and "empty" in w for w in report.warnings)


def test_dumps_below_a_run_directory_add_to_its_report(tmp_path: Path) -> None:
    from conftest import REPO_ROOT

    run = tmp_path / "run"
    shutil.copytree(REPO_ROOT / "sample_traces" / "none", run)
    _four_ranks_hung_at_4().write(run / "flight_recorder", prefix="fr_")
    report = analyze_paths([run])
    assert len(report.ranks) == 2  # the profiler traces are analyzed as before
    hang = [f for f in report.findings if f.id == "hang"]
    assert [f.ranks for f in hang] == [[2]]
    assert sum("flight_recorder" in i for i in report.inputs) == 4


def test_cli_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _four_ranks_hung_at_4().write(tmp_path)
    assert main(["analyze", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[CRITICAL] hang: rank 2 never arrived" in out
    assert main(["analyze", str(tmp_path), "--json", "--fail-on", "critical"]) == 1
    raw = json.loads(capsys.readouterr().out)
    (f,) = raw["findings"]
    assert f["id"] == "hang" and f["ranks"] == [2]


def test_cli_bad_dump_is_one_sentence_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = _four_ranks_hung_at_4().write(tmp_path)
    paths[1].write_bytes(pickle.dumps({"version": "7.1", "entries": []}, protocol=2))
    assert main(["analyze", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "not supported" in lines[0] and "Traceback" not in captured.err


# --- the real dumps (../shared/real_traces/flight_recorder) ----------------------------------


def _real(name: str) -> Path:
    folder = FR_REAL / name
    if not folder.is_dir():
        pytest.skip(
            f"real flight-recorder dumps not found at {folder} (../shared next to the checkout)"
        )
    return folder


def _ground_truth(folder: Path) -> tuple[int, ...]:
    text = (folder / "fault_injection.log").read_text()
    line = next(x for x in text.splitlines() if x.startswith("Fault ranks:"))
    return tuple(sorted(int(x) for x in line.split("[", 1)[1].rstrip("]").split(",")))


@pytest.mark.parametrize("name", sorted(GROUND_TRUTH))
def test_real_dumps_name_exactly_the_faulty_ranks(name: str) -> None:
    folder = _real(name)
    assert _ground_truth(folder) == GROUND_TRUTH[name]
    report = analyze_paths([folder])
    (f,) = [f for f in report.findings if f.id == "hang"]
    assert tuple(f.ranks) == GROUND_TRUTH[name]


@pytest.mark.parametrize(
    ("name", "frozen"),
    [(n, ks) for n, t in sorted(GROUND_TRUTH.items()) for ks in ((t[0],), (t[1],), t)],
)
def test_real_dumps_when_faulty_ranks_left_empty_dumps(
    tmp_path: Path, name: str, frozen: tuple[int, ...]
) -> None:
    """A frozen process leaves an empty dump: the faulty ranks are still named, as suspects."""
    work = tmp_path / name
    shutil.copytree(_real(name), work)
    for rank in frozen:
        (work / f"_dump_{rank}").chmod(0o644)
        (work / f"_dump_{rank}").write_bytes(b"")
    a = _analyze(flight_dumps.find_dumps([work])[0])
    assert a.culprit_ranks == GROUND_TRUTH[name]
    assert a.unreadable == frozen
    assert {c.rank for c in a.culprits if c.reason == "no dump"} == set(frozen)


def test_real_dumps_with_a_culprit_dump_absent() -> None:
    paths = [
        p for p in flight_dumps.find_dumps([_real("gpu_error_1st")])[0] if p.name != "_dump_14"
    ]
    a = _analyze(paths)
    assert a.culprit_ranks == (12, 14)
    assert {c.rank: c.reason for c in a.culprits} == {12: "stuck", 14: "no dump"}


def _torch_crosscheck(folder: Path) -> dict[str, list[int]]:
    pytest.importorskip("torch.distributed.flight_recorder.components.builder")
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fr_crosscheck", REPO_ROOT / "bench" / "fr_crosscheck.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result: dict[str, list[int]] = module.torch_report(folder)["missing_ranks_by_group"]
    return result


def test_torch_analyzer_agrees_on_lock_gil() -> None:
    """torch's fr_trace builder, fed the same (safely read) dumps, names the same missing ranks."""
    missing = _torch_crosscheck(_real("lock_gil_1st"))
    assert set().union(*map(set, missing.values())) == {9, 14}
    assert missing["37:TENSOR_MODEL_PARALLEL_GROUP"] == [9]
    assert missing["38:TENSOR_MODEL_PARALLEL_GROUP"] == [14]


def test_torch_analyzer_on_gpu_error_sees_only_arrivals() -> None:
    """torch matches arrivals only: it finds rank 12 missing where rank 13 went ahead, but rank
    14 (which issued every op and then stopped completing them) is never missing to it; zdiag
    names 14 as stuck. Its other "missing" ranks come from its record-id alignment, which drops
    the entries of ranks 0-12 (docs/flight-recorder.md)."""
    missing = _torch_crosscheck(_real("gpu_error_1st"))
    for group in ("41:TENSOR_MODEL_PARALLEL_GROUP", "74:EXPERT_MODEL_PARALLEL_GROUP"):
        assert missing[group] == [12]
    assert 14 not in set().union(*map(set, missing.values()))
    assert _analyze(flight_dumps.find_dumps([_real("gpu_error_1st")])[0]).culprit_ranks == (12, 14)


# --- a real 2-rank gloo job (torch 2.13 records gloo collectives in the flight recorder) ------

GLOO_HANG = """
import datetime, os, sys, time
import torch, torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace

rank, out, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
    timeout=datetime.timedelta(seconds=2),
)
t = torch.ones(8)
for _ in range(3):
    dist.all_reduce(t)

def train_step():  # rank 0 reaches the 4th all_reduce; rank 1 never does
    return dist.all_reduce(t, async_op=True)

if rank == 0:
    work = train_step()
time.sleep(1.0)  # both ranks: gloo marks an entry retired shortly after the op returns
with open(os.path.join(out, f"fr_{rank}.tmp"), "wb") as f:
    f.write(_dump_fr_trace())
os.rename(os.path.join(out, f"fr_{rank}.tmp"), os.path.join(out, f"fr_{rank}"))
if rank == 0:
    try:
        work.wait()
    except Exception:
        pass
else:
    time.sleep(3.5)
os._exit(0)
"""


@pytest.mark.dist
def test_real_gloo_hang_dump_names_the_absent_rank(tmp_path: Path) -> None:
    import os
    import socket
    import subprocess
    import sys

    pytest.importorskip("torch.distributed")
    script = tmp_path / "gloo_hang.py"
    script.write_text(GLOO_HANG)
    out = tmp_path / "dumps"
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "100", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(out), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    dumps = sorted(out.glob("fr_?"))
    assert len(dumps) == 2 and all(flight_dumps.is_flight_recorder_dump(p) for p in dumps)
    read = flight_dumps.read_dumps(dumps)
    assert read[0].version.startswith("2.") and read[0].entries[0].profiling_name.startswith(
        "gloo:"
    )
    a = wait_graph.analyze_dumps(read)
    assert a.culprit_ranks == (1,) and a.waiting == (0,)
    (d,) = a.disagreements
    assert (d.kind, d.seq, d.profiling_name) == ("missing", 4, "gloo:all_reduce")
    waiting = next(x for x in d.ranks if x.rank == 0)
    assert waiting.frame is not None and waiting.frame.name == "train_step"
    report = analyze_paths([out])
    assert [f.ranks for f in report.findings if f.id == "hang"] == [[1]]
