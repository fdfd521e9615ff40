"""`--tui` refuses, with one sentence and exit 2, where it cannot work (in real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.report import encode_report
from zdiag.render._sample import sample_report

ROOT = REPO_ROOT
RUN = ROOT / "sample_traces" / "none"


def _zdiag(*args: str, stdin: int | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "zdiag", *args],
        capture_output=True,
        stdin=stdin,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.mark.slow  # starts a program
@pytest.mark.parametrize("command", ["analyze", "render"])
def test_tui_without_a_terminal_is_refused(command: str, tmp_path: Path) -> None:
    target = str(RUN)
    if command == "render":
        saved = tmp_path / "r.json"
        saved.write_bytes(encode_report(sample_report(ranks=1, steps=1)))
        target = str(saved)
    done = _zdiag(command, target, "--tui", stdin=subprocess.DEVNULL)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert "--tui needs a terminal" in err and len(err.strip().splitlines()) == 1
    assert done.stdout == b""  # no escape codes written into the pipe


@pytest.mark.slow  # starts a program
def test_tui_with_json_to_stdout_is_refused() -> None:
    done = _zdiag("analyze", str(RUN), "--tui", "--json")
    assert done.returncode == 2
    assert "--tui and --json both use standard output" in done.stderr.decode()
    assert done.stdout == b""
