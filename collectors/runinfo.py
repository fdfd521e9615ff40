"""The run-info hook: a training script (the built-in harness) tells zdiag what it is running.

`record_run_info(**info)` is safe to call from any script: it does nothing visible unless the process
runs under `zdiag run` or inside `zdiag.profile(...)`, where the info lands in the manifest. Keys
with a meaning in the manifest:

- `harness`: dict of the harness options (becomes `manifest["harness"]`);
- `fsdp_units`: list of `{"name": str, "param_count": int, "param_bytes": int}` (one per
  `fully_shard` unit, becomes `manifest["fsdp_units"]`);
- `memory_budget_bytes`: int or None (the emulated device capacity, `manifest["memory_budget_bytes"]`);
- `samples_per_step`: int, samples one rank processes per step (gives `samples_per_s` in live records).

Any other JSON-serializable key is kept under `manifest["run_info"]`. Calls merge: later values for
a key replace earlier ones.

`set_memory_reader(fn)` lets a script without CUDA allocator statistics (the harness's emulated
device budget on CPU) supply the step log's memory columns. Only the standard library is imported.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

_RUN_INFO: dict[str, Any] = {}
_LISTENERS: list[Callable[[dict[str, Any]], None]] = []

MemoryReader = Callable[[], tuple[int | None, int | None, int | None]]
_MEMORY_READER: list[MemoryReader] = []


def _json_safe(value: Any) -> Any:
    """`value` if JSON can encode it, else its string form (the manifest must always be writable)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, dict):
            return {str(k): _json_safe(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_json_safe(v) for v in value]
        return str(value)


def record_run_info(**info: Any) -> None:
    """Record facts about this run for the manifest (no-op outside `zdiag run` / `zdiag.profile`).

    Never raises: a value JSON cannot encode is stored as its string form.
    """
    try:
        _RUN_INFO.update({k: _json_safe(v) for k, v in info.items()})
        for listener in list(_LISTENERS):
            listener(dict(_RUN_INFO))
    except Exception:  # the hook must never break the training script
        pass


def current_run_info() -> dict[str, Any]:
    """A copy of what has been recorded so far in this process."""
    return dict(_RUN_INFO)


def add_listener(listener: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    """Call `listener(info)` on every `record_run_info`; returns a function that removes it."""
    _LISTENERS.append(listener)

    def remove() -> None:
        if listener in _LISTENERS:
            _LISTENERS.remove(listener)

    return remove


def set_memory_reader(reader: MemoryReader | None) -> None:
    """Register `reader() -> (allocated_bytes, reserved_bytes, peak_bytes)` for the step log.

    Used on CPU only (CUDA's allocator statistics take precedence). Called once per step from the
    step hook, so it must be cheap; any value may be None. `None` unregisters. A reader that raises
    is dropped after reporting once.
    """
    _MEMORY_READER.clear()
    if reader is not None:
        _MEMORY_READER.append(reader)


def memory_reader() -> MemoryReader | None:
    """The registered memory reader, if any."""
    return _MEMORY_READER[0] if _MEMORY_READER else None


def memory_budget_bytes(info: dict[str, Any]) -> int | None:
    """The device capacity the run was given: `memory_budget_bytes`, else the harness's GiB option."""
    value = info.get("memory_budget_bytes")
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    harness = info.get("harness")
    if isinstance(harness, dict):
        gib = harness.get("memory_budget_gb")
        if isinstance(gib, (int, float)) and gib > 0:
            return int(gib * 2**30)
    return None
