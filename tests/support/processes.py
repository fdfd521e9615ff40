"""Real processes for the integration tests: `zdiag ARGS` (or any command) in a fresh
interpreter, from the repository root, with its output captured."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def two_nodes(script: Path, out: Path, *args: str, nproc_per_node: int = 2) -> list[str]:
    """Record `script ARGS` with two `zdiag run --nnodes 2 --node-rank K` launchers of
    `nproc_per_node` ranks each on localhost: one rendezvous, one run directory `out`, the two
    "nodes" told apart by the node rank each launcher records. Asserts both exit 0; their
    outputs (node 0's holds rank 0's prints)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "zdiag", "run", "--nnodes", "2"]
    launch += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", out.name]
    launch += ["--nproc-per-node", str(nproc_per_node), "--out", str(out)]
    logs = [out.parent / f"{out.name}-node-{k}.log" for k in (0, 1)]
    with contextlib.ExitStack() as files:
        launchers = [  # output to files: a full pipe would stall one launcher, hang the other
            subprocess.Popen(
                [*launch, "--node-rank", str(k), str(script), *args],
                cwd=REPO_ROOT,
                env=env,
                stdout=files.enter_context(log.open("w")),
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the launcher and its ranks
            )
            for k, log in enumerate(logs)
        ]
        try:
            codes = [p.wait(timeout=TIMEOUT_S) for p in launchers]
        finally:  # a launcher timed out: leave neither one nor any of their ranks behind
            for p in launchers:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    texts = [log.read_text() for log in logs]
    for code, text in zip(codes, texts, strict=True):
        assert code == 0, text[-3000:]
    return texts


def analyze_json(run_dir: Path) -> dict[str, Any]:
    """`zdiag analyze --json RUN_DIR`, parsed."""
    proc = zdiag("analyze", "--json", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc
