"""Who a rank is, and what it writes about itself: its manifest part and its OOM record.

The part (`manifest.d/rank-<N>.json`) is written when the session starts, whenever something
worth keeping happens (a trace written, run info recorded, a signal, a hang, an OOM), and at the
end; `zdiag run` merges the parts into `manifest.json`.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import memory, rundir, runinfo
from .config import CollectorConfig
from .error_log import ErrorLog
from .failure_point import FailurePoint, failure_point
from .fsio import write_json_atomically
from .manifest import hostname, process_env_info, utc_now_iso
from .profiler_window import ProfilerWindow
from .run_records import OomRecord, RankEntry, RankPart


@dataclass(frozen=True)
class RankIdentity:
    """This process's place in the job, read once from torchrun's environment."""

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    host: str
    command: tuple[str, ...]
    started_at: str

    @classmethod
    def of_this_process(cls, command: list[str] | None = None) -> RankIdentity:
        """This rank (`command`: the training's command line, default this interpreter's)."""
        env = process_env_info()
        return cls(
            rank=env["rank"],
            local_rank=env["local_rank"],
            node_rank=env["node_rank"],
            world_size=env["world_size"],
            host=hostname(),
            command=tuple(command if command is not None else [sys.executable, *sys.argv]),
            started_at=utc_now_iso(),
        )


def torch_versions() -> dict[str, str | None]:
    """Python, torch, CUDA and NCCL versions (None where not present)."""
    nccl: str | None = None
    try:
        if torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception:
        nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
    }


def cpu_set_text() -> str | None:
    """The CPU cores this process may run on, as ranges ("0-3,8"); None where the OS does not
    say (no `sched_getaffinity`: macOS, Windows)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    ranges: list[list[int]] = []
    for c in cores:
        if ranges and c == ranges[-1][1] + 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) or None


def write_rank_part(
    run_dir: Path,
    who: RankIdentity,
    config: CollectorConfig,
    *,
    backend: str | None,
    ended: bool,
    **entry: Any,
) -> None:
    """Write rank `who`'s manifest part: its `entry` fields (what the session's parts know)
    plus its identity, device and the run-level facts it knows."""
    device = memory.device_in_use()
    part = RankPart(
        entry=RankEntry(
            rank=who.rank,
            local_rank=who.local_rank,
            node_rank=who.node_rank,
            host=who.host,
            pid=os.getpid(),
            # cuda:<index> once it initialized CUDA, cpu if it finished without; None while
            # that is not known yet (a part written before CUDA).
            device=None if device == "cpu" and not ended else device,
            cpu_set=cpu_set_text(),
            started_at=who.started_at,
            ended_at=utc_now_iso() if ended else None,
            **entry,
        ),
        world_size=who.world_size,
        command=who.command,
        cwd=os.getcwd(),
        backend=backend,
        versions=torch_versions(),
        profile=config.manifest_profile(),
        run_info=runinfo.current_run_info(),
    )
    write_json_atomically(rundir.rank_part_path(run_dir, who.rank), part.to_json())


def capture_out_of_memory(
    exc: BaseException,
    run_dir: Path,
    who: RankIdentity,
    step: int,
    window: ProfilerWindow,
    errors: ErrorLog,
    model_id: int | None = None,
) -> bool:
    """At an out-of-memory error, write the memory data first: the profiler window (trace and
    timeline), the CUDA snapshot at the failure, the OOM record (with the modules whose forward
    was running, under the model `model_id` names). Whether the record was written."""
    allocated, reserved, peak = (
        errors.guard("memory reading", memory.read_device_memory, torch.cuda.is_available())
        or memory.NO_READING
    )
    where = errors.guard("failure point", failure_point, exc, model_id) or FailurePoint()
    window_open = window.stop_for_oom()
    if memory.cuda_in_use():  # replaces the window's snapshot: the state at the failure
        window.dump_snapshot()
    record = OomRecord(
        rank=who.rank,
        host=who.host,
        step=step,
        time_unix=time.time(),
        error_type=type(exc).__name__,
        error=str(exc)[:4000],
        mem_allocated_bytes=allocated,
        mem_reserved_bytes=reserved,
        mem_peak_bytes=peak,
        memory_budget_bytes=runinfo.memory_budget_bytes(runinfo.current_run_info()),
        profiler_window_open=window_open,
        modules=where.modules,
        in_backward=where.in_backward,
    )
    path = run_dir / rundir.oom_relpath(who.rank)
    errors.guard("OOM record", memory.write_oom_record, path, record)
    return path.is_file()
