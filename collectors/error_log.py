"""A rank's collector errors: contained, said once on stderr, kept for its manifest part.

Nothing zdiag does may stop the training: every collector step that can fail runs through
`ErrorLog.guard`, which turns an exception into one message (`<where> failed: <type>: <text>`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

MAX_COLLECTOR_ERRORS = 10
"""Messages kept (and printed) per rank; later ones are dropped."""


class ErrorLog:
    """The collector errors of rank `rank`, in order (at most `MAX_COLLECTOR_ERRORS`)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.messages: list[str] = []

    def report(self, message: str) -> None:
        """Keep `message` for the manifest part and say it on stderr (the training goes on)."""
        if len(self.messages) < MAX_COLLECTOR_ERRORS:
            self.messages.append(message)
            print(
                f"zdiag (rank {self.rank}): {message}; training continues.",
                file=sys.stderr,
                flush=True,
            )

    def guard(self, where: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, or None when it raised (the exception is reported as `where` failing)."""
        try:
            return fn(*args)
        except Exception as exc:
            self.report(f"{where} failed: {type(exc).__name__}: {exc}")
            return None
