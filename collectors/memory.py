"""Device memory readings, the CUDA allocator history, and what is written on out-of-memory."""

from __future__ import annotations

import os
import pickle
import resource
from pathlib import Path
from typing import Any

import torch

from . import runinfo
from .fsio import write_atomically, write_json_atomically
from .run_records import OomRecord

MemoryReading = tuple[int | None, int | None, int | None]
NO_READING: MemoryReading = (None, None, None)


def cuda_in_use() -> bool:
    """Whether this process has initialized CUDA (checking never initializes it)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def device_in_use() -> str:
    """`cuda:<current device>` once this process has initialized CUDA, else `cpu`.

    Asking never initializes CUDA. A rank on a GPU machine that trains on the CPU (`--device cpu`)
    never initializes it, so it reads `cpu`. The index is `torch.cuda.current_device()`: a script
    that never calls `torch.cuda.set_device` (e.g. `model.to(f"cuda:{local_rank}")`) reads
    `cuda:0` whichever GPU it trains on (docs/run-dir.md, `device`).
    """
    return f"cuda:{torch.cuda.current_device()}" if cuda_in_use() else "cpu"


def read_device_memory(cuda_available: bool | None = None) -> MemoryReading:
    """(allocated, reserved, peak) in bytes on the current CUDA device.

    The peak is `torch.cuda.max_memory_allocated()`, never reset here (the script's own readings
    stay right). On CPU, PyTorch keeps no allocator statistics: the reader registered with
    `runinfo.set_memory_reader` answers if there is one, else the process's resident set size
    (allocated = current RSS, reserved = None, peak = peak RSS), or (None, None, None) where the
    platform has no /proc.
    `cuda_available` saves the per-step `torch.cuda.is_available()` call when the caller knows it.
    """
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not (cuda_available and torch.cuda.is_initialized()):
        reader = runinfo.memory_reader()
        if reader is None:
            return _process_rss()
        try:
            allocated, reserved, peak = reader()
        except Exception:
            runinfo.set_memory_reader(None)
            raise
        return _opt_int(allocated), _opt_int(reserved), _opt_int(peak)
    allocated = int(torch.cuda.memory_allocated())
    reserved = int(torch.cuda.memory_reserved())
    peak = int(torch.cuda.max_memory_allocated())
    return allocated, reserved, peak


def memory_source(cuda_available: bool) -> str:
    """What `read_device_memory` reads now: "device" (CUDA's allocator: the bytes tensors hold),
    "reader" (one registered with `runinfo.set_memory_reader`) or "process" (the process's RSS,
    which also holds the allocators' cached and freed memory)."""
    if cuda_available and torch.cuda.is_initialized():
        return "device"
    return "reader" if runinfo.memory_reader() is not None else "process"


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_statm: tuple[int, int] | None = None  # (pid that opened it, fd of /proc/self/statm)


def _process_rss() -> MemoryReading:
    """(current RSS, None, peak RSS) of this process in bytes; one pread of /proc/self/statm.

    The file stays open, so a step pays one system call (about a microsecond) instead of an
    open/read/close; it is reopened in a forked child, whose /proc/self differs. Where /proc is
    missing (not Linux) the answer is (None, None, None).
    """
    global _statm
    try:
        pid = os.getpid()
        if _statm is None or _statm[0] != pid:
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY))
        current = int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return NO_READING
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return current, None, max(current, peak)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def start_cuda_history(max_entries: int) -> bool:
    """Record CUDA allocations with stacks (bounded to `max_entries`); False unless CUDA is in use.

    A rank that has not initialized CUDA (a CPU run on a GPU machine) is left alone: turning the
    history on would create a CUDA context on device 0 for nothing.
    """
    if not cuda_in_use():
        return False
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    return True


def stop_cuda_history() -> None:
    """Stop recording CUDA allocation history (no-op unless CUDA is in use)."""
    if cuda_in_use():
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_cuda_snapshot(path: str | Path) -> bool:
    """Write the CUDA memory snapshot (pickle, as `torch.cuda.memory._dump_snapshot`) atomically."""
    if not cuda_in_use():
        return False
    snapshot = torch.cuda.memory._snapshot()

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            pickle.dump(snapshot, f)

    write_atomically(path, write, suffix=".pickle")
    return True


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` (or the exception it was raised from) is a PyTorch out-of-memory error."""
    oom_types: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError,)
    if hasattr(torch, "OutOfMemoryError"):
        oom_types = (torch.OutOfMemoryError, *oom_types)
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 5:
        if isinstance(current, oom_types):
            return True
        current = current.__cause__ or current.__context__
        seen += 1
    return False


def write_oom_record(path: str | Path, record: OomRecord) -> None:
    """Write what was known when the rank ran out of memory (JSON, atomically)."""
    write_json_atomically(path, record.to_json())
