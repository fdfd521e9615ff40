"""`zdiag render REPORT.json`: re-render a saved `zdiag analyze --json` report, without the traces.

The report is the versioned Report JSON (`zdiag.report/1`), decoded with msgspec into the same
`Report` that `zdiag analyze` hands its renderers, so every format looks exactly as it would have
from the analysis. A missing, unreadable, corrupt or other-schema file is one sentence, exit 2.
Output paths follow zdiag.render.output: never the report itself, devices and FIFOs written
through, files atomically.
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from zdiag.commands.outputs import add_output_flags, asked, file_plan, produce
from zdiag.errors import ConfigError, InputError
from zdiag.render.renderer import Destination, output_format

if TYPE_CHECKING:
    from zdiag.analyzers.report import Report

EXAMPLES = """\
examples:
  zdiag analyze run_dir/ --json -o report.json      # once, where the traces are
  zdiag render report.json                          # the text report (same as --text)
  zdiag render report.json --html report.html       # the interactive page
  zdiag render report.json --perfetto overlay.json  # verdict/finding tracks for ui.perfetto.dev
  zdiag render report.json --tui                    # browse it in the terminal
  zdiag render report.json --text -o report.txt     # the text report into a file
"""


def load_report(path: Path) -> Report:
    """Read and decode a saved Report; InputError (one sentence) when it cannot be used."""
    from zdiag.analyzers.report import decode_report

    hint = "give a file written by 'zdiag analyze ... --json -o FILE'"
    try:
        st = os.stat(path)
    except FileNotFoundError as exc:
        raise InputError(f"{path} does not exist; {hint}.") from exc
    except OSError as exc:
        raise InputError(f"cannot read {path} ({exc.strerror}); {hint}.") from exc
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{path} is not a regular file; {hint}.")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {path} ({exc.strerror}); {hint}.") from exc
    try:
        return decode_report(data)
    except (ValueError, RecursionError) as exc:
        # decode_report names the problem: bad JSON, no zdiag schema, a newer schema, a bad field
        remedy = "upgrade zdiag to read it" if "newer" in str(exc) else hint
        raise InputError(f"{path} cannot be rendered: {exc}; {remedy}.") from exc


class RenderCommand:
    """`zdiag render`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of `zdiag render`."""
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        parser.epilog = EXAMPLES
        parser.add_argument(
            "report",
            nargs="?",
            type=Path,
            metavar="REPORT.json",
            help="a report saved with 'zdiag analyze ... --json -o REPORT.json' (zdiag.report/1)",
        )
        add_output_flags(parser, "render")
        parser.add_argument(
            "--output", "-o", type=Path, metavar="FILE", help="write the text report to FILE"
        )

    def run(self, args: argparse.Namespace) -> int:
        """Load the report, then write each asked-for format; returns the exit code."""
        from zdiag.render.output import check_outputs
        from zdiag.render.terminal import check_tui_possible

        if args.report is None:
            raise ConfigError(
                "no report given; pass a file saved with 'zdiag analyze ... --json -o FILE'."
            )
        wanted = asked(args)
        if wanted.viewers and args.output is not None:
            raise ConfigError("--tui draws on the terminal; drop -o or --tui.")
        if args.tui:
            check_tui_possible()
        check_outputs(wanted.targets(), inputs=[args.report])
        report = load_report(args.report)
        plan = file_plan(wanted)
        if wanted.stream or wanted.output is not None or not (plan or wanted.viewers):
            text = output_format("text")  # the text, unless only other formats are asked for
            destination = Destination.stdout() if args.output is None else Destination(args.output)
            plan.insert(0, (text, destination))
        produce(report, plan, wanted.viewers, inputs=[args.report], verbose=wanted.verbose)
        return 0


COMMAND = RenderCommand()
