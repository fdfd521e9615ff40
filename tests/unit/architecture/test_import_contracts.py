"""`make lint` runs import-linter's contracts (pyproject.toml, [tool.importlinter]): they hold on
the project, and adding a forbidden import or an import circle breaks them.

Each case copies the source folders (with the zdiag/analyzers, collectors, tui links) to a
temporary folder, adds one import there, and runs `lint-imports` on the copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.slow  # starts lint-imports (a few seconds each)

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the sources and pyproject.toml that `lint-imports` analyzes instead."""
    if not LINT_IMPORTS.exists():
        pytest.skip("import-linter is not installed (pip install '.[dev]')")
    for name in ("zdiag", "analyzers", "collectors", "tui"):
        shutil.copytree(
            REPO_ROOT / name, tmp_path / name, symlinks=True, ignore=shutil.ignore_patterns("*.pyc")
        )
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_the_contracts_hold_on_the_project(tree: Path) -> None:
    done = _lint(tree)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "0 broken" in done.stdout


def test_a_collector_importing_the_analysis_breaks_lint(tree: Path) -> None:
    _append(tree / "collectors" / "steplog.py", "from ..analyzers import report  # noqa")
    done = _lint(tree)
    assert done.returncode == 1
    assert "collectors (inside training) import neither the analysis nor the UI BROKEN" in (
        done.stdout
    )


def test_an_import_circle_breaks_lint(tree: Path) -> None:
    # report.py is imported by most of the analysis; importing the summary back closes a circle
    _append(tree / "analyzers" / "report.py", "from .rank import summary  # noqa")
    done = _lint(tree)
    assert done.returncode == 1
    assert "no import circle among sibling modules or packages BROKEN" in done.stdout


def test_a_stage_importing_a_stage_above_it_breaks_lint(tree: Path) -> None:
    # the map (rank/) must not reach the reduce (run/)
    _append(tree / "analyzers" / "rank" / "steps.py", "from ..run import crossrank  # noqa")
    done = _lint(tree)
    assert done.returncode == 1
    assert "the analysis stages: each imports only the stages below it BROKEN" in done.stdout


def test_the_live_training_side_importing_the_analysis_breaks_lint(tree: Path) -> None:
    # the wire is imported inside every rank: it must not pull the analysis in
    _append(tree / "zdiag" / "live" / "wire.py", "from zdiag.analyzers import report  # noqa")
    done = _lint(tree)
    assert done.returncode == 1
    assert "live stream (wire, auth, publisher, receiver) imports no analysis or UI BROKEN" in (
        done.stdout
    )


def test_the_live_package_importing_the_tui_breaks_lint(tree: Path) -> None:
    # the monitor's model is drawn by the Textual app, never the reverse
    _append(tree / "zdiag" / "live" / "state.py", "from zdiag.tui import monitor_text  # noqa")
    done = _lint(tree)
    assert done.returncode == 1
    assert "the live package never imports the UI or the CLI BROKEN" in done.stdout
