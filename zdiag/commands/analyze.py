"""`zdiag analyze PATH...`: where each rank's step time went, and what to change.

Text by default; `--json` writes the versioned Report to stdout. `--html`, `--perfetto` and
`--tui` hand the same Report to the renderers and the viewer (the output flags come from the
registry of formats: zdiag/commands/outputs.py). Output paths are checked before the analysis
(an output never overwrites an input: zdiag.render.output); files are written only after the
analysis succeeded, within the same read limits (the Perfetto merge reads the traces again).
`--fail-on` turns findings into an exit code for CI: 1 when a finding at that severity or worse
exists.

Summaries: each rank's map result is read from its in-job summary or the summary cache when one
matches its trace, and written to the cache otherwise (analyzers/engine/summary_store.py; `--no-cache`
decodes every trace and writes nothing). `--engine ray` runs the map as Ray tasks.
"""

from __future__ import annotations

import argparse
import sys
import time
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from zdiag.commands.outputs import Asked, add_output_flags, asked, file_plan, produce
from zdiag.errors import ConfigError
from zdiag.render.renderer import Destination, OutputFormat, output_format
from zdiag.render.terminal import terminal_width

if TYPE_CHECKING:
    from zdiag.analyzers.engine.summary_pipeline import SummaryOptions

EXIT_FINDINGS = 1
MAX_PROGRESS_WIDTH = 80


def _columns(text: str) -> int:
    """Terminal columns `text` takes (East Asian wide and full-width characters take two)."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def _fit_left(text: str, room: int) -> str:
    """`text` in at most `room` columns: its end kept, "…" in front when cut."""
    if _columns(text) <= room:
        return text
    if room < 2:
        return ""
    kept = ""
    for ch in reversed(text):
        if _columns(kept) + _columns(ch) > room - 1:
            break
        kept = ch + kept
    return "…" + kept


class _ProgressBar:
    """A one-line progress bar on a terminal stream (only created when stderr is a TTY), never
    wider than the terminal nor MAX_PROGRESS_WIDTH columns (wide characters count twice); it
    shows the share done of what it is given: bytes of JSON from `analyze_via_summaries`, so
    one big trace moves it as its batches decode."""

    def __init__(self, stream: TextIO, width: int | None = None) -> None:
        self.stream = stream
        self.width = min(width or terminal_width(stream), MAX_PROGRESS_WIDTH) - 1
        self.started = time.monotonic()
        self.shown = False

    def __call__(self, done: int, total: int, label: str) -> None:
        elapsed = time.monotonic() - self.started
        bar_width = 20
        filled = int(bar_width * done / max(total, 1))
        bar = "#" * filled + "." * (bar_width - filled)
        head = f"zdiag: [{bar}] {100 * done // max(total, 1):3d}% "
        tail = f" {elapsed:5.1f}s"
        room = max(self.width - len(head) - len(tail), 0)
        label = _fit_left("".join(ch if ch.isprintable() else "?" for ch in label), room)
        pad = " " * (room - _columns(label))
        self.stream.write(f"\r{head}{label}{pad}{tail}")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


class AnalyzeCommand:
    """`zdiag analyze`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of `zdiag analyze`."""
        parser.add_argument(
            "paths",
            nargs="*",
            metavar="PATH",
            help=(
                "trace files (.json, .json.gz), a run directory, a folder of per-rank traces, "
                "CUDA memory snapshots (.pickle; files or a folder of them), "
                "torch.distributed flight-recorder dumps (files or a folder of them), or a URL of "
                "traces in object storage (s3://..., read through fsspec)"
            ),
        )
        add_output_flags(parser, "analyze")
        parser.add_argument(
            "--output",
            "-o",
            type=Path,
            metavar="FILE",
            help="write the text (or, with --json, the JSON) to FILE instead of stdout",
        )
        parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
        parser.add_argument(
            "--rank",
            type=int,
            action="append",
            metavar="N",
            help="analyze only rank N (repeatable)",
        )
        parser.add_argument(
            "--max-trace-gb",
            type=float,
            default=None,
            metavar="N",
            help="refuse an input file, or a .gz file's decompressed content, over N GiB "
            "(default 16, and a .gz file may expand at most 100x; giving N lifts that check)",
        )
        parser.add_argument(
            "--no-cache",
            action="store_true",
            help="decode every trace: read no stored summary (in-job or cached) and write none "
            "(also ZDIAG_CACHE=off)",
        )
        parser.add_argument(
            "--engine",
            choices=("local", "ray"),
            default="local",
            help="where the per-rank map runs: this machine's cores (default) or Ray tasks "
            "(pip install 'zdiag[ray]')",
        )
        parser.add_argument(
            "--ray-address",
            metavar="ADDR",
            help="with --engine ray: an existing cluster ('auto', 'ray://head:10001'); default: "
            "a local one started for this call",
        )
        parser.add_argument(
            "--fail-on",
            choices=("warning", "critical"),
            help="exit 1 when a finding at this severity or worse exists (for CI)",
        )

    def run(self, args: argparse.Namespace) -> int:
        """Analyze, then print / write the outputs; returns the exit code."""
        from zdiag.analyzers.engine.summary_pipeline import analyze_via_summaries
        from zdiag.analyzers.inputs.remote_traces import is_url
        from zdiag.analyzers.inputs.safe_read import GIB, use_limits
        from zdiag.render.output import check_outputs

        wanted = asked(args)
        options = _options(args)
        inputs = [Path(p) for p in args.paths if not is_url(p)]
        check_outputs(wanted.targets(), inputs=inputs)
        progress = None
        if not args.quiet and sys.stderr.isatty():
            progress = _ProgressBar(sys.stderr)
        max_bytes = None if args.max_trace_gb is None else int(args.max_trace_gb * GIB)
        with use_limits(max_bytes=max_bytes):  # the Perfetto merge reads the traces again
            try:
                paths = [p if is_url(p) else Path(p) for p in args.paths]
                report = analyze_via_summaries(paths, options, progress=progress).report
                if len(inputs) == 1 and inputs[0].is_dir() and not args.rank:
                    from zdiag.analyzers.engine.capture_reports import with_captures

                    report = with_captures(report, inputs[0], options)  # each its own window
            finally:
                if progress is not None:
                    progress.close()
            # Outputs only after the analysis succeeded.
            produce(report, _plan(wanted), wanted.viewers, inputs, verbose=wanted.verbose)
        if args.fail_on and report.findings_at_least(args.fail_on):
            return EXIT_FINDINGS
        return 0


def _options(args: argparse.Namespace) -> SummaryOptions:
    """The analysis options `args` give, after refusing the combinations that cannot work."""
    from zdiag.analyzers.engine.summary_engines import make_engine
    from zdiag.analyzers.engine.summary_pipeline import SummaryOptions
    from zdiag.analyzers.engine.summary_store import cache_disabled_by_env
    from zdiag.render.terminal import check_tui_possible

    if not args.paths:
        raise ConfigError(
            "no input given; pass a trace file (.json or .json.gz), several, or a run directory."
        )
    if args.rank is not None and any(r < 0 for r in args.rank):
        raise ConfigError("--rank must be 0 or more.")
    if args.tui:
        check_tui_possible(json_to_stdout=args.json and args.output is None)
    max_gb = args.max_trace_gb
    if max_gb is not None and not 0 < max_gb < 1 << 20:
        raise ConfigError(f"--max-trace-gb must be a positive number of GiB, got {max_gb}.")
    if args.ray_address and args.engine != "ray":
        raise ConfigError("--ray-address needs --engine ray.")
    use_cache = not (args.no_cache or cache_disabled_by_env())
    return SummaryOptions(
        use_stored=use_cache,
        write_cache=use_cache,
        ranks=args.rank,
        engine=make_engine(args.engine, args.ray_address),
    )


def _plan(wanted: Asked) -> list[tuple[OutputFormat, Destination]]:
    """The text (or the `--json` Report) to -o FILE or stdout (not with a viewer on the terminal
    unless a stream format was asked for), then the files the options name."""
    stream = wanted.stream or output_format("text")
    plan = file_plan(wanted)
    if wanted.output is not None:
        return [(stream, Destination(wanted.output)), *plan]
    if not wanted.viewers or wanted.stream is not None:
        return [(stream, Destination.stdout()), *plan]
    return plan


COMMAND = AnalyzeCommand()
