"""The engine's input side: find the inputs under paths, and what the run recorded around them.

`discover(paths)` finds the traces (files, run directories, folders of per-rank traces), the
manifest, flight-recorder dumps, snapshots and memory timelines; `run_level_data` gathers what
the run recorded beside the traces (manifest, OOM records, memory timelines, snapshots, dumps);
`run_facts` hands it to the reduce. The one pipeline that runs the map and the reduce is
`summary_pipeline.analyze_via_summaries` (what `zdiag analyze` runs; `analyze_paths` is it
without stored summaries, for tests and benchmarks).

Rank of a trace: `distributedInfo.rank`, else the run manifest, else the file name (rank-3,
rank3, rank_3, _3_of_8), else 0 with a warning.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zdiag.errors import InputError

from ...collectors.run_records import Manifest, check_rank
from ...collectors.rundir import (
    MANIFEST,
    MEMORY_DIR,
    OOM_RECORD_GLOB,
    TRACES_DIR,
    is_run_dir,
    memory_snapshot_relpath,
    memory_timeline_relpath,
    oom_relpath,
    step_log_relpath,
)
from ..detectors.hang_finding import dump_warnings
from ..inputs.cuda_snapshot import is_snapshot_file
from ..inputs.flight_dumps import read_dumps
from ..inputs.loader import TRACE_SUFFIXES, is_trace_name, rank_from_file_name
from ..inputs.memory_timeline import load_memory_timeline
from ..inputs.model_facts import ModelFacts, facts_from_run_dir
from ..inputs.oom_records import read_oom_records
from ..inputs.registry import reader_for
from ..inputs.run_dir import read_manifest, run_file
from ..memory.snapshot_input import SNAPSHOT_SKIPPED, SnapshotResult, load_breakdowns
from ..rank.summary import RankSummary
from ..report import MemoryTimeline
from ..run.run_data import RunData
from ..run.wait_graph import analyze_dumps
from .reduce import RunFacts
from .summary_map import MAX_COLLECTOR_ERRORS_SHOWN as MAX_COLLECTOR_ERRORS_SHOWN

Progress = Callable[[int, int, str], None]


# --- discovering inputs ---------------------------------------------------------------------


def _is_trace_name(path: Path) -> bool:
    """Trace-like file names in folders; hidden and temporary files (being written) are skipped."""
    return is_trace_name(path.name)


def _read_manifest(run_dir: Path) -> Manifest | None:
    """RUN_DIR/manifest.json as a typed `Manifest` (None when absent); InputError when damaged."""
    return read_manifest(run_dir)


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
            if _is_trace_name(path) and path.is_file():
                found.append(path)
    return sorted(found)


def _run_dir_traces(run_dir: Path, warnings: list[str]) -> list[Path]:
    """The trace files in RUN_DIR/traces/: regular files inside the run directory only."""
    traces = run_dir / TRACES_DIR
    try:
        names = sorted(x for x in traces.iterdir() if _is_trace_name(x))
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

    A run directory that ran out of memory before the profiler wrote any trace is usable: its
    out-of-memory records and manifest are still analyzed (the traces list is then empty).
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
                m = _read_manifest(p)
                manifest = manifest or m
                found = _run_dir_traces(p, warnings)
            else:
                try:
                    found = sorted(x for x in p.iterdir() if x.is_file() and _is_trace_name(x))
                except OSError as exc:
                    raise InputError(
                        f"{p}: the folder cannot be read ({exc.strerror or exc}); check its "
                        "permissions."
                    ) from None
                if not found:
                    found = _walk_traces(p, warnings)
                snapshots.extend(_folder_snapshots(p))
            if not found and not (run_like and _oom_records(p)) and not snapshots:
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


def run_level_data(found: Inputs, ranks: list[int], warnings: list[str]) -> RunData:
    """A RunData without traces for the discovered inputs whose traces hold `ranks` (in file
    order, duplicates kept): the run-level warnings (`warnings` first), the memory timelines and
    the step logs of those ranks."""
    files, manifest, run_dir = found.traces, found.manifest, found.run_dir
    run = RunData(ranks=[], manifest=manifest, run_dir=run_dir, inputs=files + found.snapshots)
    run.warnings.extend(warnings)
    _add_snapshots(run, found.snapshots, ranks)
    if not files and run_dir is not None and not run.snapshots:
        run.warnings.append(
            f"{run_dir}: no trace was written (the run ran out of memory before the profiler's "
            "active steps); only its memory records are analyzed. Profile from the first step "
            "with 'zdiag run --profile-steps 0:0:N' to see the steps before the failure."
        )
    seen: dict[int, int] = {}
    for r in ranks:
        seen[r] = seen.get(r, 0) + 1
    if manifest is not None and ranks:
        run.warnings.extend(_missing_rank_warnings(manifest, set(ranks)))
    dup = sorted(r for r, c in seen.items() if c > 1)
    if dup:
        run.warnings.append(
            f"rank(s) {', '.join(map(str, dup))} appear in several files; cross-rank results "
            "may mix runs"
        )
    for mem in found.memory:
        rank = rank_from_file_name(mem)
        if rank is None:
            rank = ranks[0] if len(ranks) == 1 else 0
        run.memory_timelines[check_rank(rank, None, f"{mem} (file name)")] = mem
    if run_dir is not None:
        for r in ranks:
            timeline = _run_dir_file(run_dir, memory_timeline_relpath(r), run.warnings)
            if timeline is not None:
                run.memory_timelines.setdefault(r, timeline)
            log = _run_dir_file(run_dir, step_log_relpath(r), run.warnings)
            if log is not None:
                run.step_logs[r] = log
    return run


def _add_snapshots(run: RunData, given: list[Path], ranks: list[int]) -> None:
    """RunData.snapshots: the snapshots given (rank from the file name, else the only trace's
    rank, else their order) and, in a run directory, memory/rank-N.snapshot.pickle."""
    for i, path in enumerate(given):
        rank = rank_from_file_name(path)
        if rank is None:
            rank = ranks[0] if len(ranks) == 1 and len(given) == 1 else i
        if rank in run.snapshots:
            run.warnings.append(f"{path}: a second memory snapshot for rank {rank}; it is not used")
            continue
        run.snapshots[check_rank(rank, None, f"{path} (file name)")] = path
    if run.run_dir is None:
        return
    present = set(ranks) or ({e.rank for e in run.manifest.ranks} if run.manifest else set())
    for rank in sorted(present):
        found = _run_dir_file(run.run_dir, memory_snapshot_relpath(rank), run.warnings)
        if found is not None:
            run.snapshots.setdefault(rank, found)


def _missing_rank_warnings(manifest: Manifest, found: set[int]) -> list[str]:
    """A warning when the run's world size exceeds the ranks whose traces were found, saying
    what the manifest knows of each missing one."""
    expected = manifest.world_size or 0
    missing = [r for r in range(expected) if r not in found]
    if not missing:
        return []
    entries = {e.rank: e for e in manifest.ranks}
    reasons = []
    for r in missing[:MAX_MISSING_RANKS_SHOWN]:
        e = entries.get(r)
        if e is None or e.missing:
            why = "it never wrote its manifest part (killed or never started)"
        elif e.error:
            why = f"it raised {e.error.split(':')[0]} after {e.steps} step(s)"
        elif e.hang is not None or e.ended_by:
            why = f"it hung or was stopped after {e.steps} step(s)"
        else:
            why = f"it finished {e.steps} step(s), before or without the profiler window"
        reasons.append(f"rank {r}: {why}")
    more = len(missing) - len(reasons)
    tail = f"; and {more} more" if more > 0 else ""
    return [
        f"world size {expected}, but traces of only {len(found)} rank(s) were found: "
        f"{'; '.join(reasons)}{tail}. Cross-rank results cover the ranks found only."
    ]


MAX_MISSING_RANKS_SHOWN = 8


def _run_dir_file(run_dir: Path, rel: str, warnings: list[str]) -> Path | None:
    """RUN_DIR/rel checked by `run_file`: None when absent; a warning when refused."""
    if not os.path.lexists(run_dir / rel):
        return None
    try:
        return run_file(run_dir, rel)
    except InputError as exc:
        warnings.append(f"{exc.message.rstrip('.')}; it is skipped")
        return None


def manifest_summary(manifest: Manifest) -> dict[str, Any]:
    """What the Report's `run` block takes from the manifest: schema, world size, versions."""
    return {
        "schema": manifest.schema,
        "world_size": manifest.world_size,
        "versions": dict(manifest.versions),
    }


# --- analysis -------------------------------------------------------------------------------


def load_model_facts(run_dir: Path | None) -> tuple[ModelFacts | None, list[str]]:
    """The model description a run recorded (`model/rank-<N>.json`, the lowest rank's), read
    once per analysis; (None, [a warning]) when the file is damaged, so the analysis goes on
    inferring the configuration from the traces."""
    if run_dir is None:
        return None, []
    try:
        return facts_from_run_dir(run_dir), []
    except InputError as exc:
        return None, [f"model description skipped: {exc.message}"]


def run_facts(
    run: RunData,
    summaries: list[RankSummary],
    model: ModelFacts | None = None,
    model_warnings: list[str] | None = None,
) -> RunFacts:
    """What the reduce needs of the run besides its ranks: inputs, manifest, the captured model
    description, run-level warnings and the memory timelines of the summarized ranks (read from
    their files here)."""
    memory, memory_warnings = _memory_timelines(run, summaries)
    snap = _snapshot_breakdowns(run, summaries)
    if run.snapshots and not (summaries or memory or snap.breakdowns or run.run_dir):
        # snapshots were the whole input and none could be read: bad input, not an empty report
        raise InputError(snap.warnings[0].removeprefix(SNAPSHOT_SKIPPED))
    have = {m.rank for m in memory}
    memory += [t for t in snap.timelines if t.rank not in have]
    memory.sort(key=lambda m: m.rank)
    return RunFacts(
        inputs=tuple(str(p) for p in run.inputs),
        manifest=run.manifest,
        run_dir=run.run_dir,
        oom_records=read_oom_records(run.manifest, run.run_dir),
        model=model,
        warnings=tuple(
            run.warnings + (model_warnings or []) + memory_warnings + list(snap.warnings)
        ),
        memory=tuple(memory),
        memory_breakdowns=snap.breakdowns,
        manifest_summary=manifest_summary(run.manifest) if run.manifest else {},
        flight_recorder=run.flight_recorder,
        flight_recorder_inputs=tuple(run.flight_recorder_inputs),
    )


def _snapshot_breakdowns(run: RunData, summaries: list[RankSummary]) -> SnapshotResult:
    """The snapshots of the analyzed ranks (all of them when no trace was given) broken down,
    on the device each rank used and against its capacity, when known."""
    by_rank = {s.rank: s for s in summaries}
    todo = {r: p for r, p in run.snapshots.items() if not by_rank or r in by_rank}
    entries = {e.rank: e for e in run.manifest.ranks} if run.manifest else {}
    devices = {}
    for r in todo:
        dev = entries[r].device if r in entries else None
        if isinstance(dev, str) and dev.startswith("cuda:") and dev[5:].isdigit():
            devices[r] = int(dev[5:])
    world = run.manifest.world_size if run.manifest else None
    world = world or next((s.world_size for s in summaries if s.world_size), None)
    return load_breakdowns(
        todo,
        devices=devices,
        capacity={r: s.capacity_bytes for r, s in by_rank.items()},
        world_size=world,
        oom_ranks=frozenset(r for r, e in entries.items() if e.oom),
    )


def attach_flight_recorder(run: RunData, dumps: list[Path]) -> None:
    """Give the run the analysis of the flight-recorder dumps found among its inputs (the
    `hang` detector reads it), their paths and what they could not tell."""
    if not dumps:
        return
    hangs = analyze_dumps(read_dumps(dumps))
    run.flight_recorder = hangs
    run.flight_recorder_inputs = [str(p) for p in dumps]
    run.warnings += dump_warnings(hangs)


def _memory_timelines(
    run: RunData, summaries: list[RankSummary]
) -> tuple[list[MemoryTimeline], list[str]]:
    """Report.memory from the memory timelines found, and warnings for those skipped (a bad one
    is a warning, not an error)."""
    out = []
    warnings = []
    by_rank = {s.rank: s for s in summaries}
    for rank, path in sorted(run.memory_timelines.items()):
        s = by_rank.get(rank)
        if s is None:
            continue
        try:
            origins = [s.trace_start_us]
            if s.base_time_ns:
                origins.append(s.trace_start_us + s.base_time_ns / 1000.0)
            timeline = load_memory_timeline(path, rank, origins, s.capacity_bytes)
        except InputError as exc:
            warnings.append(f"memory timeline skipped: {exc.message}")
            continue
        if run.run_dir is not None and (run.run_dir / oom_relpath(rank)).is_file():
            timeline.oom = True
        out.append(timeline)
    return out, warnings
