"""From paths to a Report: discover inputs, load ranks, segment steps, break down, assemble.

Public entry points:

- `load_run(paths, *, progress=None) -> RunData`: find the traces (files, run directories, or
  folders of per-rank traces), decode each into a `RankTrace`, assign ranks.
- `analyze_run(run, *, ranks=None) -> Analysis`: the map on each rank (`analyze_rank`:
  steps, breakdown, collectives, FSDP ledger, timeline), then the reduce on their summaries
  (`reduce_run`: cross-rank matching, detectors, the Report assembled once).
- `analyze_paths(paths, *, progress=None, ranks=None) -> Report`: both of the above.

`progress`, when given, is called as `progress(done, total, label)` after each file is loaded.
Rank of a trace: `distributedInfo.rank`, else the run manifest, else the file name (rank-3,
rank3, rank_3, _3_of_8), else 0 with a warning.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
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


def _read_manifest(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "manifest.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise InputError(
            f"{path}: the run manifest is not valid JSON ({exc}); fix or remove it."
        ) from exc
    if not isinstance(data, dict):
        raise InputError(f"{path}: the run manifest is not a JSON object; fix or remove it.")
    return data


def manifest_ranks(manifest: dict[str, Any], run_dir: Path) -> dict[Path, int]:
    """Trace path -> rank from a manifest: any object holding an int "rank" and a trace path."""
    found: dict[Path, int] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            rank = node.get("rank")
            if isinstance(rank, int) and not isinstance(rank, bool):
                for value in _strings(node):
                    if value.endswith(TRACE_SUFFIXES) and "timeline" not in value:
                        found[(run_dir / value).resolve()] = rank
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(manifest)
    return found


def _strings(node: dict[str, Any]) -> Iterable[str]:
    for v in node.values():
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            yield from (x for x in v.values() if isinstance(x, str))


def is_memory_timeline_name(path: Path) -> bool:
    """File names that `export_memory_timeline` outputs usually get (not Kineto traces)."""
    name = path.name.lower()
    return "timeline" in name or name.endswith((".raw.json.gz", ".raw.gz", ".raw.json"))


@dataclass
class Inputs:
    """What `discover` found: traces, explicit memory timelines, the manifest and run dir."""

    traces: list[Path]
    memory: list[Path]
    manifest: dict[str, Any] | None
    run_dir: Path | None


def _oom_records(run_dir: Path) -> list[Path]:
    """The per-rank out-of-memory records `zdiag run` leaves in a run directory."""
    return sorted((run_dir / "memory").glob("rank-*.oom.json"))


def discover(paths: list[Path]) -> Inputs:
    """The inputs under the given paths; InputError when none is usable.

    A run directory that ran out of memory before the profiler wrote any trace is usable: its
    out-of-memory records and manifest are still analyzed (the traces list is then empty).
    """
    if not paths:
        raise InputError("no input given; pass a trace file, several, or a run directory.")
    files: list[Path] = []
    memory: list[Path] = []
    manifest: dict[str, Any] | None = None
    run_dir: Path | None = None
    for p in paths:
        if not p.exists():
            raise InputError(f"{p}: no such file or folder; check the path.")
        if p.is_file() and p.name == "manifest.json":
            p = p.parent
        if p.is_dir():
            is_run_dir = (p / "manifest.json").is_file() or (p / "traces").is_dir()
            if is_run_dir:
                run_dir = run_dir or p
                m = _read_manifest(p)
                manifest = manifest or m
                found = sorted(x for x in (p / "traces").glob("*") if _is_trace_name(x))
            else:
                found = sorted(x for x in p.iterdir() if x.is_file() and _is_trace_name(x))
                if not found:
                    found = sorted(x for x in p.rglob("*") if x.is_file() and _is_trace_name(x))
            if not found and not (is_run_dir and _oom_records(p)):
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
    return Inputs(list(by_real.values()), memory, manifest, run_dir)


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


def _assign_rank(trace: RankTrace, manifest_map: dict[Path, int]) -> None:
    if trace.rank_source == "distributedInfo":
        return
    path = trace.source.resolve()
    if path in manifest_map:
        trace.rank, trace.rank_source = manifest_map[path], "manifest"
        return
    from_name = rank_from_file_name(path)
    if from_name is not None:
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
        for done, f in enumerate(files, start=1):
            if progress:
                progress(done - 1, len(files), f"reading {f.name}")
            traces.append(load_rank_trace(f))
            if progress:
                progress(done, len(files), f.name)
    manifest_map = manifest_ranks(manifest, run_dir) if manifest and run_dir else {}
    for t in traces:
        _assign_rank(t, manifest_map)
    traces.sort(key=lambda t: (t.rank, str(t.source)))
    run = RunData(ranks=traces, manifest=manifest, run_dir=run_dir, inputs=files)
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
        run.memory_timelines[rank] = mem
    if run_dir is not None:
        for t in traces:
            mem = run_dir / "memory" / f"rank-{t.rank}.timeline.json.gz"
            if mem.is_file():
                run.memory_timelines.setdefault(t.rank, mem)
            log = run_dir / "steps" / f"rank-{t.rank}.jsonl"
            if log.is_file():
                run.step_logs[t.rank] = log
    return run


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
    )


MAX_COLLECTOR_ERRORS_SHOWN = 5


def _collector_errors(manifest: dict[str, Any] | None) -> dict[int, list[str]]:
    """Rank -> what zdiag's collectors reported on it during the run (the manifest's
    `collector_errors`: a lost trace, a memory timeline with totals only, ...), at most 5 each."""
    ranks = (manifest or {}).get("ranks")
    out: dict[int, list[str]] = {}
    for entry in ranks if isinstance(ranks, list) else []:
        errors = entry.get("collector_errors") if isinstance(entry, dict) else None
        if isinstance(entry, dict) and isinstance(entry.get("rank"), int) and errors:
            out[entry["rank"]] = [str(e) for e in errors[:MAX_COLLECTOR_ERRORS_SHOWN]]
    return out


def _finished_steps(manifest: dict[str, Any] | None) -> dict[int, int]:
    """Rank -> steps finished, for the ranks of a `zdiag run` manifest that exited cleanly (an
    OOM's or a crash's last step is the failing one, kept)."""
    ranks = (manifest or {}).get("ranks")
    out: dict[int, int] = {}
    for entry in ranks if isinstance(ranks, list) else []:
        if not isinstance(entry, dict) or entry.get("exit_code") != 0 or entry.get("oom"):
            continue
        rank, steps = entry.get("rank"), entry.get("steps")
        if isinstance(rank, int) and isinstance(steps, int):
            out[rank] = steps
    return out


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
        if run.run_dir is not None and (run.run_dir / "memory" / f"rank-{rank}.oom.json").is_file():
            timeline.oom = True
        out.append(timeline)
    return out, warnings
