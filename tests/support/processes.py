"""Real processes for the integration tests: `zdiag ARGS` (or any command) in a fresh
interpreter, from the repository root, with its output captured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO_ROOT

TIMEOUT_S = 300
"""A 4-rank gloo run of an example takes 15-60 s on a busy 2-core machine."""


def run(
    *args: str,
    cwd: Path = REPO_ROOT,
    timeout: float = TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `args` with this repository importable and one OpenMP thread per process (`env`
    overrides: a PYTHONPATH that also holds a library installed beside the venv)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def zdiag(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    """Run `zdiag ARGS` in a fresh interpreter."""
    return run(sys.executable, "-m", "zdiag", *args, cwd=cwd)
