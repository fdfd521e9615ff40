"""CUDA memory snapshots as `zdiag analyze` inputs: each rank's snapshot broken down once.

The snapshot is recognized and read by `inputs/cuda_snapshot.py`. The breakdown needs the
allocator history and frame lines that `read_snapshot`'s summary copy leaves out, so it loads the
whole plain pickle (`load_snapshot_data`). `load_breakdowns` breaks each down
(`snapshot_breakdown.analyze_snapshot`) in a forked child process bounded in memory and time
(`plain_pickle.run_isolated`): only the breakdown and the timeline come back. An unreadable
snapshot, or one beyond those bounds, is a warning, as a bad memory timeline is; damage that
the breakdown reads around (a NaN size, a double free) is a warning beside the breakdown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from zdiag.errors import InputError

from ..inputs.cuda_snapshot import gc_paused, load_snapshot_data
from ..inputs.plain_pickle import run_isolated
from ..report import MemoryBreakdown, MemoryTimeline
from .snapshot_breakdown import analyze_snapshot
from .snapshot_whatif import RESHARD_AFTER_FORWARD


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
    resharded_after_forward: bool = False,
) -> SnapshotResult:
    """Each rank's snapshot broken down (rank order); a snapshot that cannot be read is a
    warning naming it. `devices`: the CUDA index each rank used, when known.
    `resharded_after_forward`: the run already reshards every unit after forward (the captured
    model says so), so that what-if is not offered."""
    breakdowns: list[MemoryBreakdown] = []
    timelines: list[MemoryTimeline] = []
    warnings: list[str] = []
    for rank, path in sorted(snapshots.items()):
        try:
            breakdown, timeline, damage = run_isolated(
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
        if resharded_after_forward:
            breakdown.what_if = [w for w in breakdown.what_if if w.change != RESHARD_AFTER_FORWARD]
        if rank in oom_ranks:
            breakdown.oom = True
            if timeline is not None:
                timeline.oom = True
        if (
            not breakdown.blocks_with_stacks
            and breakdown.blocks
            and not any(site.site for site in breakdown.top_sites)
        ):  # (torch >= 2.10 keeps the stacks of `stacks="all"` only in the history's entries)
            warnings.append(
                f"{path}: the snapshot has no allocation stacks, so its categories are unknown; "
                "record it with torch.cuda.memory._record_memory_history() (or `zdiag run "
                "--profile-memory`)."
            )
        breakdowns.append(breakdown)
        if timeline is not None:
            timelines.append(timeline)
    return SnapshotResult(tuple(breakdowns), tuple(timelines), tuple(warnings))
