"""Finding a run's inputs: trace files, run directories, folders of per-rank traces.

`discover(paths)` walks what the user named (files, run directories, folders of traces; hidden
and temporary files skipped, links and FIFOs among the traces refused) and sorts the files by
what they are (traces, memory timelines, CUDA snapshots) with the input registry;
`manifest_ranks` reads which trace is which rank from a run manifest; `json_bytes` is a trace's
JSON size (for the decode engines' sizing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from zdiag.errors import InputError

from ...collectors.run_records import Manifest
from ...collectors.rundir import (
    MANIFEST,
    MEMORY_DIR,
    OOM_RECORD_GLOB,
    TRACES_DIR,
    is_run_dir,
)
from .cuda_snapshot import is_snapshot_file
from .loader import TRACE_SUFFIXES, is_trace_name
from .registry import reader_for
from .run_dir import read_manifest, run_file


def manifest_ranks(
    manifest: Manifest, run_dir: Path, warnings: list[str] | None = None
) -> dict[Path, int]:
    """Trace path (resolved) -> rank from the manifest's rank entries.

    A trace path that leads outside the run directory (through a link) is not used, with a
    warning in `warnings`; one naming no file is skipped (the trace may have been moved).
    """
    found: dict[Path, int] = {}
    root = run_dir.resolve()
    for entry in manifest.ranks:
        if entry.trace is None:
            continue
        path = (root / entry.trace).resolve()
        if path != root and root not in path.parents:
            if warnings is not None:
                warnings.append(
                    f"{run_dir / MANIFEST}: rank {entry.rank}'s trace {entry.trace!r} points "
                    "outside the run directory; it is not used"
                )
            continue
        found[path] = entry.rank
    return found


@dataclass
class Inputs:
    """What `discover` found: traces, explicit memory timelines, the manifest and run dir, and
    warnings about what was left out (unreadable folders, files that are not regular files)."""

    traces: list[Path]
    memory: list[Path]
    manifest: Manifest | None
    run_dir: Path | None
    warnings: list[str] = field(default_factory=list)
    snapshots: list[Path] = field(default_factory=list)


def _oom_records(run_dir: Path) -> list[Path]:
    """The per-rank out-of-memory records `zdiag run` leaves in a run directory."""
    return sorted((run_dir / MEMORY_DIR).glob(OOM_RECORD_GLOB))


def _recorded_failure(manifest: Manifest | None) -> bool:
    """Whether the manifest records a rank that raised (not out of memory: its records say
    more), hung, or was ended by a signal: the `crash` and `hang` findings read it without any
    trace (a script that fails before the profiler's first active step)."""
    if manifest is None:
        return False
    return any(e.raised or e.hang is not None or e.ended_by is not None for e in manifest.ranks)


def _walk_traces(folder: Path, warnings: list[str]) -> list[Path]:
    """Trace-named files anywhere under `folder`; an unreadable subfolder is a warning."""

    def unreadable(exc: OSError) -> None:
        where = exc.filename or folder
        warnings.append(
            f"{where}: folder not readable ({exc.strerror or exc}); its files are skipped"
        )

    found = []
    for dirpath, _dirs, names in os.walk(folder, onerror=unreadable):
        for name in names:
            path = Path(dirpath) / name
            if is_trace_name(path.name) and path.is_file():
                found.append(path)
    return sorted(found)


def _run_dir_traces(run_dir: Path, warnings: list[str]) -> list[Path]:
    """The trace files in RUN_DIR/traces/: regular files inside the run directory only."""
    traces = run_dir / TRACES_DIR
    try:
        names = sorted(x for x in traces.iterdir() if is_trace_name(x.name))
    except FileNotFoundError:
        return []
    except OSError as exc:
        warnings.append(f"{traces}: folder not readable ({exc.strerror or exc}); no trace read")
        return []
    found = []
    for path in names:
        try:
            run_file(run_dir, path.relative_to(run_dir))
        except InputError as exc:
            warnings.append(f"{exc.message.rstrip('.')}; it is skipped")
            continue
        found.append(path)
    return found


def discover(paths: list[Path]) -> Inputs:
    """The inputs under the given paths; InputError when none is usable.

    A run directory that failed before the profiler wrote any trace is usable: its
    out-of-memory records, or the manifest's record of the ranks that raised, hung or were
    signalled, are still analyzed (the traces list is then empty).
    """
    if not paths:
        raise InputError("no input given; pass a trace file, several, or a run directory.")
    files: list[Path] = []
    memory: list[Path] = []
    snapshots: list[Path] = []
    manifest: Manifest | None = None
    run_dir: Path | None = None
    warnings: list[str] = []
    for p in paths:
        if not p.exists():
            raise InputError(f"{p}: no such file or folder; check the path.")
        if p.is_file() and p.name == MANIFEST:
            p = p.parent
        if p.is_dir():
            run_like = is_run_dir(p)
            if run_like:
                run_dir = run_dir or p
                m = read_manifest(p)
                manifest = manifest or m
                found = _run_dir_traces(p, warnings)
            else:
                try:
                    found = sorted(x for x in p.iterdir() if x.is_file() and is_trace_name(x.name))
                except OSError as exc:
                    raise InputError(
                        f"{p}: the folder cannot be read ({exc.strerror or exc}); check its "
                        "permissions."
                    ) from None
                if not found:
                    found = _walk_traces(p, warnings)
                snapshots.extend(_folder_snapshots(p))
            usable_without_traces = run_like and (_oom_records(p) or _recorded_failure(m))
            if not found and not usable_without_traces and not snapshots:
                raise InputError(
                    f"{p}: the folder holds no trace files (*.json or *.json.gz) and no memory "
                    "snapshots; pass a run directory written by 'zdiag run', a folder of "
                    "torch.profiler traces or of torch.cuda.memory snapshots."
                )
            files.extend(found)
        else:
            kind = reader.kind if (reader := reader_for(p)) is not None else None
            if kind == "memory-timeline":
                memory.append(p)
            elif kind == "cuda-snapshot":
                snapshots.append(p)
            else:
                files.append(p)  # a trace, or none: the trace reader says what is wrong
    if not files and memory and not snapshots:
        raise InputError(
            f"{memory[0]}: is a memory timeline, not a profiler trace; pass it together with the "
            "rank's trace (or the run directory)."
        )
    by_real: dict[Path, Path] = {}
    for f in files:
        by_real.setdefault(f.resolve(), f)
    if manifest is not None:
        warnings.extend(manifest.warnings)
    return Inputs(list(by_real.values()), memory, manifest, run_dir, warnings, snapshots)


def _folder_snapshots(folder: Path) -> list[Path]:
    """The CUDA memory snapshots directly in `folder` (recognized by content; traces and
    hidden files are not opened)."""
    try:
        names = sorted(folder.iterdir())
    except OSError:
        return []
    return [
        x
        for x in names
        if not x.name.startswith(".")
        and not x.name.lower().endswith(TRACE_SUFFIXES)
        and x.is_file()
        and is_snapshot_file(x)
    ]


# --- loading --------------------------------------------------------------------------------


def json_bytes(path: Path) -> int:
    """Size of the JSON text: the file size, or for gzip its trailer's ISIZE (size mod 4 GiB)."""
    try:
        size = path.stat().st_size
        if size < 18:
            return size
        with path.open("rb") as f:
            if f.read(2) != b"\x1f\x8b":
                return size
            f.seek(-4, os.SEEK_END)
            return max(size, int.from_bytes(f.read(4), "little"))
    except OSError:
        return 0
