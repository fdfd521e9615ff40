"""Reading a run directory's files, confined: the analyzers' side of the run-dir contract.

The layout (`collectors/rundir.py`) and the records (`collectors/run_records.py`) are shared with
the collectors that write them; reading is the analysis's own: every run-dir file the analyzers
open is checked by `run_file` (a regular file, inside the run directory once links are
resolved), and the small JSON records (the manifest, an OOM record, a model description) are read
whole by `read_run_file`, capped at `MAX_SMALL_FILE_BYTES`.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from zdiag.errors import InputError

from ...collectors.run_records import Manifest, OomRecord
from ...collectors.rundir import CAPTURES_DIR, MANIFEST

MAX_SMALL_FILE_BYTES = 64 * 1024 * 1024
"""The cap on a manifest, a manifest part or an OOM record read whole (64 MiB)."""


def run_file(run_dir: str | Path, rel: str | Path) -> Path:
    """The file `rel` names inside `run_dir`, checked: after resolving links it stays inside the
    run directory and is a regular file (no FIFO, device or folder). InputError otherwise."""
    root = Path(run_dir).resolve()
    rel_path = Path(rel)
    path = (rel_path if rel_path.is_absolute() else root / rel_path).resolve()
    if path != root and root not in path.parents:
        raise InputError(
            f"{rel}: the path points outside the run directory {root}; it was not read."
        )
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc}).") from None
    if not stat.S_ISREG(mode):
        raise InputError(f"{path}: not a regular file (a folder, FIFO or device); it was not read.")
    return path


def read_run_file(
    run_dir: str | Path, rel: str | Path, *, max_bytes: int = MAX_SMALL_FILE_BYTES
) -> bytes:
    """The bytes of the run-dir file `rel` (checked by `run_file`), at most `max_bytes`.

    The one place where the analyzers read a small run-dir file whole (the manifest, an OOM
    record); InputError when it is not a confined regular file, unreadable, or over the cap.
    """
    path = run_file(run_dir, rel)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc}).") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # replaced since run_file looked
            raise InputError(f"{path}: not a regular file; it was not read.")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputError(
            f"{path}: larger than {max_bytes} bytes, too large for a run-directory record; "
            "it is damaged or not written by zdiag."
        )
    return data


def read_run_json(run_dir: str | Path, rel: str | Path) -> Any:
    """A small run-dir JSON file decoded (see `read_run_file`); InputError when not valid JSON."""
    data = read_run_file(run_dir, rel)
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise InputError(
            f"{Path(run_dir) / rel}: not valid JSON ({_short(exc)}); fix or remove it."
        ) from None


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def read_manifest(run_dir: str | Path) -> Manifest | None:
    """RUN_DIR/manifest.json as a `Manifest`, None when there is none; InputError when damaged."""
    root = Path(run_dir)
    if not (root / MANIFEST).exists():
        return None
    data = read_run_json(root, MANIFEST)
    return Manifest.from_json(data, str(root / MANIFEST))


def read_oom_record(
    run_dir: str | Path, rel: str, warnings: list[str], world_size: int | None = None
) -> OomRecord:
    """The OOM record at run-dir path `rel` (its ignored fields added to `warnings`); InputError
    when it is refused, not valid JSON, or names no valid rank."""
    return OomRecord.from_json(read_run_json(run_dir, rel), rel, warnings, world_size)


MAX_CAPTURES_LISTED = 16


def capture_windows(run_dir: str | Path) -> list[tuple[str, int]]:
    """The triggered captures a run directory holds (`captures/capture-<K>/`, made when the
    monitor asked the ranks for a profile): each folder's path relative to the run directory and
    its number of rank traces, in capture order; at most MAX_CAPTURES_LISTED, symlinks skipped."""
    root = Path(run_dir) / CAPTURES_DIR
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            return []
        names = sorted(
            (e.name for e in os.scandir(root) if e.name.startswith("capture-")),
            key=lambda n: (len(n), n),
        )[:MAX_CAPTURES_LISTED]
        out = []
        for name in names:
            folder = root / name
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                continue
            traces = sum(1 for e in os.scandir(folder) if e.name.endswith((".json.gz", ".json")))
            out.append((f"{CAPTURES_DIR}/{name}", traces))
        return out
    except OSError:
        return []
