"""CUDA memory snapshots as `zdiag analyze` inputs: recognized by content, read once per rank.

A snapshot is the pickle `torch.cuda.memory._dump_snapshot(path)` writes (or `zdiag run`'s
`memory/rank-N.snapshot.pickle`). `is_snapshot_file` recognizes one from its first bytes (a
pickle of protocol 2 or later whose first keys include `segments` or `device_traces`), never
from its name alone, and never unpickles to decide. `load_breakdowns` reads each with the
restricted unpickler (`memory_snapshot.read_snapshot`) and breaks it down
(`snapshot_breakdown.analyze_snapshot`); an unreadable one is a warning, as a bad memory
timeline is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from zdiag.analyzers.memory_snapshot import read_snapshot
from zdiag.analyzers.report import MemoryBreakdown, MemoryTimeline
from zdiag.analyzers.snapshot_breakdown import analyze_snapshot
from zdiag.errors import InputError

PEEK_BYTES = 64 * 1024
"""Bytes read to recognize a snapshot: the dict's first keys are in the first pickle frame."""

_KEYS = (b"segments", b"device_traces")


def is_snapshot_file(path: Path) -> bool:
    """Whether `path` holds a pickled CUDA memory snapshot, from its first PEEK_BYTES bytes."""
    try:
        with path.open("rb") as f:
            head = f.read(PEEK_BYTES)
    except OSError:
        return False
    return len(head) > 2 and head[0] == 0x80 and head[1] >= 2 and any(k in head for k in _KEYS)


@dataclass(frozen=True)
class SnapshotResult:
    """The breakdowns and replayed timelines of the snapshots read, and what was skipped."""

    breakdowns: tuple[MemoryBreakdown, ...] = ()
    timelines: tuple[MemoryTimeline, ...] = ()
    warnings: tuple[str, ...] = ()


def load_breakdowns(
    snapshots: Mapping[int, Path],
    *,
    devices: Mapping[int, int | None] | None = None,
    capacity: Mapping[int, int | None] | None = None,
    world_size: int | None = None,
    oom_ranks: frozenset[int] = frozenset(),
) -> SnapshotResult:
    """Each rank's snapshot broken down (rank order); a snapshot that cannot be read is a
    warning naming it. `devices`: the CUDA index each rank used, when known."""
    breakdowns: list[MemoryBreakdown] = []
    timelines: list[MemoryTimeline] = []
    warnings: list[str] = []
    for rank, path in sorted(snapshots.items()):
        try:
            data = read_snapshot(path)
        except InputError as exc:
            warnings.append(f"memory snapshot skipped: {exc.message}")
            continue
        breakdown, timeline = analyze_snapshot(
            data,
            rank,
            device=(devices or {}).get(rank),
            capacity_bytes=(capacity or {}).get(rank),
            world_size=world_size,
            source=f"snapshot {path.name}",
        )
        if rank in oom_ranks:
            breakdown.oom = True
            if timeline is not None:
                timeline.oom = True
        if not breakdown.blocks_with_stacks and breakdown.blocks:
            warnings.append(
                f"{path}: the snapshot has no allocation stacks, so its categories are unknown; "
                "record it with torch.cuda.memory._record_memory_history() (or `zdiag run "
                "--profile-memory`)."
            )
        breakdowns.append(breakdown)
        if timeline is not None:
            timelines.append(timeline)
    return SnapshotResult(tuple(breakdowns), tuple(timelines), tuple(warnings))
