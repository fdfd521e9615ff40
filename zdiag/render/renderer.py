"""The `Renderer` protocol every output format implements, and the registry the commands use.

A renderer turns a Report into one output and hands it to a `Destination` (a file, written under
the rules of `zdiag.render.output`, or standard output). The terminal UI is a renderer too: it
draws on the terminal and accepts only standard output as its destination.

`get_renderer(name)` imports a renderer's module only when it is used, so `zdiag analyze` without
`--html` never loads plotly and nothing but `--tui` loads Textual.

Adding a renderer: a subclass of `Renderer` (so mypy checks it) with `name` and
`render(report, destination)` in its own module, and one line in `RENDERERS`;
tests/test_renderers.py then runs it on every test Report. `write_files` renders a Report to the
files the commands' options name and says on stderr what it wrote, with each renderer's `notes`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from zdiag.analyzers.report import Report, encode_report
from zdiag.render.output import write_output, write_stdout


@dataclass(frozen=True)
class Destination:
    """Where a renderer's bytes go: `path`, or standard output when `path` is None."""

    path: Path | None = None

    @property
    def is_stdout(self) -> bool:
        """Whether this is standard output (the terminal, or whatever stdout is redirected to)."""
        return self.path is None

    def write(self, data: bytes) -> None:
        """Write `data` there (files: atomically; see zdiag.render.output)."""
        if self.path is None:
            write_stdout(data)
        else:
            write_output(self.path, data)


STDOUT = Destination()


@runtime_checkable
class Renderer(Protocol):
    """Turns a Report into one output format."""

    name: str
    """The format: "text", "json", "html", "perfetto", "tui"."""
    notes: Sequence[str] = ()
    """What the user should know after `render` (shown on stderr), e.g. ranks left out."""

    def render(self, report: Report, destination: Destination) -> None:
        """Render `report` and write it to `destination` (raise UserError for what the user can fix)."""
        ...


class JsonRenderer(Renderer):
    """The versioned Report JSON (`zdiag.report/1`), one line."""

    name = "json"

    def render(self, report: Report, destination: Destination) -> None:
        """Write the Report's JSON form followed by a newline."""
        destination.write(encode_report(report) + b"\n")


RENDERERS: dict[str, tuple[str, str]] = {
    "text": ("zdiag.render.text", "TextRenderer"),
    "json": ("zdiag.render.renderer", "JsonRenderer"),
    "html": ("zdiag.render.html", "HtmlRenderer"),
    "perfetto": ("zdiag.render.perfetto", "PerfettoRenderer"),
    "tui": ("zdiag.tui.report_app", "TuiRenderer"),
}
"""Renderer name -> (module, class); imported on first use."""


def get_renderer(name: str) -> Renderer:
    """The renderer called `name` (one of RENDERERS), its module imported now."""
    module_name, class_name = RENDERERS[name]
    renderer: Renderer = getattr(importlib.import_module(module_name), class_name)()
    return renderer


WRITTEN = {
    "html": "the HTML report",
    "perfetto": "the trace for ui.perfetto.dev (traces and zdiag tracks)",
}
"""How the line on stderr names each file written (the path follows it)."""


def write_files(report: Report, targets: Sequence[tuple[str, Path | None]]) -> None:
    """Render `report` with each (renderer name, file) whose file is given, and say on stderr
    what was written, then the renderer's notes."""
    for name, target in targets:
        if target is None:
            continue
        renderer = get_renderer(name)
        renderer.render(report, Destination(target))
        print(f"zdiag: wrote {WRITTEN.get(name, name)} to {target}", file=sys.stderr)
        for note in renderer.notes:
            print(f"zdiag: note: {note}", file=sys.stderr)
