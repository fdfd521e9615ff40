"""CUDA memory snapshots as `zdiag analyze` inputs: recognized by content, read once per rank.

A snapshot is the pickle `torch.cuda.memory._dump_snapshot(path)` writes (or `zdiag run`'s
`memory/rank-N.snapshot.pickle`). `is_snapshot_file` recognizes one from its first bytes (a
pickle of protocol 2 or later whose first keys include `segments` or `device_traces`), never
from its name alone, and never unpickles to decide. `load_snapshot_data` reads the whole plain
pickle with memory_snapshot's restricted, bounded `load_plain_pickle`, with Python's cyclic
garbage collector paused: a 100 MB snapshot is ~1M event dicts and the collector's passes over
them cost 5x the load itself. The breakdown needs the allocator history and frame lines that
`read_snapshot`'s summary copy leaves out. `load_breakdowns` breaks each down
(`snapshot_breakdown.analyze_snapshot`) in a forked child process bounded in memory and time
(`memory_snapshot.run_isolated`): only the breakdown and the timeline come back. An unreadable
snapshot, or one beyond those bounds, is a warning, as a bad memory timeline is; damage that
the breakdown reads around (a NaN size, a double free) is a warning beside the breakdown.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zdiag.errors import InputError

from ..report import MemoryBreakdown, MemoryTimeline
from . import memory_snapshot
from .snapshot_breakdown import analyze_snapshot

PEEK_BYTES = 64 * 1024
"""Bytes read to recognize a snapshot: the dict's first keys are in the first pickle frame."""

_KEYS = (b"segments", b"device_traces")


def is_snapshot_file(path: Path) -> bool:
    """Whether `path` holds a pickled CUDA memory snapshot, from its first PEEK_BYTES bytes
    (regular files only: a FIFO or a device among the inputs is never read)."""
    try:
        if not path.is_file():
            return False
        with path.open("rb") as f:
            head = f.read(PEEK_BYTES)
    except OSError:
        return False
    return len(head) > 2 and head[0] == 0x80 and head[1] >= 2 and any(k in head for k in _KEYS)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (the loaded data holds no cycles worth collecting)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load_snapshot_data(path: Path) -> dict[str, Any]:
    """The snapshot pickled in `path` as plain data (no class or function can load);
    InputError, one sentence, when it is unreadable or not a snapshot."""
    with gc_paused():  # (callers keep it paused until the data is dropped: see load_breakdowns)
        data = memory_snapshot.load_plain_pickle(path, "CUDA memory snapshot")
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise InputError(
            f"{path}: not a CUDA memory snapshot (no 'segments' list, as "
            "torch.cuda.memory._snapshot() writes)."
        )
    return data


def _analyze_file(
    path: Path,
    rank: int,
    device: int | None,
    capacity_bytes: int | None,
    world_size: int | None,
) -> tuple[MemoryBreakdown, MemoryTimeline | None, list[str]]:
    """Load and break down one snapshot: (breakdown, timeline, what was damaged in it)."""
    damage: list[str] = []
    # The collector stays paused until the loaded data is dropped: re-enabled while ~1M fresh
    # containers are alive, its next young-generation pass would walk them all.
    with gc_paused():
        data = load_snapshot_data(path)
        try:
            breakdown, timeline = analyze_snapshot(
                data,
                rank,
                device=device,
                capacity_bytes=capacity_bytes,
                world_size=world_size,
                source="snapshot",
                warnings=damage,
            )
        except InputError as exc:  # the breakdown's own sentences do not name the file
            raise InputError(f"{path}: {exc.message}") from None
        del data
    return breakdown, timeline, damage


SNAPSHOT_SKIPPED = "memory snapshot skipped: "
"""How the warning for a snapshot that could not be read starts (the reason follows)."""


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
            breakdown, timeline, damage = memory_snapshot.run_isolated(
                _analyze_file,
                path,
                rank,
                (devices or {}).get(rank),
                (capacity or {}).get(rank),
                world_size,
                path=path,
                what="CUDA memory snapshot",
            )
        except InputError as exc:
            warnings.append(SNAPSHOT_SKIPPED + exc.message)
            continue
        if damage:  # read around: one warning naming the file, the damage found in it
            warnings.append(f"{path}: " + "; ".join(damage) + ".")
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
