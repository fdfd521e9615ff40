"""`zdiag run` usage errors: one line on stderr, exit 2, nothing launched, nothing written."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zdiag.cli import main
from zdiag.collectors.config import FLAG, CollectorConfig
from zdiag.commands.run import RunCommand


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('should not run')\n")
    return path


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run"], "give a training script"),
        (["run", "missing_train.py"], "not found"),
        (["run", "--profile-steps", "1:x", "SCRIPT"], "--profile-steps"),
        (["run", "--profile-steps", "1:1:0", "SCRIPT"], "ACTIVE must be at least 1"),
        (["run", "--nproc-per-node", "100000", "SCRIPT"], "more ranks than this node can run"),
        (["run", "--nproc-per-node", "0", "SCRIPT"], "--nproc-per-node must be at least 1"),
        (["run", "--nproc-per-node", "two", "SCRIPT"], "whole number"),
        (["run", "--nnodes", "2", "SCRIPT"], "needs --rdzv-endpoint"),
        (
            ["run", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "SCRIPT"],
            "--node-rank",
        ),
        (["run", "--rdzv-endpoint", "nohost", "SCRIPT"], "HOST:PORT"),
        (["run", "--monitor", "localhost:99999", "SCRIPT"], "--monitor"),
        (["run", "--no-profile", "--profile-memory", "SCRIPT"], "--no-profile"),
        (["run", "--harness", "--dim", "30", "--heads", "4"], "must be divisible by --heads"),
        (["run", "--harness", "--steps", "0"], "--steps must be a positive integer"),
    ],
)
def test_wrong_usage_is_one_line_and_exit_2(
    argv: list[str], expected: str, script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = [str(script) if a == "SCRIPT" else a for a in argv]
    argv = [argv[0], "--out", str(out), *argv[1:]]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("zdiag run: error: ") and expected in lines[0]
    assert "should not run" not in captured.out
    assert not out.exists()


def test_existing_finished_run_is_refused(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    assert main(["run", "--out", str(out), str(script)]) == 2
    assert "already holds a finished run" in capsys.readouterr().err


@pytest.mark.slow  # starts a program
def test_wrong_usage_from_the_real_command_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zdiag",
            "run",
            "--out",
            str(tmp_path / "r"),
            str(tmp_path / "nope.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.count("\n") == 1 and "nope.py" in proc.stderr and "Traceback" not in proc.stderr
    )


def test_bad_harness_option_is_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        main(["run", "--out", str(out), "--harness", "--wrap", "bogus"])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zdiag run --harness: error: ")
    assert "--wrap" in lines[0]
    assert not out.exists()


def _read_only_mount(path: Path) -> bool:
    """Mount a read-only tmpfs at `path` (root only); False where that is not possible."""
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


@pytest.mark.slow  # starts a program
@pytest.mark.parametrize("case", ["file in the path", "/proc", "no permission"])
def test_unusable_out_is_a_user_error_before_training(
    case: str, script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    mounted: Path | None = None
    if case == "file in the path":
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" / "run"
    elif case == "/proc":
        out = Path("/proc") / f"zdiag-run-{os.getpid()}"
    elif os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        out = locked / "run"
    else:  # root ignores permission bits: a read-only filesystem refuses it too
        mounted = tmp_path / "ro"
        if not _read_only_mount(mounted):
            pytest.skip("root without a way to mount a read-only tmpfs")
        out = mounted / "run"
    try:
        assert main(["run", "--no-profile", "--out", str(out), str(script)]) == 2
    finally:
        if mounted is not None:
            subprocess.run(["umount", str(mounted)], check=False)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("zdiag run: error: --out ") and "cannot be written" in lines[0]
    assert not marker.exists()  # the training never started
    assert not out.exists()


@pytest.mark.slow  # starts a program
def test_unusable_out_from_the_real_command_line(script: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "zdiag", "run", "--out", str(tmp_path / "afile" / "r"), str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Not a directory" in proc.stderr
    assert "Traceback" not in proc.stderr and "should not run" not in proc.stdout


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    RunCommand().add_arguments(parser)
    return parser


def test_run_options_come_from_the_collector_config() -> None:
    parser = _run_parser()
    flagged = {
        f.metadata[FLAG].name for f in dataclasses.fields(CollectorConfig) if FLAG in f.metadata
    }
    options = {o for action in parser._actions for o in action.option_strings}
    assert flagged == {
        "--profile-steps",
        "--no-profile",
        "--record-shapes",
        "--profile-memory",
        "--with-stack",
        "--nvtx",
        "--hang-timeout",
    }
    assert flagged <= options and "--no-nvtx" in options
    assert CollectorConfig.from_flags(vars(parser.parse_args(["train.py"]))) == CollectorConfig()
    argv = ["--profile-steps", "2:0:5", "--no-profile", "--no-nvtx", "--hang-timeout", "7", "t.py"]
    config = CollectorConfig.from_flags(vars(parser.parse_args(argv)))
    expected = CollectorConfig(wait=2, warmup=0, active=5, profile=False, nvtx=False)
    assert config == dataclasses.replace(expected, hang_timeout_s=7.0)
    argv = ["--record-shapes", "--profile-memory", "--with-stack", "t.py"]
    config = CollectorConfig.from_flags(vars(parser.parse_args(argv)))
    assert config.record_shapes and config.profile_memory and config.with_stack
