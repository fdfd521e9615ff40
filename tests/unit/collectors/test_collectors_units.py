"""Unit tests of the collectors: config, atomic files, manifest merge, step log, run info, and a
single-rank session driven in-process through the `zdiag.profile` API."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import pytest
import torch

import zdiag
from zdiag.collectors import manifest, memory, memtimeline, rundir, runinfo
from zdiag.collectors.api import default_out_dir
from zdiag.collectors.config import CollectorConfig, config_from_env, parse_profile_steps
from zdiag.collectors.fsio import write_atomically, write_json_atomically
from zdiag.collectors.run_records import Manifest
from zdiag.collectors.step_clock import StepClock
from zdiag.collectors.steplog import StepLog
from zdiag.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_run_info() -> None:
    runinfo._RUN_INFO.clear()
    runinfo.set_memory_reader(None)


def test_parse_profile_steps() -> None:
    assert parse_profile_steps("1:1:3") == (1, 1, 3)
    assert parse_profile_steps("0:0:1") == (0, 0, 1)
    for bad in ("1:x:3", "1:1", "1:1:0", "-1:1:1", ""):
        with pytest.raises(ConfigError):
            parse_profile_steps(bad)


def test_config_round_trips_through_env() -> None:
    cfg = CollectorConfig(profile=False, wait=2, warmup=0, active=4, nvtx=False)
    env = {"ZDIAG_RUN_DIR": "/tmp/x", "ZDIAG_CONFIG": cfg.to_json()}
    found = config_from_env(env)
    assert found == ("/tmp/x", cfg)
    assert config_from_env({}) is None


def test_atomic_write_leaves_no_temp_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "f.json"

    def boom(tmp: str) -> None:
        Path(tmp).write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomically(target, boom)
    assert list(tmp_path.iterdir()) == []
    write_json_atomically(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_step_log_is_capped(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "s.jsonl", max_lines=3)
    for i in range(5):
        log.write_step(i, 0.0, 1.0, None, None, None)
    log.close()
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]
    assert log.truncated and log.written


def test_step_log_holds_the_step_cpu_time(tmp_path: Path) -> None:
    """A busy step's CPU time (every thread, and the thread that ends the step) reaches its line;
    a line written without it has neither key."""
    clock = StepClock()
    deadline = time.perf_counter() + 0.05
    while time.perf_counter() < deadline:  # 50 ms of this thread's CPU
        pass
    clock.tick()
    process_ms, thread_ms = clock.cpu_ms
    assert 25.0 < thread_ms <= process_ms + 1.0
    log = StepLog(tmp_path / "s.jsonl", max_lines=3)
    log.write_step(0, 0.0, 50.0, None, None, None, cpu_ms=clock.cpu_ms)
    log.write_step(1, 0.0, 1.0, None, None, None)
    log.close()
    first, second = (json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines())
    assert (first["cpu_ms"], first["main_cpu_ms"]) == (round(process_ms, 3), round(thread_ms, 3))
    assert "cpu_ms" not in second and "main_cpu_ms" not in second


def test_run_info_is_json_safe_and_notifies() -> None:
    seen: list[dict] = []
    remove = runinfo.add_listener(seen.append)
    runinfo.record_run_info(
        harness={"dim": 8},
        fsdp_units=[{"name": "a", "param_count": 2, "param_bytes": 8}],
        odd=object(),
    )
    remove()
    runinfo.record_run_info(extra=1)
    assert len(seen) == 1
    info = runinfo.current_run_info()
    assert info["harness"] == {"dim": 8} and isinstance(info["odd"], str) and info["extra"] == 1


def test_is_out_of_memory_follows_the_cause_chain() -> None:
    oom = torch.OutOfMemoryError("emulated")
    assert memory.is_out_of_memory(oom)
    try:
        try:
            raise oom
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert memory.is_out_of_memory(outer)
    assert not memory.is_out_of_memory(ValueError("x"))


def _part(run_dir: Path, rank: int, **kw: object) -> None:
    data = {"rank": rank, "world_size": 3, "host": f"h{rank}", "exit_code": 0, "oom": False}
    data.update(kw)
    write_json_atomically(rundir.rank_part_path(run_dir, rank), data)


def test_merge_marks_missing_ranks_and_reports_oom(tmp_path: Path) -> None:
    rundir.make_run_dir(tmp_path)
    (tmp_path / rundir.trace_relpath(0)).write_bytes(b"x")
    _part(
        tmp_path,
        0,
        trace=rundir.trace_relpath(0),
        step_log=rundir.step_log_relpath(0),
        run_info={
            "harness": {"memory_budget_gb": 0.25},
            "fsdp_units": [{"name": "", "param_count": 1, "param_bytes": 4}],
        },
    )
    _part(tmp_path, 2, exit_code=1, oom=True, error="OutOfMemoryError: emulated")
    write_json_atomically(
        rundir.launcher_part_path(tmp_path, 0),
        {"node_rank": 0, "nnodes": 1, "command": ["zdiag", "run"], "exit_code": 1},
    )
    m = manifest.merge_manifest(tmp_path)
    written = json.loads((tmp_path / "manifest.json").read_text())
    assert written == m.to_json()
    assert Manifest.from_json(written) == m  # what the analyzers read back is what was merged
    assert m.schema == written["schema"] == "zdiag.manifest/1"
    assert [r.rank for r in m.ranks] == [0, 1, 2]
    assert m.ranks[1].missing and written["ranks"][1]["missing"] is True
    assert "missing" not in written["ranks"][0]
    assert m.ranks[0].trace == "traces/rank-0.json.gz"
    assert m.ranks[0].step_log is None  # named in the part, but the file is absent
    assert written["exit"] == {"code": 1, "oom": True, "error": "OutOfMemoryError: emulated"}
    assert m.memory_budget_bytes == 2**28
    assert m.fsdp_units[0].param_bytes == 4 and m.unit_param_bytes() == {"": 4}
    assert m.hosts == ("h0", "h2")
    assert "node_rank" not in written  # removed: it named whichever node merged last


def test_profile_api_writes_a_run_directory(tmp_path: Path) -> None:
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runinfo.set_memory_reader(lambda: (100, 200, 300))
    with zdiag.profile(out=tmp_path, wait=1, warmup=0, active=2) as prof:
        for _ in range(5):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    assert prof.step_num == 5
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["world_size"] == 1 and m["exit"]["code"] == 0 and m["ranks"][0]["steps"] == 5
    trace = json.load(gzip.open(tmp_path / m["ranks"][0]["trace"]))
    steps = sorted(
        {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    )
    assert steps == ["ProfilerStep#1", "ProfilerStep#2"]
    assert trace["distributedInfo"]["rank"] == 0 and trace["distributedInfo"]["world_size"] == 1
    lines = [json.loads(x) for x in (tmp_path / "steps/rank-0.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(5))
    assert lines[1]["mem_allocated_bytes"] == 100 and lines[1]["mem_peak_bytes"] == 300
    assert all(x["duration_ms"] >= 0 for x in lines)


def test_profile_api_records_oom_and_reraises(tmp_path: Path) -> None:
    with (
        pytest.raises(torch.OutOfMemoryError),
        zdiag.profile(out=tmp_path, wait=0, warmup=0, active=3, profile_memory=True) as prof,
    ):
        x = torch.randn(64, 64, requires_grad=True)
        (x @ x).sum().backward()
        prof.step()
        raise torch.OutOfMemoryError("emulated: tried to allocate 1 GiB")
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["exit"]["oom"] is True and m["ranks"][0]["oom"] is True
    rank = m["ranks"][0]
    assert rank["oom_record"] and rank["trace"] and rank["memory_timeline"]
    record = json.loads((tmp_path / rank["oom_record"]).read_text())
    assert record["error_type"] == "OutOfMemoryError" and record["step"] == 1
    assert record["profiler_window_open"] is True
    timeline = json.load(gzip.open(tmp_path / rank["memory_timeline"]))
    assert isinstance(timeline, list) and len(timeline) == 2


def test_collector_error_is_contained_and_reported_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def bad_reader() -> tuple[int, int, int]:
        raise RuntimeError("reader broke")

    runinfo.set_memory_reader(bad_reader)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with zdiag.profile(out=tmp_path, enabled=False, auto_step=True):
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    err = capsys.readouterr().err
    assert err.count("reader broke") == 1
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["ranks"][0]["steps"] == 3 and m["ranks"][0]["trace"] is None
    assert len(m["ranks"][0]["collector_errors"]) == 1


def test_auto_step_counts_one_step_per_iteration_with_two_optimizers(tmp_path: Path) -> None:
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    with zdiag.profile(out=tmp_path, enabled=False, auto_step=True) as prof:
        for _ in range(4):
            b(a(torch.randn(2, 4))).sum().backward()
            opt_a.step()
            opt_b.step()
    assert prof.step_num == 4


def test_profiler_started_late_keeps_step_numbers_aligned(tmp_path: Path) -> None:
    # No nn.Module forward at all: the profiler starts at the end of step 0 and must still name
    # step n ProfilerStep#n.
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = torch.optim.SGD([w], lr=0.01)
    with zdiag.profile(out=tmp_path, wait=2, warmup=1, active=2, auto_step=True):
        for _ in range(6):
            (w @ w).sum().backward()
            opt.step()
    m = json.loads((tmp_path / "manifest.json").read_text())
    trace = json.load(gzip.open(tmp_path / m["ranks"][0]["trace"]))
    steps = sorted(
        {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    )
    assert steps == ["ProfilerStep#3", "ProfilerStep#4"]


def test_custom_loop_example_writes_a_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import runpy
    import sys

    from conftest import REPO_ROOT

    monkeypatch.setattr(sys, "argv", ["custom_loop.py", "--out", str(tmp_path), "--steps", "5"])
    runpy.run_path(str(REPO_ROOT / "examples" / "custom_loop.py"), run_name="__main__")
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["ranks"][0]["steps"] == 5 and m["ranks"][0]["trace"]


def test_nvtx_ranges_are_off_without_cuda() -> None:
    from zdiag.collectors.nvtx import StepRanges

    ranges = StepRanges(enabled=True)
    assert ranges.enabled == torch.cuda.is_available()
    ranges.begin(0)
    ranges.end()
    assert StepRanges(enabled=False).enabled is False


def test_user_profiler_takes_precedence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        torch.profiler.profile(),
        zdiag.profile(out=tmp_path / "run", wait=0, warmup=0, active=1, auto_step=True),
    ):
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert "runs torch.profiler itself" in capsys.readouterr().err
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["ranks"][0]["steps"] == 2 and m["ranks"][0]["trace"] is None


def test_failed_trace_export_never_stops_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def disk_full(self: object, path: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", disk_full)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with zdiag.profile(out=tmp_path, wait=0, warmup=1, active=1, auto_step=True) as prof:
        for _ in range(6):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert prof.step_num == 6
    err = capsys.readouterr().err
    assert err.count("No space left on device") == 1 and "training continues" in err
    m = json.loads((tmp_path / "manifest.json").read_text())
    rank = m["ranks"][0]
    assert rank["trace"] is None and rank["steps"] == 6 and rank["exit_code"] == 0
    assert not list((tmp_path / "traces").iterdir())  # no temp file left behind


def test_profile_api_refuses_a_finished_run(tmp_path: Path) -> None:
    with zdiag.profile(out=tmp_path, enabled=False) as prof:
        prof.step()
    before = (tmp_path / "steps/rank-0.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds a finished run"):
        with zdiag.profile(out=tmp_path, enabled=False) as prof:
            prof.step()
    assert (tmp_path / "steps/rank-0.jsonl").read_text() == before


def test_default_out_dir_ignores_torchruns_placeholder_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert default_out_dir().name != "profile-none"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    assert default_out_dir().name == "profile-job7"


def test_cpu_memory_reading_is_the_process_rss_when_no_reader_is_registered() -> None:
    import sys

    from zdiag.collectors import memory, runinfo

    if not sys.platform.startswith("linux"):
        pytest.skip("the RSS fallback reads /proc (Linux)")
    runinfo.set_memory_reader(None)
    before, reserved, peak = memory.read_device_memory(cuda_available=False)
    assert before is not None and peak is not None and reserved is None
    assert peak >= before > 10 * 2**20  # an interpreter with torch loaded holds far more
    block = bytearray(100 * 2**20)  # touched pages: resident
    after, _, peak_after = memory.read_device_memory(cuda_available=False)
    assert after - before >= 90 * 2**20
    assert peak_after is not None and peak_after >= after
    del block


def test_device_is_the_one_this_process_initialized(monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU machine: CUDA is available, but only a rank that initialized it trains on it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert memory.device_in_use() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert memory.device_in_use() == "cuda:1"


def test_manifest_device_on_a_gpu_machine_training_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # CUDA never initialized
    with zdiag.profile(out=tmp_path, enabled=False, nvtx=False) as prof:
        part = json.loads((tmp_path / "manifest.d" / "rank-0.json").read_text())
        assert part["device"] is None  # not known while the rank runs without CUDA
        prof.step()
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["device"] == "cpu" and m["ranks"][0]["device"] == "cpu"


def test_timeline_failure_cites_the_torch_issue_only_for_its_assertion() -> None:
    # pytorch/pytorch#167838 explains torch's "version mismatch" assertion; any other failure of
    # the export (a disk error, an API change, MemoryError) is reported as it is.
    known = memtimeline.failure_reason(
        AssertionError("version mismatch: {TensorKey(id=3): (1, 2)}, " + "edge " * 500)
    )
    assert known.startswith("AssertionError: version mismatch; ")
    assert "pytorch/pytorch#167838" in known and "TensorKey" not in known
    plain = {
        OSError(28, "No space left on device"): "OSError: [Errno 28] No space left on device",
        AttributeError("no attribute 'export_memory_timeline'"): (
            "AttributeError: no attribute 'export_memory_timeline'"
        ),
        MemoryError(): "MemoryError",
        AssertionError("another\ncheck failed"): "AssertionError: another check failed",
    }
    for exc, reason in plain.items():
        assert memtimeline.failure_reason(exc) == reason
    long = memtimeline.failure_reason(RuntimeError("x" * 1000))
    assert len(long) == len("RuntimeError: ") + memtimeline.MAX_REASON_CHARS
    assert long.endswith("...")


@pytest.mark.parametrize(
    ("error", "cites_issue"),
    [
        (OSError(28, "No space left on device"), False),
        (AssertionError("version mismatch for input: expected 1, got 2"), True),
    ],
)
def test_totals_only_timeline_says_why_torch_failed(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
    cites_issue: bool,
) -> None:
    def failing_export(prof: object, tmp: str, device: str) -> None:
        raise error

    monkeypatch.setattr(memtimeline, "_torch_export", failing_export)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with zdiag.profile(out=tmp_path, wait=0, warmup=0, active=1, profile_memory=True) as prof:
        for _ in range(2):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    rank = json.loads((tmp_path / "manifest.json").read_text())["ranks"][0]
    assert rank["memory_timeline"] and rank["memory_timeline_categorized"] is False
    [message] = rank["collector_errors"]
    assert "could not sort this rank's memory" in message
    assert f"{type(error).__name__}: " in message
    assert ("pytorch/pytorch#167838" in message) is cites_issue
    assert ("pytorch/pytorch#167838" in capsys.readouterr().err) is cites_issue


def test_profile_api_refuses_an_out_it_cannot_write(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    ran = False
    with pytest.raises(ConfigError, match=r"cannot be written \(Not a directory\)"):
        with zdiag.profile(out=tmp_path / "afile" / "run", enabled=False):
            ran = True
    assert not ran
