"""`zdiag completion`: scripts for bash, zsh and fish that know every subcommand and option."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from zdiag.cli import COMMANDS, main
from zdiag.completion import SHELLS, completion_script


def _bash_complete(script: Path, *words: str) -> list[str]:
    """What the bash function offers for `zdiag WORDS...` (the last word being completed)."""
    line = " ".join(["zdiag", *words])
    program = (
        f"source {script}; COMP_WORDS=({line}); COMP_CWORD={len(words)}; "
        'COMP_LINE="' + line + '"; _zdiag; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    done = subprocess.run(
        ["bash", "--norc", "-c", program], capture_output=True, text=True, check=True
    )
    return [w for w in done.stdout.splitlines() if w]


@pytest.fixture
def bash_script(tmp_path: Path) -> Path:
    path = tmp_path / "zdiag.bash"
    path.write_text(completion_script("bash"))
    return path


def test_the_command_prints_each_script(capsys: pytest.CaptureFixture[str]) -> None:
    for shell in SHELLS:
        assert main(["completion", shell]) == 0
        out = capsys.readouterr().out
        assert out == completion_script(shell)
        for name in COMMANDS:
            assert name in out
    with pytest.raises(SystemExit) as exit_:
        main(["completion", "tcsh"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow  # starts a program
@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_completes_commands_options_and_choices(bash_script: Path, tmp_path: Path) -> None:
    assert "analyze" in _bash_complete(bash_script, "an")
    assert _bash_complete(bash_script, "analyze", "--fail") == ["--fail-on"]
    assert _bash_complete(bash_script, "analyze", "--fail-on", "") == ["warning", "critical"]
    assert "--perfetto" in _bash_complete(bash_script, "render", "--p")
    assert _bash_complete(bash_script, "completion", "") == list(SHELLS)
    assert _bash_complete(bash_script, "demo", "--misconfig", "miss") == ["missing-overlap"]
    (tmp_path / "report-abc.json").write_text("{}")
    assert _bash_complete(bash_script, "render", str(tmp_path / "report-a")) == [
        str(tmp_path / "report-abc.json")
    ]


@pytest.mark.slow  # starts a program
@pytest.mark.parametrize("shell", ["zsh", "fish", "bash"])
def test_scripts_parse_in_their_shell(shell: str, tmp_path: Path) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    path = tmp_path / f"zdiag.{shell}"
    path.write_text(completion_script(shell))
    check = {"bash": ["bash", "-n"], "zsh": ["zsh", "-n"], "fish": ["fish", "--no-execute"]}
    done = subprocess.run([*check[shell], str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_help_shows_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["analyze", "--help"], ["run", "--help"], ["monitor", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert "examples:\n  zdiag " in out


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_completes_commands_and_choices(tmp_path: Path) -> None:
    path = tmp_path / "zdiag.fish"
    path.write_text(completion_script("fish"))
    program = f'source {path}; complete -C "zdiag analyze --fail-on "; complete -C "zdiag an"'
    done = subprocess.run(["fish", "-c", program], capture_output=True, text=True, check=True)
    offered = [line.split("\t")[0] for line in done.stdout.splitlines()]
    assert sorted(offered) == ["analyze", "critical", "warning"]
