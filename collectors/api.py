"""Placeholder for the Python API for custom training loops (`zdiag.profile`); issue 3 builds it."""

from __future__ import annotations

from typing import Any


def profile(*args: Any, **kwargs: Any) -> Any:
    """Not built yet."""
    raise NotImplementedError("zdiag.profile is not available in this build yet")
