"""The out-of-memory records a run directory holds (`memory/rank-N.oom.json`), read once.

`zdiag run` writes one per rank that ran out of memory (collectors/run_records.py `OomRecord`: the
error text, the memory budget, what was allocated). The engine reads them before the reduce and
hands the values to the detectors' context; a damaged or refused record is a warning, and the
analysis goes on without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from zdiag.errors import InputError

from ...collectors.run_records import Manifest, OomRecord
from .run_dir import read_oom_record


@dataclass(frozen=True)
class OomRecords:
    """The records read, by rank, and the warnings reading them gave (in reading order)."""

    by_rank: dict[int, OomRecord] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()


def read_oom_records(manifest: Manifest | None, run_dir: Path | None) -> OomRecords:
    """The OOM record of every manifest rank that names one (none without a run directory)."""
    if manifest is None or run_dir is None:
        return OomRecords()
    by_rank: dict[int, OomRecord] = {}
    warnings: list[str] = []
    for entry in manifest.ranks:
        if entry.oom_record is None:
            continue
        found: list[str] = []
        try:
            record = read_oom_record(run_dir, entry.oom_record, found, manifest.world_size)
        except InputError as exc:
            _warn(warnings, f"out-of-memory record skipped: {exc.message}")
            continue
        for w in found:
            _warn(warnings, w)
        by_rank[entry.rank] = record
    return OomRecords(by_rank, tuple(warnings))


def _warn(warnings: list[str], message: str) -> None:
    if message not in warnings:
        warnings.append(message)
