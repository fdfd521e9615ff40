"""The per-rank step log: one JSON object per line, flushed as it goes, capped in length."""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any


class StepLog:
    """Appends step records to `path`; stops (and says so) after `max_lines` lines."""

    def __init__(self, path: str | Path, max_lines: int) -> None:
        self.path = Path(path)
        self.max_lines = max_lines
        self.lines = 0
        self.truncated = False
        self._file: IO[str] | None = None

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (dropped once the cap is reached)."""
        if self.lines >= self.max_lines:
            self.truncated = True
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        self.lines += 1

    @property
    def written(self) -> bool:
        """Whether the file exists (at least one line was written)."""
        return self.lines > 0

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
