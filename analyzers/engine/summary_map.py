"""The map as a task: one trace path in, its encoded `RankSummary` out (picklable both ways).

`map_trace(task)` decodes one trace, gives it its rank (`assign_rank`: distributedInfo, else the
run manifest, else the file name), runs `analyze_rank` with what the run says about that rank
(`RunContexts.for_rank`) and returns the summary as `encode_summary` bytes with the trace's
fingerprint and the context key: small values, so a process pool or a Ray worker next to the
files returns kilobytes per rank, never the trace. Engines (summary_engines.py) run it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ...collectors.run_records import Manifest, check_rank
from ..inputs.events import RankTrace
from ..inputs.loader import rank_from_file_name
from ..inputs.model_facts import ModelFacts
from ..inputs.registry import trace_reader_for
from ..inputs.remote_traces import fetched, is_url
from ..rank.rank_analysis import RankContext, analyze_rank
from ..rank.summary import decode_summary, encode_summary, summarize
from .summary_store import TraceFingerprint, context_key, fingerprint

MAX_COLLECTOR_ERRORS_SHOWN = 5


@dataclass(frozen=True)
class RunContexts:
    """What a run manifest says about each rank, for `RankContext`s (see rank_analysis.py)."""

    finished_steps: dict[int, int] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    collector_errors: dict[int, tuple[str, ...]] = field(default_factory=dict)
    unit_param_bytes: dict[str, int] = field(default_factory=dict)
    world_size: int | None = None
    thread_groups: dict[int, dict[int, str]] = field(default_factory=dict)

    @staticmethod
    def of(manifest: Manifest | None, model: ModelFacts | None = None) -> RunContexts:
        """The contexts of a run manifest (empty ones without a manifest or model description).

        unit sizes, for collectives recorded without shapes: the captured model description's
        units, then the manifest's (zdiag's harness reports its own);
        finished steps: ranks whose end is known (a clean exit, an exception, an OOM, a signal,
        a hang; `failures` says how the others failed), so the step a failure interrupted is left
        out like a clean exit's teardown step; collector errors: at most
        MAX_COLLECTOR_ERRORS_SHOWN per rank; thread groups: each rank's gloo threads per group.
        """
        unit_bytes = dict(model.trace_unit_bytes()) if model is not None else {}
        if manifest is None:
            return RunContexts(unit_param_bytes=unit_bytes)
        ended = ended_steps(manifest)
        return RunContexts(
            finished_steps={r: steps for r, (steps, _) in ended.items()},
            failures={r: how for r, (_, how) in ended.items() if how is not None},
            collector_errors={
                e.rank: tuple(e.collector_errors[:MAX_COLLECTOR_ERRORS_SHOWN])
                for e in manifest.ranks
                if e.collector_errors
            },
            unit_param_bytes={**unit_bytes, **manifest.unit_param_bytes()},
            world_size=manifest.world_size,
            thread_groups={e.rank: g for e in manifest.ranks if (g := e.thread_groups())},
        )

    def for_rank(self, rank: int) -> RankContext:
        """The RankContext of one rank."""
        return RankContext(
            finished_steps=self.finished_steps.get(rank),
            failure=self.failures.get(rank),
            collector_errors=self.collector_errors.get(rank, ()),
            unit_param_bytes=self.unit_param_bytes,
            thread_groups=self.thread_groups.get(rank, {}),
        )

    def key(self, rank: int, manifest_rank: int | None) -> str:
        """The context key (summary_store.context_key) of a rank read from a given file."""
        return context_key(self.for_rank(rank), manifest_rank, self.world_size)


def ended_steps(manifest: Manifest) -> dict[int, tuple[int, str | None]]:
    """Rank -> (steps finished, how it failed or None), for the ranks of a `zdiag run` manifest
    whose end is known: a clean exit, an exception, a signal or a hang. A rank with no recorded
    end (SIGKILLed) is left out: its step count may predate its last events."""
    out: dict[int, tuple[int, str | None]] = {}
    for e in manifest.ranks:
        if e.exit_code == 0 and not e.oom:
            out[e.rank] = (e.steps, None)
        elif e.oom:
            out[e.rank] = (e.steps, "ran out of memory")
        elif e.exit_code is not None and e.error:
            out[e.rank] = (e.steps, f"raised {e.error.split(':')[0]}")
        elif e.hang is not None:
            out[e.rank] = (e.steps, "hung")
        elif e.ended_by is not None:
            out[e.rank] = (e.steps, f"was ended by {e.ended_by.split(' ')[0]}")
    return out


@dataclass(frozen=True)
class MapTask:
    """One trace to summarize: its path, its rank in the manifest (None: not listed), the run's
    contexts, and how many processes may decode it (1: in the task's own process)."""

    path: str
    manifest_rank: int | None
    contexts: RunContexts
    decode_workers: int | None = 1


@dataclass(frozen=True)
class MapOutput:
    """A task's result: the encoded summary, what it was computed from, and the event count
    (0: the trace held no timed event)."""

    path: str
    rank: int
    summary: bytes
    trace: TraceFingerprint
    context_key: str
    events: int


def assign_rank(trace: RankTrace, manifest_rank: int | None, world_size: int | None = None) -> None:
    """The trace's rank: distributedInfo, else the manifest, else the file name (checked to be
    within 0..world_size-1, InputError otherwise), else 0 with a warning."""
    if trace.rank_source == "distributedInfo":
        return
    if manifest_rank is not None:
        trace.rank, trace.rank_source = manifest_rank, "manifest"
        return
    from_name = rank_from_file_name(trace.source.resolve())
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


def map_trace(task: MapTask, on_fraction: Callable[[float], None] | None = None) -> MapOutput:
    """The map on one trace file (see the module docstring); InputError for a bad trace.
    A URL (`s3://...`, remote_traces.py) is copied to a local temporary file first.
    `on_fraction` (in-process callers only) hears the share of a local trace's JSON decoded."""
    if is_url(task.path):
        with fetched(task.path) as local:
            out = map_trace(MapTask(str(local), task.manifest_rank, task.contexts, 1))
        summary = msgspec.structs.replace(decode_summary(out.summary), source=task.path)
        return MapOutput(
            task.path, out.rank, encode_summary(summary), out.trace, out.context_key, out.events
        )
    path = Path(task.path)
    before = fingerprint(path)  # a missing file, FIFO or device is one sentence, never read
    read = trace_reader_for(path).read
    trace: RankTrace = read(path, workers=task.decode_workers, on_fraction=on_fraction)
    assign_rank(trace, task.manifest_rank, task.contexts.world_size)
    summary = summarize(analyze_rank(trace, task.contexts.for_rank(trace.rank)))
    return MapOutput(
        path=task.path,
        rank=trace.rank,
        summary=encode_summary(summary),
        trace=before,
        context_key=task.contexts.key(trace.rank, task.manifest_rank),
        events=len(trace),
    )
