"""Render a Report into a file the way the commands do: the renderer makes the bytes, the one
writer (`zdiag.render.output.write_rendered`) writes them."""

from __future__ import annotations

from pathlib import Path

from zdiag.analyzers.report import Report
from zdiag.render.output import write_rendered
from zdiag.render.renderer import Destination, Rendered, get_renderer, output_format


def render_file(name: str, report: Report, path: Path) -> Rendered:
    """Render `report` in format `name` for the file `path` and write it; the Rendered (its
    notes are complete)."""
    destination = Destination(path)
    rendered = get_renderer(name).render(report, destination)
    write_rendered(rendered, destination, output_format(name))
    return rendered
