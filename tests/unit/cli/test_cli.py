"""The CLI's one exit path: help and version work, mistakes are one line and non-zero."""

from __future__ import annotations

import subprocess
import sys

import pytest

from zdiag import __version__
from zdiag.cli import COMMANDS, main


def zdiag(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zdiag", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # starts a program
def test_version() -> None:
    res = zdiag("--version")
    assert res.returncode == 0
    assert res.stdout.strip() == f"zdiag {__version__}"


@pytest.mark.slow  # starts a program
def test_no_command_prints_help_and_fails() -> None:
    res = zdiag()
    assert res.returncode == 2
    assert "COMMAND" in res.stderr


@pytest.mark.slow  # starts a program
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_subcommand_has_help(command: str) -> None:
    res = zdiag(command, "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: zdiag {command}")


@pytest.mark.slow  # starts a program
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_unknown_option_is_one_line_error(command: str) -> None:
    res = zdiag(command, "--no-such-option")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "--no-such-option" in lines[0]
    assert "Traceback" not in res.stderr


@pytest.mark.slow  # starts a program
def test_unknown_command_is_one_line_error() -> None:
    res = zdiag("frobnicate")
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1
    assert "frobnicate" in res.stderr


def test_internal_errors_are_one_line_without_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from zdiag.commands import analyze

    def boom(args: object) -> int:
        raise RuntimeError("kaput")

    monkeypatch.setattr(analyze.COMMAND, "run", boom)
    assert main(["analyze", "x.json"]) == 70
    err = capsys.readouterr().err
    assert "RuntimeError: kaput" in err and "Traceback" not in err
    with pytest.raises(RuntimeError):
        main(["--debug", "analyze", "x.json"])
