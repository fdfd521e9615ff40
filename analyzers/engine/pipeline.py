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
from pathlib import Path
from typing import Any

from zdiag.errors import InputError

from ...collectors.run_records import Manifest, check_rank
from ...collectors.rundir import (
    memory_snapshot_relpath,
    memory_timeline_relpath,
    oom_relpath,
    step_log_relpath,
)
from ..detectors.hang_finding import dump_warnings
from ..inputs.discovery import Inputs
from ..inputs.flight_dumps import read_dumps
from ..inputs.loader import rank_from_file_name
from ..inputs.memory_timeline import load_memory_timeline
from ..inputs.model_facts import ModelFacts, facts_from_run_dir
from ..inputs.oom_records import OomRecords, read_oom_records
from ..inputs.run_dir import capture_windows, run_file
from ..memory.preexisting import infer_preexisting
from ..memory.snapshot_input import SNAPSHOT_SKIPPED, SnapshotResult, load_breakdowns
from ..rank.summary import RankSummary
from ..report import MemoryTimeline
from ..run.core_use import host_cores
from ..run.run_data import RunData
from ..run.wait_graph import analyze_dumps
from .reduce import RunFacts
from .summary_map import MAX_COLLECTOR_ERRORS_SHOWN as MAX_COLLECTOR_ERRORS_SHOWN

Progress = Callable[[int, int, str], None]


def run_level_data(found: Inputs, ranks: list[int], warnings: list[str]) -> RunData:
    """A RunData without traces for the discovered inputs whose traces hold `ranks` (in file
    order, duplicates kept): the run-level warnings (`warnings` first), the memory timelines and
    the step logs of those ranks."""
    files, manifest, run_dir = found.traces, found.manifest, found.run_dir
    run = RunData(ranks=[], manifest=manifest, run_dir=run_dir, inputs=files + found.snapshots)
    run.warnings.extend(warnings)
    _add_snapshots(run, found.snapshots, ranks)
    if not files and run_dir is not None and not run.snapshots:
        stepped = manifest is None or any(e.steps for e in manifest.ranks)
        run.warnings.append(
            f"{run_dir}: no trace was written (the run failed before the profiler's active "
            "steps); only its manifest and memory records are analyzed. Profile from the first "
            "step with 'zdiag run --profile-steps 0:0:N' to see the steps before the failure."
            if stepped
            else f"{run_dir}: no trace was written (no rank finished a step before the run "
            "failed); only its manifest and memory records are analyzed."
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
    oom_records = read_oom_records(run.manifest, run.run_dir)
    snap = _snapshot_breakdowns(run, summaries, oom_records, model)
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
        oom_records=oom_records,
        model=model,
        warnings=tuple(
            run.warnings
            + (model_warnings or [])
            + memory_warnings
            + list(snap.warnings)
            + capture_notes(run.run_dir)
        ),
        memory=tuple(memory),
        memory_breakdowns=snap.breakdowns,
        manifest_summary=manifest_summary(run.manifest) if run.manifest else {},
        flight_recorder=run.flight_recorder,
        flight_recorder_inputs=tuple(run.flight_recorder_inputs),
        host_cores=host_cores(run.manifest, run.step_logs),
    )


def capture_notes(run_dir: Path | None) -> list[str]:
    """One line per triggered capture the run holds: this report is the fixed profiler window;
    each capture is its own window, analyzed on its own."""
    if run_dir is None:
        return []
    return [
        f"triggered capture {rel} ({n} rank trace(s)) is its own window: "
        f"zdiag analyze {run_dir / rel}"
        for rel, n in capture_windows(run_dir)
    ]


def _snapshot_breakdowns(
    run: RunData,
    summaries: list[RankSummary],
    oom_records: OomRecords,
    model: ModelFacts | None = None,
) -> SnapshotResult:
    """The snapshots of the analyzed ranks (all of them when no trace was given) broken down,
    on the device each rank used and against its capacity, when known: the device's memory, or
    the smaller budget the run capped its allocator at (an OOM record's `memory_budget_bytes`,
    e.g. `torch.cuda.set_per_process_memory_fraction`)."""
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
    result = load_breakdowns(
        todo,
        devices=devices,
        capacity=_capacities(by_rank, oom_records),
        world_size=world,
        oom_ranks=frozenset(r for r, e in entries.items() if e.oom),
        resharded_after_forward=_reshards_after_forward(model),
    )
    held = _rank_param_bytes(model)
    for breakdown in result.breakdowns:
        said = infer_preexisting(breakdown.category_bytes, held)
        if said:
            breakdown.preexisting_inferred = said
    return result


def _rank_param_bytes(model: ModelFacts | None) -> int | None:
    """The parameter bytes one rank holds, from the captured model: its FSDP2 shards, its FSDP1
    flat-parameter shards, else the whole model (DDP, one device); None when not captured."""
    if model is None or model.inferred:
        return None
    fsdp2 = [u.sharded_bytes for u in model.fsdp2_units]
    if fsdp2 and all(b is not None for b in fsdp2):
        return sum(b for b in fsdp2 if b is not None)
    if model.fsdp1_instances:
        return sum(i.sharded_bytes for i in model.fsdp1_instances) or None
    return model.description.param_bytes or None


def _reshards_after_forward(model: ModelFacts | None) -> bool:
    """True when the captured model's FSDP2 units all reshard after forward (the root aside:
    torch keeps it gathered by design, it runs first in backward)."""
    if model is None or model.inferred:
        return False
    units = [u for u in model.fsdp2_units if u.path]
    return bool(units) and all(u.reshard_after_forward for u in units)


def _capacities(by_rank: dict[int, RankSummary], oom_records: OomRecords) -> dict[int, int | None]:
    """Per rank, the smaller of the device's memory and the run's allocator budget."""
    out: dict[int, int | None] = {r: s.capacity_bytes for r, s in by_rank.items()}
    for rank, record in oom_records.by_rank.items():
        budget = record.memory_budget_bytes
        if budget is not None and budget > 0:
            device = out.get(rank)
            out[rank] = budget if device is None else min(device, budget)
    return out


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
