"""From paths to a Report: discover inputs, load ranks, segment steps, break down, assemble.

Public entry points:

- `load_run(paths, *, progress=None) -> RunData`: find the traces (files, run directories, or
  folders of per-rank traces), decode each into a `RankTrace`, assign ranks.
- `analyze_run(run, *, ranks=None) -> Analysis`: steps and per-step breakdown per rank, the
  Report with ranks/steps/thresholds/collective totals filled, then the FSDP ledger, the
  cross-rank analysis and the detectors.
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

from zdiag import __version__
from zdiag.analyzers import flight_recorder, verdict
from zdiag.analyzers.breakdown import ActivitySets, breakdown_rank, collective_stats
from zdiag.analyzers.crossrank import analyze_crossrank
from zdiag.analyzers.decode_batches import auto_workers
from zdiag.analyzers.detectors import run_detectors
from zdiag.analyzers.events import RankTrace
from zdiag.analyzers.fsdp_ledger import build_ledger, manifest_unit_bytes
from zdiag.analyzers.loader import load_rank_trace, rank_from_file_name
from zdiag.analyzers.memory import load_memory_timeline
from zdiag.analyzers.report import Finding, MemoryTimeline, RankSummary, Report
from zdiag.analyzers.run_data import Analysis, RunData, StepWindows
from zdiag.analyzers.steps import drop_unfinished_tail, find_steps
from zdiag.analyzers.timeline import select_timelines, step_timeline
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
    """Steps, per-step breakdown, collective totals, timelines, memory and the optional stages.

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
    report = Report(
        zdiag_version=__version__,
        inputs=[str(p) for p in run.inputs],
        thresholds=verdict.thresholds(),
        run=_run_summary(run),
    )
    steps: dict[int, StepWindows] = {}
    breakdowns = {}
    finished = _finished_steps(run.manifest)
    collector_errors = _collector_errors(run.manifest)
    for t in run.ranks:
        t.warnings.extend(f"zdiag run: {e}" for e in collector_errors.get(t.rank, []))
        windows = find_steps(t)
        if t.rank in finished:
            windows, dropped = drop_unfinished_tail(windows, finished[t.rank])
            if dropped:
                t.warnings.append(
                    f"step {dropped[0]} left out: the run ended inside it (the profiler stopped "
                    "during the script's teardown, after its last optimizer step)"
                )
        steps[t.rank] = windows
        sets = ActivitySets(t)
        bds = breakdown_rank(t, windows, sets)
        breakdowns[t.rank] = bds
        report.collectives.extend(collective_stats(t, windows, sets))
        timeline = step_timeline(t, windows, bds, sets)
        if timeline is not None:
            report.timelines.append(timeline)
        _thin_trace_warnings(t)
        report.ranks.append(
            RankSummary(
                rank=t.rank,
                source=str(t.source),
                device=t.device,
                host=t.host,
                lanes=[lane.name for lane in t.lanes if lane.is_device]
                or [lane.name for lane in t.lanes],
                steps=bds,
                warnings=list(t.warnings),
                trace_start_us=t.trace_start_us,
                rank_source=t.rank_source,
                step_source=windows.source,
            )
        )
    report.timelines = select_timelines(report.timelines, breakdowns)
    report.memory.extend(_memory_timelines(run))
    report.warnings.extend(run.warnings)
    analysis = Analysis(steps=steps, breakdowns=breakdowns, report=report)
    _run_later_stages(run, analysis)
    return analysis


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
    """Load and analyze; the Report that `zdiag analyze` prints. Flight-recorder dumps among
    the inputs (or filling a folder) add the `hang` finding (analyzers/flight_recorder.py)."""
    dumps, paths = flight_recorder.find_dumps([Path(p) for p in paths])
    if dumps and not paths:
        return flight_recorder.flight_recorder_report(dumps, ranks=ranks)
    run = load_run(paths, progress=progress)
    report = analyze_run(run, ranks=ranks).report
    if dumps:
        flight_recorder.add_to_report(report, dumps)
    return report


def _memory_timelines(run: RunData) -> list[MemoryTimeline]:
    """Report.memory from the memory timelines found; a bad one is a warning, not an error."""
    out = []
    by_rank = {t.rank: t for t in run.ranks}
    for rank, path in sorted(run.memory_timelines.items()):
        t = by_rank.get(rank)
        if t is None:
            continue
        capacity = None
        if t.device_properties:
            mem = t.device_properties[0].get("totalGlobalMem")
            capacity = int(mem) if isinstance(mem, int | float) and mem > 0 else None
        try:
            origins = [t.trace_start_us]
            if t.base_time_ns:
                origins.append(t.trace_start_us + t.base_time_ns / 1000.0)
            timeline = load_memory_timeline(path, rank, origins, capacity)
        except InputError as exc:
            run.warnings.append(f"memory timeline skipped: {exc.message}")
            continue
        if run.run_dir is not None and (run.run_dir / "memory" / f"rank-{rank}.oom.json").is_file():
            timeline.oom = True
        out.append(timeline)
    return out


def _thin_trace_warnings(t: RankTrace) -> None:
    """Warnings saying what a valid but thin (or unusual) trace lacks."""
    if len(t) == 0:
        return
    gpus = {lane.pid for lane in t.lanes if lane.is_device}
    if len(gpus) > 1:
        t.warnings.append(
            f"the trace holds activity of {len(gpus)} GPUs: they are analyzed together as this "
            "rank's device time (one trace per rank and GPU gives per-GPU results)"
        )
    if not t.has_device_events:
        if t.device_properties:
            t.warnings.append(
                "the trace lists a GPU but holds no GPU kernels or copies: the breakdown uses host "
                "threads (record with ProfilerActivity.CUDA to see device time)"
            )
        else:
            t.warnings.append(
                "no GPU events (CPU-only run): lanes are host threads and communication is the "
                "gloo/c10d ops on them"
            )


def _run_summary(run: RunData) -> dict[str, Any] | None:
    summary: dict[str, Any] = {}
    ws = next((t.world_size for t in run.ranks if t.world_size), None)
    if ws:
        summary["world_size"] = ws
    backend = next(
        (t.distributed_info.get("backend") for t in run.ranks if t.distributed_info), None
    )
    if backend:
        summary["backend"] = backend
    if run.run_dir is not None:
        summary["run_dir"] = str(run.run_dir)
    if run.manifest:
        for key in ("schema", "world_size", "config", "versions", "scenario"):
            if key in run.manifest:
                summary[key] = run.manifest[key]
    return summary or None


# --- FSDP ledger, cross-rank, detectors -----------------------------------------------------


def _run_later_stages(run: RunData, analysis: Analysis) -> None:
    """FSDP ledger, cross-rank analysis, then detectors (they see the ledger and stragglers)."""
    report = analysis.report
    unit_bytes = manifest_unit_bytes(run.manifest)
    for t in run.ranks:
        w = analysis.steps[t.rank]
        report.fsdp_units.extend(
            build_ledger(
                t,
                w.step.tolist(),
                w.start_us.tolist(),
                w.end_us.tolist(),
                unit_param_bytes=unit_bytes,
            )
        )
    analyze_crossrank(run, analysis)
    findings: list[Finding] = list(run_detectors(run, analysis))
    report.findings.extend(findings)
