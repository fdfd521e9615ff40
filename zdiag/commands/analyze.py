"""`zdiag analyze PATH...`: where each rank's step time went, and what to change.

Text by default; `--json` writes the versioned Report to stdout. `--html`, `--perfetto` and
`--tui` hand the same Report to the renderers. Files are written only after the analysis
succeeded, each through a temporary file and a rename. `--fail-on` turns findings into an exit
code for CI: 1 when a finding at that severity or worse exists.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from zdiag.errors import ConfigError

EXIT_FINDINGS = 1


class _ProgressBar:
    """A one-line progress bar on a terminal stream (only created when stderr is a TTY)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.started = time.monotonic()
        self.shown = False

    def __call__(self, done: int, total: int, label: str) -> None:
        width = 24
        filled = int(width * done / max(total, 1))
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.monotonic() - self.started
        self.stream.write(
            f"\rzdiag: loading [{bar}] {done}/{total} {label[:40]:<40} {elapsed:5.1f}s"
        )
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()


def _check_writable(option: str, target: Path | None) -> None:
    """Fail before the analysis (not after it) when an output file cannot be written there."""
    if target is None:
        return
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ConfigError(f"{option} {target}: is a folder; give a file name.")
    if not folder.is_dir():
        raise ConfigError(
            f"{option} {target}: the folder {folder} does not exist; create it first."
        )
    if not os.access(folder, os.W_OK):
        raise ConfigError(
            f"{option} {target}: the folder {folder} is not writable; choose another."
        )


class AnalyzeCommand:
    """`zdiag analyze`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of `zdiag analyze`."""
        parser.add_argument(
            "paths",
            nargs="*",
            metavar="PATH",
            type=Path,
            help="trace files (.json, .json.gz), a run directory, or a folder of per-rank traces",
        )
        parser.add_argument(
            "--json", action="store_true", help="write the Report as JSON to stdout"
        )
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
        parser.add_argument("--html", type=Path, metavar="FILE", help="also write an HTML report")
        parser.add_argument(
            "--perfetto",
            type=Path,
            metavar="FILE",
            help="also write a Perfetto/Chrome-trace overlay (step verdicts, findings)",
        )
        parser.add_argument(
            "--max-trace-gb",
            type=float,
            default=None,
            metavar="N",
            help="refuse an input file, or a .gz file's decompressed content, over N GiB "
            "(default 16, and a .gz file may expand at most 100x; giving N lifts that check)",
        )
        parser.add_argument("--tui", action="store_true", help="browse the report in a terminal UI")
        parser.add_argument(
            "--fail-on",
            choices=("warning", "critical"),
            help="exit 1 when a finding at this severity or worse exists (for CI)",
        )

    def run(self, args: argparse.Namespace) -> int:
        """Analyze, then print / write the outputs; returns the exit code."""
        from zdiag.analyzers.pipeline import analyze_paths
        from zdiag.analyzers.report import encode_report
        from zdiag.analyzers.safe_read import GIB, use_limits
        from zdiag.render._output import write_atomically
        from zdiag.render.text import render_text

        if not args.paths:
            raise ConfigError(
                "no input given; pass a trace file (.json or .json.gz), several, or a run directory."
            )
        if args.rank is not None and any(r < 0 for r in args.rank):
            raise ConfigError("--rank must be 0 or more.")
        max_gb = args.max_trace_gb
        if max_gb is not None and not 0 < max_gb < 1 << 20:
            raise ConfigError(f"--max-trace-gb must be a positive number of GiB, got {max_gb}.")
        for option, target in (
            ("--output", args.output),
            ("--html", args.html),
            ("--perfetto", args.perfetto),
        ):
            _check_writable(option, target)
        progress = None
        if not args.quiet and sys.stderr.isatty():
            progress = _ProgressBar(sys.stderr)
        max_bytes = None if max_gb is None else int(max_gb * GIB)
        try:
            with use_limits(max_bytes=max_bytes):
                report = analyze_paths(list(args.paths), progress=progress, ranks=args.rank)
        finally:
            if progress is not None:
                progress.close()

        # Outputs only after the analysis succeeded; files atomically.
        main = encode_report(report) + b"\n" if args.json else render_text(report).encode()
        if args.output is not None:
            write_atomically(args.output, main)
        elif not args.tui or args.json:
            sys.stdout.buffer.write(main)
            sys.stdout.flush()
        if args.html is not None:
            from zdiag.render.html import write_html

            write_html(report, args.html)
        if args.perfetto is not None:
            from zdiag.render.perfetto import write_overlay

            write_overlay(report, args.perfetto)
        if args.tui:
            from zdiag.tui.report_app import browse

            browse(report)
        if args.fail_on and report.findings_at_least(args.fail_on):
            return EXIT_FINDINGS
        return 0


COMMAND = AnalyzeCommand()
