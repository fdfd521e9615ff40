"""The `Renderer` protocol every output format implements, and the registry the commands use.

A renderer turns a Report into one output and hands it to a `Destination` (a file, written under
the rules of `zdiag.render.output`, or standard output). The terminal UI is a renderer too: it
draws on the terminal and accepts only standard output as its destination.

`get_renderer(name)` imports a renderer's module only when it is used, so `zdiag analyze` without
`--html` never loads plotly and nothing but `--tui` loads Textual.

Adding a renderer: a subclass of `Renderer` (so mypy checks it) with `name` and
`render(report, destination)` in its own module, and one line in `RENDERERS`;
tests/test_renderers.py then runs it on every test Report.
"""

from __future__ import annotations

import importlib
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
