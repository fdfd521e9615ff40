"""The per-rank step log: one JSON object per line, capped in length.

Lines are buffered and flushed at most once a second (and when the log closes), so a step costs a
string format and a buffered write, not a system call; a rank killed with SIGKILL loses at most
the last second of lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

FLUSH_INTERVAL_S = 1.0


def _int_or_null(value: int | None) -> str:
    return "null" if value is None else str(int(value))


class StepLog:
    """Appends step records to `path`; stops (and says so) after `max_lines` lines."""

    def __init__(self, path: str | Path, max_lines: int) -> None:
        self.path = Path(path)
        self.max_lines = max_lines
        self.lines = 0
        self.truncated = False
        self._file: IO[str] | None = None
        self._last_flush = 0.0

    def _open(self) -> IO[str]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")
        return self._file

    def write_step(
        self,
        step: int,
        time_unix: float,
        duration_ms: float,
        allocated: int | None,
        reserved: int | None,
        peak: int | None,
    ) -> None:
        """Append one step line (the step log schema), formatted without json for speed."""
        if self.lines >= self.max_lines:
            self.truncated = True
            return
        f = self._file or self._open()
        f.write(
            f'{{"step":{int(step)},"time_unix":{time_unix!r},"duration_ms":{round(duration_ms, 4)!r},'
            f'"mem_allocated_bytes":{_int_or_null(allocated)},"mem_reserved_bytes":{_int_or_null(reserved)},'
            f'"mem_peak_bytes":{_int_or_null(peak)}}}\n'
        )
        self._after_write(time_unix)

    def _after_write(self, now: float) -> None:
        self.lines += 1
        if now - self._last_flush >= FLUSH_INTERVAL_S and self._file is not None:
            self._file.flush()
            self._last_flush = now

    @property
    def written(self) -> bool:
        """Whether the file exists (at least one line was written)."""
        return self.lines > 0

    def flush(self) -> None:
        """Write the buffered lines to the file now (a failure path: a signal, a hang)."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
