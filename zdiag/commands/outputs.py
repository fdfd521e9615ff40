"""The output flags of `zdiag analyze` and `zdiag render`, made from the registry of output
formats (`FORMATS` in zdiag/render/renderer.py), and the one loop that renders what they ask for
and hands it to the writer (`zdiag.render.output.write_rendered`).

A format offered by a command gets `--NAME FILE` (a file format: `--html`, `--perfetto`) or the
switch `--NAME` (a stream format choosing what goes to stdout or `-o FILE`: `--json`, `--text`;
a viewer: `--tui`). A new format is one renderer and one line in `FORMATS`: both commands get
its flag, check its file against their inputs before the analysis, render it and write it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from zdiag.render import renderer as registry
from zdiag.render.renderer import Destination, OutputFormat

if TYPE_CHECKING:
    from zdiag.analyzers.report import Report
    from zdiag.render.output import OutputTarget

OUTPUT_OPTION = "--output"


def _dest(fmt: OutputFormat) -> str:
    return fmt.name.replace("-", "_")


def add_output_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """The flag of every output format `command` offers, in the registry's order."""
    for fmt in registry.FORMATS:
        if command not in fmt.commands:
            continue
        if fmt.kind == "file":
            parser.add_argument(fmt.flag, type=Path, metavar=fmt.metavar, help=fmt.help)
        else:
            parser.add_argument(fmt.flag, action="store_true", help=fmt.help)
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="text: every finding's full evidence and every verdict and straggler threshold "
        "(by default each verdict shows the thresholds that decided it)",
    )


@dataclass(frozen=True)
class Asked:
    """The outputs a command line asks for (flags of formats a command does not offer: unset)."""

    stream: OutputFormat | None
    """The stream format whose switch is given (`--json`, `--text`), if any."""
    files: list[tuple[OutputFormat, Path]]
    """Each file format given a file, with it."""
    viewers: list[OutputFormat]
    """Each viewer asked for (`--tui`)."""
    output: Path | None
    """`-o FILE`: where the stream goes instead of standard output."""
    verbose: bool = False
    """`--verbose`: the text's full evidence and thresholds."""

    def targets(self) -> list[OutputTarget]:
        """Every file to write, for `check_outputs` (before the analysis)."""
        from zdiag.render.output import OutputTarget

        named = [] if self.output is None else [OutputTarget(OUTPUT_OPTION, self.output)]
        return named + [OutputTarget(fmt.flag, path) for fmt, path in self.files]


def asked(args: argparse.Namespace) -> Asked:
    """What `args` (parsed with `add_output_flags` and an `--output` option) asks for."""
    given = [fmt for fmt in registry.FORMATS if getattr(args, _dest(fmt), None)]
    return Asked(
        stream=next((fmt for fmt in given if fmt.kind == "stream"), None),
        files=[(fmt, getattr(args, _dest(fmt))) for fmt in given if fmt.kind == "file"],
        viewers=[fmt for fmt in given if fmt.kind == "viewer"],
        output=args.output,
        verbose=bool(getattr(args, "verbose", False)),
    )


def produce(
    report: Report,
    plan: Sequence[tuple[OutputFormat, Destination]],
    viewers: Sequence[OutputFormat],
    inputs: Sequence[Path],
    *,
    verbose: bool = False,
) -> None:
    """Render `report` for each (format, destination) of `plan` and write it, in order (one
    output in memory at a time); then show it in each viewer. `verbose`: `--verbose`."""
    from zdiag.render.output import write_rendered

    for fmt, destination in plan:
        destination = dataclasses.replace(destination, verbose=verbose)
        rendered = registry.get_renderer(fmt.name).render(report, destination)
        write_rendered(rendered, destination, fmt, inputs)
    for fmt in viewers:
        registry.get_viewer(fmt.name)(report)


def file_plan(wanted: Asked) -> list[tuple[OutputFormat, Destination]]:
    """The file formats' part of a plan: each given file, in the registry's order."""
    return [(fmt, Destination(path)) for fmt, path in wanted.files]
