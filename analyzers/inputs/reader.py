"""What every input format offers: a Reader with `sniff` and `read` (see `registry.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

InputKind = Literal[
    "trace",
    "memory-timeline",
    "cuda-snapshot",
    "model-description",
    "flight-recorder-dump",
    "remote",
]
"""The roles an input plays in an analysis."""


@dataclass(frozen=True)
class Reader:
    """One input format.

    `sniff(path, head)` says whether `path` is in this format, from its name and `head` (its
    first `registry.HEAD_BYTES` bytes; b"" for a URL, a folder or a file that cannot be read):
    it never reads the file itself. `read(path, ...)` reads it (InputError, one sentence, when
    it cannot); its further arguments and its result are the format's own.
    """

    name: str
    """A short id ("kineto-trace", "cuda-snapshot", ...)."""
    kind: InputKind
    """What the engine does with it: a "trace" is decoded into a `RankTrace` by the map (its
    `read(path, *, workers, on_fraction)` returns one); the other kinds are what the run recorded
    around the traces."""
    what: str
    """The format in words, for messages and docs."""
    sniff: Callable[[str | Path, bytes], bool]
    read: Callable[..., Any]
