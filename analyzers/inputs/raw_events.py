"""A Kineto trace's events as they are in the file, for a view that copies them (the Perfetto
merge, zdiag/render/perfetto_merge.py): no decoding into columns, no analysis.

The file is read like every other input (`safe_read.read_input_bytes`: a regular file only,
gunzipped when it is gzip, within the size limits in force), so a trace path taken from a saved
report can neither hang the command on a FIFO nor exhaust memory with a gzip bomb.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from zdiag.errors import InputError

from .safe_read import read_input_bytes


def read_raw_events(path: Path) -> list[dict[str, Any]]:
    """The events (JSON objects) of the Kineto trace at `path`: its `traceEvents` list, or the
    file's top-level list. InputError (one sentence) when it cannot be read or holds none."""
    data = read_input_bytes(path, "trace")
    try:
        decoded = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise InputError(f"{path}: is not a JSON trace ({exc}); pass a Kineto trace.") from None
    events = decoded.get("traceEvents") if isinstance(decoded, dict) else decoded
    if not isinstance(events, list):
        raise InputError(f"{path}: holds no 'traceEvents' list; pass a Kineto trace.")
    return [e for e in events if isinstance(e, dict)]
