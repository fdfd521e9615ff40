"""Atomic file writes: write a temporary file beside the target, then rename it into place."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates 0600 files; finished files get the usual permissions (0666 minus the umask).
_FILE_MODE = 0o666 & ~_current_umask()


def temp_path_for(path: str | Path, suffix: str = "") -> str:
    """A unique temporary file name in the target's folder (same filesystem, so rename is atomic).

    `suffix` lets writers that look at the extension (torch writes gzip for `.gz`) see the right one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", suffix=suffix, dir=path.parent)
    os.close(fd)
    os.chmod(tmp, _FILE_MODE)
    return tmp


def write_atomically(path: str | Path, write: Callable[[str], None], suffix: str = "") -> None:
    """Call `write(tmp)` to produce the file under a temporary name, then rename it to `path`."""
    tmp = temp_path_for(path, suffix)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json_atomically(path: str | Path, data: Any) -> None:
    """Write `data` as indented JSON to `path` atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=False, default=str)
            f.write("\n")

    write_atomically(path, write)
