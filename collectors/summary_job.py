"""Start a rank's in-job summary: a background process, at the lowest CPU priority.

Right after a rank exports its trace, `start_summary(trace)` starts
`nice -n 19 python -m zdiag.analyzers.engine.summarize_trace TRACE OUT` (OUT: `rundir.summary_path_for`)
in its own session and returns at once: the training process never decodes the trace, and
collectors never import the analyzers (the module is named, not imported). The summary is only
a shortcut for `zdiag analyze`: when the process fails or has not finished, the trace is decoded
instead. `ZDIAG_INJOB_SUMMARY=0` turns it off.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from .child_cpu import ignore_child
from .rundir import summary_path_for

SUMMARIZER_MODULE = "zdiag.analyzers.engine.summarize_trace"
ENV_SWITCH = "ZDIAG_INJOB_SUMMARY"


def summary_command(trace: Path) -> list[str]:
    """The command that summarizes `trace` (under `nice -n 19` when `nice` exists)."""
    cmd = [sys.executable, "-m", SUMMARIZER_MODULE, str(trace), str(summary_path_for(trace))]
    nice = shutil.which("nice")
    return [nice, "-n", "19", *cmd] if nice else cmd


def start_summary(trace: Path) -> subprocess.Popen[bytes] | None:
    """Start the summary process for `trace`; None when turned off."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "off", "no", "false"):
        return None
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.Popen(
        summary_command(trace),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    ignore_child(proc.pid)  # zdiag's CPU, not the training's (child_cpu.py)
    return proc
