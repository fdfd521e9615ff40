"""The `Renderer` protocol every output format implements, and the registry of output formats.

A renderer is pure: `render(report, destination)` returns the bytes of each output plus notes
for the user (`Rendered`), and writes nothing; `zdiag.render.output.write_rendered` writes them
(never over an input, files atomically, devices and FIFOs written through) and says on stderr
what it wrote. The `Destination` tells the renderer what it needs to know of where its bytes go:
a file's name (Perfetto gzips `.gz` names and splits `{rank}` names), or standard output with the
terminal's width and whether to colour. The terminal UI is no renderer: it is a viewer (a
function that shows a Report until the user quits), registered here too so that it gets a flag.

`FORMATS` is the registry: each format's name (its flag is `--NAME`), where its renderer or
viewer lives (imported on first use, so `zdiag analyze` without `--html` never loads plotly and
nothing but `--tui` loads Textual), its kind and its help. The commands' output flags are made
from it (`zdiag.commands.outputs`).

Adding a format: a `Renderer` subclass (so mypy checks it) in its own module, and one line in
`FORMATS`; tests/unit/render/test_renderers.py then runs it on every test Report, and `zdiag analyze` and
`zdiag render` get its `--NAME FILE` flag.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from zdiag.analyzers.report import Report, encode_report
from zdiag.render.terminal import DEFAULT_WIDTH, color_enabled, terminal_width


@dataclass(frozen=True)
class Destination:
    """Where a renderer's bytes go: `path`, or standard output when `path` is None; `width`
    columns and `color` describe the terminal (files: DEFAULT_WIDTH, no colour)."""

    path: Path | None = None
    width: int = DEFAULT_WIDTH
    color: bool = False
    verbose: bool = False  # text: every threshold and every evidence item (`--verbose`)

    @property
    def is_stdout(self) -> bool:
        """Whether this is standard output (the terminal, or whatever stdout is redirected to)."""
        return self.path is None

    @classmethod
    def stdout(cls) -> Destination:
        """Standard output, with the width to wrap at and whether to colour (see terminal.py)."""
        return cls(None, terminal_width(sys.stdout), color_enabled(sys.stdout))


@dataclass(frozen=True)
class Output:
    """One piece of rendered output: `data` for the file `path` (None: standard output)."""

    path: Path | None
    data: bytes


@dataclass(frozen=True)
class Rendered:
    """What a renderer made, for `zdiag.render.output.write_rendered` to write.

    `outputs` come in order, usually one (the destination's). A renderer with many (Perfetto's
    file per rank) yields them one at a time, so that only one is held in memory; `paths` names
    them all beforehand, so that the writer refuses an input among them before writing any.
    `notes` is what the user should know (shown on stderr after the outputs are written), e.g.
    ranks left out; it is complete once `outputs` has been consumed.
    """

    paths: tuple[Path | None, ...]
    outputs: Iterable[Output]
    notes: list[str] = field(default_factory=list)

    @classmethod
    def one(cls, destination: Destination, data: bytes, notes: Sequence[str] = ()) -> Rendered:
        """`data` for `destination`."""
        return cls((destination.path,), (Output(destination.path, data),), list(notes))

    def data(self) -> bytes:
        """The bytes of the only output (for a caller that wants them, not a file)."""
        (output,) = self.outputs
        return output.data


@runtime_checkable
class Renderer(Protocol):
    """Turns a Report into one output format, without writing it."""

    name: str
    """The format: "text", "json", "html", "perfetto"."""

    def render(self, report: Report, destination: Destination) -> Rendered:
        """The bytes of `report` for `destination` (raise UserError for what the user can fix)."""
        ...


class JsonRenderer(Renderer):
    """The versioned Report JSON (`zdiag.report/1`), one line."""

    name = "json"

    def render(self, report: Report, destination: Destination) -> Rendered:
        """The Report's JSON form followed by a newline."""
        return Rendered.one(destination, encode_report(report) + b"\n")


Kind = Literal["stream", "file", "viewer"]
"""stream: goes to standard output or `-o FILE` (its flag is a switch choosing it); file: its
flag names the file (`--NAME FILE`); viewer: shows the Report on the terminal (a switch)."""


@dataclass(frozen=True)
class OutputFormat:
    """One entry of the registry: a format, where it is implemented, and its flag."""

    name: str
    """The format's name; its flag is `--NAME`."""
    module: str
    attr: str
    """The `Renderer` class (a viewer: the function taking the Report) in `module`."""
    kind: Kind
    help: str
    """The flag's help."""
    wrote: str = ""
    """How the line on stderr names a file written ("zdiag: wrote WROTE to PATH"); "": no line."""
    commands: tuple[str, ...] = ("analyze", "render")
    """The commands that offer the flag."""

    @property
    def flag(self) -> str:
        """The command-line flag: `--NAME`."""
        return f"--{self.name}"

    @property
    def metavar(self) -> str | None:
        """FILE for a file format; None for a switch."""
        return "FILE" if self.kind == "file" else None


FORMATS: tuple[OutputFormat, ...] = (
    OutputFormat(
        "text",
        "zdiag.render.text",
        "TextRenderer",
        "stream",
        "the text report, to stdout or -o FILE (the default when nothing else is asked)",
        commands=("render",),  # `zdiag analyze` writes it unless --json is given
    ),
    OutputFormat(
        "json",
        "zdiag.render.renderer",
        "JsonRenderer",
        "stream",
        "write the Report as JSON to stdout (or -o FILE)",
        commands=("analyze",),  # `zdiag render` reads that JSON
    ),
    OutputFormat(
        "html",
        "zdiag.render.html",
        "HtmlRenderer",
        "file",
        "write the HTML report to FILE",
        wrote="the HTML report",
    ),
    OutputFormat(
        "perfetto",
        "zdiag.render.perfetto",
        "PerfettoRenderer",
        "file",
        "write a trace for ui.perfetto.dev to FILE: the ranks' traces with zdiag's tracks (step "
        "verdicts, findings); '{rank}' in FILE writes one file per rank, '.gz' gzips it",
        wrote="the trace for ui.perfetto.dev (traces and zdiag tracks)",
    ),
    OutputFormat(
        "tui",
        "zdiag.tui.report_app",
        "browse",
        "viewer",
        "browse the report in a terminal UI",
    ),
)
"""Every output format, in the order the commands produce them."""


def output_format(name: str) -> OutputFormat:
    """The registry entry called `name` (KeyError when there is none)."""
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise KeyError(name)


def get_renderer(name: str) -> Renderer:
    """The renderer of format `name` (a stream or file format), its module imported now."""
    fmt = output_format(name)
    if fmt.kind == "viewer":
        raise KeyError(f"{name} is a viewer, not a renderer")
    renderer: Renderer = getattr(importlib.import_module(fmt.module), fmt.attr)()
    return renderer


def get_viewer(name: str) -> Callable[[Report], None]:
    """The viewer of format `name`: a function that shows a Report until the user quits."""
    fmt = output_format(name)
    if fmt.kind != "viewer":
        raise KeyError(f"{name} is a renderer, not a viewer")
    viewer: Callable[[Report], None] = getattr(importlib.import_module(fmt.module), fmt.attr)
    return viewer
