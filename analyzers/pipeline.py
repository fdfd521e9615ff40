"""From paths to a Report: discover inputs, load ranks, segment steps, break down, assemble.

Public entry points:

- `load_run(paths, *, progress=None) -> RunData`: find the traces (files, run directories, or
  folders of per-rank traces), decode each into a `RankTrace`, assign ranks.
- `analyze_run(run, *, ranks=None) -> Analysis`: the map on each rank (`analyze_rank`:
  steps, breakdown, collectives, FSDP ledger, timeline), then the reduce on their summaries
  (`reduce_run`: cross-rank matching, detectors, the Report assembled once).
- `analyze_paths(paths, *, progress=None, ranks=None) -> Report`: both of the above.

`progress`, when given, is called as `progress(done, total, label)`: in JSON bytes as batches
of events are decoded when files load in this process (one big file moves too), in files when
they load in a process pool.
Rank of a trace: `distributedInfo.rank`, else the run manifest, else the file name (rank-3,
rank3, rank_3, _3_of_8), else 0 with a warning.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zdiag.analyzers.decode_batches import auto_workers
from zdiag.analyzers.events import RankTrace
from zdiag.analyzers.fsdp_ledger import manifest_unit_bytes
from zdiag.analyzers.loader import load_rank_trace, rank_from_file_name
from zdiag.analyzers.memory import load_memory_timeline
from zdiag.analyzers.rank_analysis import RankContext, analyze_rank
from zdiag.analyzers.reduce import RunFacts, reduce_run
from zdiag.analyzers.report import MemoryTimeline, Report
from zdiag.analyzers.run_data import Analysis, RunData
from zdiag.analyzers.summary import RankSummary, summarize
from zdiag.collectors.rundir import (
    MANIFEST,
    MEMORY_DIR,
    OOM_RECORD_GLOB,
    TRACES_DIR,
    Manifest,
    check_rank,
    is_run_dir,
    memory_timeline_relpath,
    oom_relpath,
    read_manifest,
    run_file,
    step_log_relpath,
)
from zdiag.errors import InputError

Progress = Callable[[int, int, str], None]

TRACE_SUFFIXES = (".json", ".json.gz")
_NOT_TRACES = ("manifest", "timeline", "snapshot", ".oom.", "report", "metrics")
PARALLEL_MIN_BYTES = 32 * 1024 * 1024
"""Load files in worker processes only when there are several and they hold this much JSON
(uncompressed): below that, starting workers costs more than it saves."""


# --- discovering inputs ---------------------------------------------------------------------


def _is_trace_name(path: Path) -> bool:
    """Trace-like file names in folders; hidden and temporary files (being written) are skipped."""
    name = path.name.lower()
    if name.startswith(".") or ".tmp" in name or name.endswith("~"):
        return False
    return name.endswith(TRACE_SUFFIXES) and not any(x in name for x in _NOT_TRACES)


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


def is_memory_timeline_name(path: Path) -> bool:
    """File names that `export_memory_timeline` outputs usually get (not Kineto traces)."""
    name = path.name.lower()
    return "timeline" in name or name.endswith((".raw.json.gz", ".raw.gz", ".raw.json"))


@dataclass
class Inputs:
    """What `discover` found: traces, explicit memory timelines, the manifest and run dir, and
    warnings about what was left out (unreadable folders, files that are not regular files)."""

    traces: list[Path]
    memory: list[Path]
    manifest: Manifest | None
    run_dir: Path | None
    warnings: list[str] = field(default_factory=list)


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
            if not found and not (run_like and _oom_records(p)):
                raise InputError(
                    f"{p}: the folder holds no trace files (*.json or *.json.gz); pass a run "
                    "directory written by 'zdiag run' or a folder of torch.profiler traces."
                )
            files.extend(found)
        elif is_memory_timeline_name(p):
            memory.append(p)
        else:
            files.append(p)
    if not files and memory:
        raise InputError(
            f"{memory[0]}: is a memory timeline, not a profiler trace; pass it together with the "
            "rank's trace (or the run directory)."
        )
    by_real: dict[Path, Path] = {}
    for f in files:
        by_real.setdefault(f.resolve(), f)
    if manifest is not None:
        warnings.extend(manifest.warnings)
    return Inputs(list(by_real.values()), memory, manifest, run_dir, warnings)


# --- loading --------------------------------------------------------------------------------


def _json_bytes(path: Path) -> int:
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


def _assign_rank(
    trace: RankTrace, manifest_map: dict[Path, int], world_size: int | None = None
) -> None:
    """The trace's rank: distributedInfo, else the manifest, else the file name (checked to be
    within 0..world_size-1, InputError otherwise), else 0 with a warning."""
    if trace.rank_source == "distributedInfo":
        return
    path = trace.source.resolve()
    if path in manifest_map:
        trace.rank, trace.rank_source = manifest_map[path], "manifest"
        return
    from_name = rank_from_file_name(path)
    if from_name is not None:
        check_rank(from_name, world_size or trace.world_size, f"{trace.source} (file name)")
        trace.rank, trace.rank_source = from_name, "file name"
        trace.warnings.append(
            f"no distributedInfo in the trace: rank {from_name} taken from the file name"
        )
        return
    trace.rank, trace.rank_source = 0, "default"
    trace.warnings.append(
        "no distributedInfo in the trace and no rank in the file name: assumed rank 0"
    )


def _load_file(path: Path, workers: int) -> RankTrace:
    """`load_rank_trace` with a given number of decode processes (for the per-file pool)."""
    return load_rank_trace(path, workers=workers)


def _share_reporter(
    progress: Progress, base: int, size: int, total: int, name: str
) -> Callable[[float], None]:
    """`progress` in bytes for the share of one file (of `size` bytes, after `base`) decoded."""

    def report(share: float) -> None:
        progress(base + int(share * size), total, f"reading {name}")

    return report


def load_run(paths: list[Path], *, progress: Progress | None = None) -> RunData:
    """Load every trace under `paths` (files, run directories, folders) into a RunData."""
    found = discover([Path(p) for p in paths])
    files, manifest, run_dir = found.traces, found.manifest, found.run_dir
    total_bytes = sum(_json_bytes(f) for f in files)
    traces: list[RankTrace] = []
    if len(files) > 1 and total_bytes >= PARALLEL_MIN_BYTES and (os.cpu_count() or 1) > 1:
        workers = min(len(files), os.cpu_count() or 1)
        # One process per file; a big file decodes in several only with the cores left over.
        share = max(1, (os.cpu_count() or 1) // workers)
        inner = [auto_workers(_json_bytes(f), cores=share) for f in files]
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for done, trace in enumerate(pool.map(_load_file, files, inner), start=1):
                traces.append(trace)
                if progress:
                    progress(done, len(files), trace.source.name)
    else:
        # one process: progress in JSON bytes, so one big file moves the line too
        done_bytes = 0
        for f in files:
            size = _json_bytes(f)
            report = None
            if progress:
                progress(done_bytes, total_bytes, f"reading {f.name}")
                report = _share_reporter(progress, done_bytes, size, total_bytes, f.name)
            traces.append(load_rank_trace(f, on_fraction=report))
            done_bytes += size
            if progress:
                progress(done_bytes, total_bytes, f.name)
    warnings = list(found.warnings)
    manifest_map = manifest_ranks(manifest, run_dir, warnings) if manifest and run_dir else {}
    for t in traces:
        _assign_rank(t, manifest_map, manifest.world_size if manifest else None)
    traces.sort(key=lambda t: (t.rank, str(t.source)))
    run = RunData(ranks=traces, manifest=manifest, run_dir=run_dir, inputs=files)
    run.warnings.extend(warnings)
    if not files and run_dir is not None:
        run.warnings.append(
            f"{run_dir}: no trace was written (the run ran out of memory before the profiler's "
            "active steps); only its memory records are analyzed. Profile from the first step "
            "with 'zdiag run --profile-steps 0:0:N' to see the steps before the failure."
        )
    seen: dict[int, int] = {}
    for t in traces:
        seen[t.rank] = seen.get(t.rank, 0) + 1
    dup = sorted(r for r, c in seen.items() if c > 1)
    if dup:
        run.warnings.append(
            f"rank(s) {', '.join(map(str, dup))} appear in several files; cross-rank results "
            "may mix runs"
        )
    for mem in found.memory:
        rank = rank_from_file_name(mem)
        if rank is None:
            rank = traces[0].rank if len(traces) == 1 else 0
        run.memory_timelines[check_rank(rank, None, f"{mem} (file name)")] = mem
    if run_dir is not None:
        for t in traces:
            timeline = _run_dir_file(run_dir, memory_timeline_relpath(t.rank), run.warnings)
            if timeline is not None:
                run.memory_timelines.setdefault(t.rank, timeline)
            log = _run_dir_file(run_dir, step_log_relpath(t.rank), run.warnings)
            if log is not None:
                run.step_logs[t.rank] = log
    return run


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


def analyze_run(run: RunData, *, ranks: list[int] | None = None) -> Analysis:
    """The map on every rank (`analyze_rank`), then the reduce on their summaries (`reduce_run`).

    `ranks` keeps only those ranks (run.ranks is narrowed in place; InputError naming the ranks
    present when one is missing). InputError when no trace holds a timed event.
    """
    if ranks:
        missing = sorted(set(ranks) - {t.rank for t in run.ranks})
        if missing:
            have = ", ".join(str(t.rank) for t in run.ranks)
            raise InputError(
                f"rank(s) {', '.join(map(str, missing))} not found in the input (it has rank(s) {have}); pick one of those with --rank."
            )
        run.ranks = [t for t in run.ranks if t.rank in set(ranks)]
    if run.ranks and all(len(t) == 0 for t in run.ranks):
        names = ", ".join(str(t.source) for t in run.ranks[:3])
        raise InputError(
            f"{names}: the trace holds no timed events; the profiler recorded nothing (check that "
            "its schedule reached an active step and that prof.step() is called)."
        )
    finished = _finished_steps(run.manifest)
    collector_errors = _collector_errors(run.manifest)
    unit_bytes = manifest_unit_bytes(run.manifest)
    analyses = [
        analyze_rank(
            t,
            RankContext(
                finished_steps=finished.get(t.rank),
                collector_errors=tuple(collector_errors.get(t.rank, [])),
                unit_param_bytes=unit_bytes,
            ),
        )
        for t in run.ranks
    ]
    summaries = [summarize(a) for a in analyses]
    reduction = reduce_run(summaries, run_facts(run, summaries))
    return Analysis(
        ranks=analyses,
        summaries=summaries,
        crossrank=reduction.crossrank,
        report=reduction.report,
    )


def run_facts(run: RunData, summaries: list[RankSummary]) -> RunFacts:
    """What the reduce needs of the run besides its ranks: inputs, manifest, run-level warnings
    and the memory timelines of the summarized ranks (read from their files here)."""
    memory, memory_warnings = _memory_timelines(run, summaries)
    return RunFacts(
        inputs=tuple(str(p) for p in run.inputs),
        manifest=run.manifest,
        run_dir=run.run_dir,
        warnings=tuple(run.warnings + memory_warnings),
        memory=tuple(memory),
        manifest_summary=manifest_summary(run.manifest) if run.manifest else {},
    )


MAX_COLLECTOR_ERRORS_SHOWN = 5


def _collector_errors(manifest: Manifest | None) -> dict[int, list[str]]:
    """Rank -> what zdiag's collectors reported on it during the run (the manifest's
    `collector_errors`: a lost trace, a memory timeline with totals only, ...), at most 5 each."""
    if manifest is None:
        return {}
    return {
        e.rank: list(e.collector_errors[:MAX_COLLECTOR_ERRORS_SHOWN])
        for e in manifest.ranks
        if e.collector_errors
    }


def _finished_steps(manifest: Manifest | None) -> dict[int, int]:
    """Rank -> steps finished, for the ranks of a `zdiag run` manifest that exited cleanly (an
    OOM's or a crash's last step is the failing one, kept)."""
    if manifest is None:
        return {}
    return {e.rank: e.steps for e in manifest.ranks if e.exit_code == 0 and not e.oom}


def analyze_paths(
    paths: list[Path], *, progress: Progress | None = None, ranks: list[int] | None = None
) -> Report:
    """Load and analyze; the Report that `zdiag analyze` prints."""
    run = load_run(paths, progress=progress)
    return analyze_run(run, ranks=ranks).report


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
