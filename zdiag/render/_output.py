"""Shared output helpers for the file renderers: atomic writes and value formatting."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from zdiag.analyzers.report import SEVERITY_ORDER, Finding
from zdiag.errors import InputError


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary file in the same folder and a rename.

    A reader never sees a half-written file, and on failure nothing is left behind.
    Raises InputError (one sentence) when the folder does not exist or cannot be written.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(
            f"cannot write {path}: the folder {folder} does not exist; create it first."
        )
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise InputError(
            f"cannot write {path} ({exc.strerror}); choose a writable folder."
        ) from exc
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, path)
    except BaseException as exc:
        try:
            os.unlink(tmp_name)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise InputError(f"cannot write {path} ({exc.strerror}).") from exc
        raise


def fmt_ms(value: float | None) -> str:
    """A duration in ms, with a precision that suits its size ("—" for None)."""
    if value is None:
        return "—"
    if abs(value) >= 100:
        return f"{value:,.0f} ms"
    if abs(value) >= 1:
        return f"{value:.1f} ms"
    return f"{value:.3f} ms"


def fmt_bytes(value: int | float | None) -> str:
    """A size in binary units (B, KiB, MiB, GiB, TiB; "—" for None)."""
    if value is None:
        return "—"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def fmt_list(values: list[int] | list[str], limit: int = 12) -> str:
    """A short comma list of at most `limit` items, then "… (+N more)"."""
    shown = ", ".join(str(v) for v in values[:limit])
    if len(values) > limit:
        shown += f", … (+{len(values) - limit} more)"
    return shown


def unit_label(name: str) -> str:
    """An FSDP unit's display name: the module fqn, or "(root)" for the root module."""
    return name if name else "(root)"


def fmt_ints(values: list[int], limit: int = 12) -> str:
    """Integers as compact runs ("0–3, 7, 9–19"), at most `limit` runs then '… (+N more)'."""
    ordered = sorted(set(values))
    runs: list[tuple[int, int]] = []
    for v in ordered:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    parts = [str(a) if a == b else f"{a}–{b}" for a, b in runs]
    return fmt_list(parts, limit)


def fmt_gain(finding: Finding) -> str:
    """A finding's expected gain ("12.5 ms per step and 1.0 GiB of peak memory"; "" for none)."""
    gains = []
    if finding.expected_gain_ms is not None:
        gains.append(f"{fmt_ms(finding.expected_gain_ms)} per step")
    if finding.expected_gain_bytes is not None:
        gains.append(f"{fmt_bytes(finding.expected_gain_bytes)} of peak memory")
    return " and ".join(gains)


def worst_first(finding: Finding) -> tuple[int, float]:
    """Sort key for findings, worst first: severity, then expected gain (ms per step)."""
    return (-SEVERITY_ORDER.get(finding.severity, 0), -(finding.expected_gain_ms or 0.0))
