"""From paths to a Report through rank summaries: stored ones first, the map for the rest.

`analyze_via_summaries(paths, options)` is what `zdiag analyze` runs:

1. discover the inputs (inputs/discovery.py) and what the manifest says about each rank;
2. for each trace, a stored summary when one matches it (summary_store.py): the in-job summary
   beside it, else the summary cache entry; with `use_stored=False` (`--no-cache`) none is read;
3. the map (`summary_map.map_trace`) on the traces left, on an engine (summary_engines.py: this
   machine's processes, or Ray); their summaries are written to the cache (`write_cache`);
4. the reduce (`reduce.reduce_run`) on all summaries, in rank order.

Only the traces that have no matching stored summary are decoded; the Report is the same
either way (tests/unit/engine/test_summary_cache.py). `analyze_paths(paths)` is this pipeline without stored
summaries (nothing read, nothing written): what tests and benchmarks call, so that they run the
path users run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from zdiag.errors import InputError

from ..detectors.context import DetectorContext
from ..detectors.hang_finding import dump_warnings
from ..inputs.discovery import discover, json_bytes, manifest_ranks
from ..inputs.flight_dumps import find_dumps, read_dumps
from ..inputs.remote_traces import is_url, list_remote_traces
from ..rank.summary import (
    RankSummary,
    decode_summary,
    decode_summary_without_spans,
    inflate_summary,
)
from ..rank.timeline import select_timelines
from ..report import Report, StepTimeline
from ..run.wait_graph import analyze_dumps
from .pipeline import (
    Progress,
    attach_flight_recorder,
    load_model_facts,
    run_facts,
    run_level_data,
)
from .reduce import RunFacts, reduce_run
from .summary_engines import Engine, LocalEngine
from .summary_map import MapOutput, MapTask, RunContexts
from .summary_store import (
    EMPTY_CONTEXT_KEY,
    MAP_CODE_VERSION,
    StoredReads,
    StoredSummary,
    TraceIdentity,
    Untrusted,
    apply_context,
    cache_candidates,
    cache_path_for_writing,
    read_stored,
    summary_path_for,
    write_stored,
)


@dataclass(frozen=True)
class SummaryOptions:
    """How to get summaries: read stored ones (`use_stored`), write the cache (`write_cache`),
    keep only some ranks (`ranks`), and the engine of the map."""

    use_stored: bool = True
    write_cache: bool = True
    ranks: list[int] | None = None
    engine: Engine = field(default_factory=LocalEngine)


@dataclass
class SummarySources:
    """How many ranks came from in-job summaries, the cache, and the map."""

    in_job: int = 0
    cache: int = 0
    mapped: int = 0


@dataclass(frozen=True)
class SummaryRun:
    """The Report and where its summaries came from."""

    report: Report
    summaries: list[RankSummary]
    sources: SummarySources
    context: DetectorContext | None = None  # the detectors' context (fact sheet, step models)


@dataclass(frozen=True)
class _Found:
    """A summary decoded without its timeline's spans, and the file it came from (read again
    for the spans of the few timelines the Report shows)."""

    summary: RankSummary
    stored_at: Path
    origin: str


def _stored_for(
    trace: Path, manifest_rank: int | None, contexts: RunContexts, reads: StoredReads
) -> _Found | None:
    """The stored summary matching `trace` (in-job, else cache); None: a miss (OSError or
    InputError when the trace cannot be read to check its content)."""
    identity = TraceIdentity(trace)
    beside = summary_path_for(trace)
    stored = reads.read(beside)
    if (
        stored is not None
        and stored.zdiag_version == MAP_CODE_VERSION
        and identity.matches(stored.trace)
    ):
        summary = reads.decoded(stored, beside)
        if summary is not None and stored.context_key != contexts.key(summary.rank, manifest_rank):
            ctx = contexts.for_rank(summary.rank)
            summary = (
                apply_context(summary, ctx) if stored.context_key == EMPTY_CONTEXT_KEY else None
            )
        if summary is not None:
            return _Found(_with_source(summary, trace), beside, "in-job")
    for place in cache_candidates(trace):
        stored = reads.read(place)
        if (
            stored is None
            or stored.zdiag_version != MAP_CODE_VERSION
            or stored.context_key != contexts.key(stored.rank, manifest_rank)
            or not identity.matches(stored.trace)
        ):
            continue
        summary = reads.decoded(stored, place)
        if summary is not None:
            return _Found(_with_source(summary, trace), place, "cache")
    return None


def _with_source(summary: RankSummary, trace: Path) -> RankSummary:
    """The summary naming the trace as this analysis was given it."""
    return msgspec.structs.replace(summary, source=str(trace))


def _with_timelines(
    summaries: list[RankSummary], encoded: dict[str, bytes | Path]
) -> list[RankSummary]:
    """The summaries, those whose timelines the Report shows (`select_timelines`) with their
    spans decoded (from the map's compressed bytes, or the stored file read again): the others
    keep their timeline's rank and step only."""
    heads = [s.timeline for s in summaries if s.timeline is not None]
    chosen = select_timelines(heads, {s.rank: list(s.steps) for s in summaries})
    wanted = {(tl.rank, tl.step) for tl in chosen}
    out = []
    for s in summaries:
        if s.timeline is not None and (s.timeline.rank, s.timeline.step) in wanted:
            s = msgspec.structs.replace(s, timeline=_full_timeline(encoded[s.source]))
        out.append(s)
    return out


def _full_timeline(where: bytes | Path) -> StepTimeline | None:
    """The timeline with its spans, from a map output's `encode_summary` bytes or a stored
    summary file (None when the file changed meanwhile)."""
    try:
        if isinstance(where, Path):
            stored = read_stored(where)
            return None if stored is None else stored.decoded().timeline
        return decode_summary(where).timeline
    except (ValueError, Untrusted):
        return None


def _write_cache(out: MapOutput, raw: bytes, warnings: list[str]) -> None:
    """Write one map output to the cache (beside the trace, else the user cache); silent when
    neither place can be written (the cache only saves time), a warning when the folder beside
    the trace is not the user's own (cache_path_for_writing)."""
    place = cache_path_for_writing(Path(out.path), warnings)
    if place is not None:
        write_stored(
            place,
            StoredSummary(
                rank=out.rank, trace=out.trace, context_key=out.context_key, summary_msgpack=raw
            ),
        )


def _analyze_urls(
    urls: list[str], options: SummaryOptions, progress: Progress | None
) -> SummaryRun:
    """Traces in object storage: every one mapped (no stored summary), no manifest."""
    files = [t for u in urls for t in list_remote_traces(u)]
    contexts = RunContexts()
    outputs = []
    for done, out in enumerate(
        options.engine.run([MapTask(f, None, contexts) for f in files], 0), start=1
    ):
        outputs.append(out)
        if progress:
            progress(done, len(files), out.path)
    if all(o.events == 0 for o in outputs):
        raise InputError(
            f"{files[0]}: the traces hold no timed events; the profiler recorded nothing."
        )
    by_url = {o.path: o.summary for o in outputs}
    summaries = sorted(
        (decode_summary_without_spans(by_url[f]) for f in files),
        key=lambda s: (s.rank, s.source),
    )
    if options.ranks:
        summaries = [s for s in summaries if s.rank in set(options.ranks)]
    summaries = _with_timelines(summaries, dict(by_url))
    facts = RunFacts(inputs=tuple(files))
    reduction = reduce_run(summaries, facts)
    return SummaryRun(
        report=reduction.report,
        summaries=summaries,
        sources=SummarySources(mapped=len(outputs)),
        context=reduction.context,
    )


def _analyze_dumps_alone(dumps: list[Path], options: SummaryOptions) -> SummaryRun:
    """Flight-recorder dumps without a profiler trace: the reduce on no rank summaries, the
    dumps' wait graph being what the run recorded (the `hang` detector reads it). `--rank` is
    not applied: who waits for whom needs every rank's dump."""
    analysis = analyze_dumps(read_dumps(dumps))
    warnings = dump_warnings(analysis)
    if options.ranks:
        warnings.append(
            "--rank is not applied to flight-recorder dumps: every rank's dump is analyzed"
        )
    facts = RunFacts(
        warnings=tuple(warnings),
        flight_recorder=analysis,
        flight_recorder_inputs=tuple(str(p) for p in dumps),
        flight_recorder_only=True,
    )
    report = reduce_run([], facts).report
    return SummaryRun(report=report, summaries=[], sources=SummarySources())


class _ByteProgress:
    """`progress(done, total, label)` in bytes of JSON: a trace counts its size when its summary
    is found or mapped, and a trace decoded in this process moves the line batch by batch
    (`reading`), so one big file advances too and many files advance per file."""

    def __init__(self, progress: Progress | None, sizes: dict[str, int]) -> None:
        self.progress = progress
        self.sizes = sizes
        self.total = sum(sizes.values())
        self.finished = 0

    def done(self, path: str, label: str) -> None:
        """The trace at `path` is summarized."""
        self.finished += self.sizes.get(path, 0)
        if self.progress:
            self.progress(self.finished, self.total, label)

    def reading(self, path: str, share: float) -> None:
        """`share` of the trace at `path` is decoded."""
        if self.progress:
            partial = int(share * self.sizes.get(path, 0))
            self.progress(self.finished + partial, self.total, f"reading {Path(path).name}")


def analyze_via_summaries(
    paths: list[Path] | list[str],
    options: SummaryOptions | None = None,
    *,
    progress: Progress | None = None,
) -> SummaryRun:
    """The Report of the traces under `paths`, from stored summaries where they match and the
    map elsewhere (see the module docstring)."""
    options = options or SummaryOptions()
    urls = [str(p) for p in paths if is_url(p)]
    local_paths = [Path(p) for p in paths if not is_url(p)]
    if urls and not local_paths:
        return _analyze_urls(urls, options, progress)
    if urls:
        raise InputError(
            f"{urls[0]}: URLs and local paths cannot be mixed in one analysis; pass either."
        )
    dumps, local_paths = find_dumps(local_paths)
    if dumps and not local_paths:
        return _analyze_dumps_alone(dumps, options)
    return _analyze_local(local_paths, dumps, options, progress)


def _analyze_local(
    local_paths: list[Path], dumps: list[Path], options: SummaryOptions, progress: Progress | None
) -> SummaryRun:
    """The Report of local traces (and the flight-recorder `dumps` found beside them): stored
    summaries where they match, the map for the rest, then the reduce."""
    found = discover(local_paths)
    warnings = list(found.warnings)
    manifest_map = (
        manifest_ranks(found.manifest, found.run_dir, warnings)
        if found.manifest and found.run_dir
        else {}
    )
    model, model_warnings = load_model_facts(found.run_dir)
    contexts = RunContexts.of(found.manifest, model)
    sources = SummarySources()
    by_path: dict[str, RankSummary] = {}
    encoded: dict[str, bytes | Path] = {}
    tasks: list[MapTask] = []
    missing_bytes = 0
    reads = StoredReads()
    meter = _ByteProgress(
        progress, {str(t): json_bytes(t) for t in found.traces} if progress else {}
    )
    for trace in found.traces:
        manifest_rank = manifest_map.get(trace.resolve())
        hit = None
        if options.use_stored:
            try:
                hit = _stored_for(trace, manifest_rank, contexts, reads)
            except (OSError, InputError):  # unreadable now: the map says so in one sentence
                hit = None
        if hit is not None:
            by_path[str(trace)] = hit.summary
            encoded[str(trace)] = hit.stored_at
            if hit.origin == "in-job":
                sources.in_job += 1
            else:
                sources.cache += 1
            meter.done(str(trace), f"{hit.origin} {trace.name}")
            continue
        tasks.append(MapTask(str(trace), manifest_rank, contexts))
        missing_bytes += json_bytes(trace)
    outputs: list[MapOutput] = []
    for out in options.engine.run(tasks, missing_bytes, meter.reading):
        outputs.append(out)
        meter.done(out.path, Path(out.path).name)
    if outputs and not by_path and all(o.events == 0 for o in outputs):
        names = ", ".join(o.path for o in outputs[:3])
        raise InputError(
            f"{names}: the trace holds no timed events; the profiler recorded nothing (check that "
            "its schedule reached an active step and that prof.step() is called)."
        )
    for out in outputs:
        raw = inflate_summary(out.summary)
        by_path[out.path] = decode_summary_without_spans(raw, compressed=False)
        encoded[out.path] = out.summary  # compressed: the spans of a few are decoded later
        sources.mapped += 1
        if options.write_cache and out.events:
            _write_cache(out, raw, warnings)
    warnings += reads.warnings()
    summaries = [by_path[str(t)] for t in found.traces]
    summaries.sort(key=lambda s: (s.rank, s.source))
    run = run_level_data(found, [s.rank for s in summaries], warnings)
    attach_flight_recorder(run, dumps)
    if options.ranks:
        present = {s.rank for s in summaries}
        missing = sorted(set(options.ranks) - present)
        if missing:
            have = ", ".join(str(s.rank) for s in summaries)
            raise InputError(
                f"rank(s) {', '.join(map(str, missing))} not found in the input (it has "
                f"rank(s) {have}); pick one of those with --rank."
            )
        summaries = [s for s in summaries if s.rank in set(options.ranks)]
    summaries = _with_timelines(summaries, encoded)
    reduction = reduce_run(summaries, run_facts(run, summaries, model, model_warnings))
    return SummaryRun(
        report=reduction.report, summaries=summaries, sources=sources, context=reduction.context
    )


def analyze_paths(
    paths: list[Path] | list[str],
    *,
    progress: Progress | None = None,
    ranks: list[int] | None = None,
) -> Report:
    """The Report `zdiag analyze --no-cache` gives for `paths` (every trace decoded; no stored
    summary read or written), keeping only `ranks` when given. Flight-recorder dumps among the
    inputs (or filling a folder) add the `hang` finding (analyzers/run/wait_graph.py)."""
    options = SummaryOptions(use_stored=False, write_cache=False, ranks=ranks)
    return analyze_via_summaries(paths, options, progress=progress).report
