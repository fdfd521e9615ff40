"""What the text views need to know about the terminal: its width and whether to colour.

Colour follows the usual conventions: only on a terminal, never when `NO_COLOR` is set to
anything non-empty (https://no-color.org), and `FORCE_COLOR` (non-empty) turns it on for pipes
(`less -R`). `paint` wraps text in ANSI SGR codes; with colour off it returns the text as is.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from typing import TextIO

DEFAULT_WIDTH = 100
"""Width of text written to a file or a pipe (no terminal to measure)."""
MIN_WIDTH = 60

_SGR = {
    "bold": "1",
    "dim": "2",
    "red": "31",
    "green": "32",
    "yellow": "33",
    "blue": "34",
    "magenta": "35",
    "cyan": "36",
    "on_red": "41",
    "on_yellow": "43",
    "on_blue": "44",
    "white": "97",
    "black": "30",
}

VERDICT_STYLE: Mapping[str, str] = {
    "compute-bound": "green",
    "exposed-comm": "yellow",
    "comm-bound": "red bold",
    "host-bound": "magenta",
}
SEVERITY_STYLE: Mapping[str, str] = {
    "critical": "bold white on_red",
    "warning": "bold black on_yellow",
    "info": "bold white on_blue",
}


def color_enabled(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """Whether to colour what goes to `stream` (a TTY, NO_COLOR unset; FORCE_COLOR forces it)."""
    env = os.environ if environ is None else environ
    if env.get("NO_COLOR"):
        return False
    if env.get("FORCE_COLOR"):
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def terminal_width(stream: TextIO) -> int:
    """The width to wrap at: COLUMNS, else the terminal's, else DEFAULT_WIDTH (files, pipes)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return max(MIN_WIDTH, int(columns))
    try:
        if stream.isatty():
            return max(MIN_WIDTH, shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)
    except (AttributeError, ValueError):
        pass
    return DEFAULT_WIDTH


def paint(text: str, style: str, color: bool) -> str:
    """`text` in `style` (space-separated names: "bold red", "white on_red") when `color`."""
    if not color or not style or not text:
        return text
    codes = ";".join(_SGR[name] for name in style.split() if name in _SGR)
    return f"\x1b[{codes}m{text}\x1b[0m" if codes else text


def check_tui_possible(*, json_to_stdout: bool = False) -> None:
    """Refuse `--tui` (ConfigError, exit 2) when it cannot work: standard input or output is not
    a terminal (it would write escape codes into a file or wait on a pipe), or `--json` is to go
    to standard output too (the two would interleave)."""
    from zdiag.errors import ConfigError

    if json_to_stdout:
        raise ConfigError("--tui and --json both use standard output; add -o FILE for the JSON.")
    for name, stream in (("output", sys.stdout), ("input", sys.stdin)):
        try:
            tty = stream is not None and stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        if not tty:
            raise ConfigError(
                f"--tui needs a terminal, but standard {name} is not one; "
                "run it in a terminal, or drop --tui for the text report."
            )
