"""The memory timeline file: torch's categorized export, else a totals-only timeline.

torch.profiler's `export_memory_timeline` rebuilds every tensor's life (which op created it, which
mutated it, when it was freed) from the allocation and free events the profiler recorded, and puts
its bytes in a category (parameter, activation, gradient, ...). Those events are recorded only on
threads that carry the profiler's thread-local state. A tensor whose last reference is dropped on
another thread is freed without an event: with gloo, the worker thread that runs a collective
often holds the last reference to its output (FSDP2's all-gather buffer) after the training thread
let go of it. When the allocator later hands the same address to a new tensor, torch gives it the
old tensor's allocation id, sees an allocation of a tensor that is still alive, and its data-flow
check fails (`AssertionError: version mismatch` in `torch/profiler/_memory_profiler.py`). It is a
race, so it hits some runs and ranks and not others. Open upstream: pytorch/pytorch#167838 (the
same assertion), pytorch/pytorch#192290 (memory events from worker threads are not recorded).

zdiag cannot make torch see those frees, so when the categorized export fails it writes the same
file format (`[times_us, sizes]`, one row of 9 columns per time) with every byte in the last,
"unknown" column: the total bytes allocated on the device over the window, rebuilt from the same
events with the missing frees repaired (a new allocation at an address still thought to be in use
first releases the old block: a missed free is accounted when its address is reused, so between
the two the total reads high). Memory allocated before the window and never freed during it
(parameters, optimizer state) is not counted on CPU, where the profiler's events are all there is;
on CUDA the caching allocator's own total, which every event carries, is used as is.
"""

from __future__ import annotations

import gzip
import json
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from .fsio import write_atomically

TIMELINE_COLUMNS = 9
"""Columns of a coalesced timeline row: an unused 0, seven categories, then "unknown" (torch's)."""

KNOWN_TORCH_BUG = "pytorch/pytorch#167838"
"""Upstream issue of torch's `AssertionError: version mismatch` (module docstring)."""

MAX_REASON_CHARS = 200
"""The longest exception message kept in a failure reason (torch's assertion dumps whole graphs)."""

AllocationEvent = tuple[int, int, int, int]
"""(time_ns, address, bytes: > 0 allocated, < 0 freed, allocator's total allocated after it)."""


def export_timeline(prof: Any, path: str | Path, device: str) -> str | None:
    """Write `prof`'s memory timeline for `device` to `path` (.json.gz), atomically.

    None: torch's categorized timeline was written. Otherwise torch's export failed, the
    totals-only timeline was written instead, and the answer says why torch failed (one line,
    `failure_reason`). Raises only if neither could be written.
    """
    try:
        write_atomically(path, lambda tmp: _torch_export(prof, tmp, device), ".timeline.json.gz")
        return None
    except Exception as exc:
        reason = failure_reason(exc)
    totals = totals_timeline(allocation_events(prof, device), use_allocator_total=_is_cuda(device))
    write_atomically(path, lambda tmp: _write_gzip_json(tmp, totals), ".timeline.json.gz")
    return reason


def is_known_torch_bug(exc: BaseException) -> bool:
    """Whether `exc` is torch's data-flow assertion on a free it did not record (#167838)."""
    return isinstance(exc, AssertionError) and "version mismatch" in str(exc)


def failure_reason(exc: BaseException) -> str:
    """Why torch's export failed, in one line: the exception as it is, cut short.

    Only torch's `AssertionError: version mismatch` is explained as the known problem (frees on
    other threads, such as gloo's, lost: pytorch/pytorch#167838); anything else (a disk error,
    an API change, MemoryError) is reported plainly, with no guess at its cause.
    """
    if is_known_torch_bug(exc):
        return (
            "AssertionError: version mismatch; torch loses the frees done on other threads, "
            f"such as gloo's: {KNOWN_TORCH_BUG}"
        )
    message = " ".join(str(exc).split())
    if len(message) > MAX_REASON_CHARS:
        message = message[: MAX_REASON_CHARS - 3] + "..."
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _torch_export(prof: Any, tmp: str, device: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export_memory_timeline is deprecated (FutureWarning)
        prof.export_memory_timeline(tmp, device=device)


def _is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def _write_gzip_json(tmp: str, data: Any) -> None:
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"))


def allocation_events(prof: Any, device: str) -> list[AllocationEvent]:
    """The profiler's allocation and free events on `device`, in time order (all threads)."""
    from torch._C._profiler import _EventType

    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", 0)
    found: list[AllocationEvent] = []
    for event in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        kind, fields = event.typed
        if kind == _EventType.Allocation and fields.alloc_size and fields.device == target:
            found.append(
                (event.start_time_ns, fields.ptr, fields.alloc_size, fields.total_allocated)
            )
    found.sort(key=lambda e: e[0])
    return found


def _walk(roots: Iterable[Any]) -> Iterator[Any]:
    stack = list(roots)
    while stack:
        event = stack.pop()
        yield event
        stack.extend(event.children)


def totals_timeline(
    events: Iterable[AllocationEvent], *, use_allocator_total: bool = False
) -> list[list[Any]]:
    """`[times_us, sizes]` (torch's coalesced format) with all bytes in the "unknown" column.

    `events` in time order. With `use_allocator_total` the allocator's own running total is the
    value (right even when events are missing: CUDA's caching allocator counts every thread);
    otherwise the total is rebuilt from the events (module docstring), starting from the bytes
    freed during the window that were allocated before it.
    """
    values = (
        [(t, total) for t, _, _, total in events]
        if use_allocator_total
        else _rebuilt_totals(list(events))
    )
    times: list[int] = []
    sizes: list[list[int]] = []
    for t_ns, total in values:
        t_us = int(t_ns / 1000)
        row = [0] * (TIMELINE_COLUMNS - 1) + [max(0, int(total))]
        if times and times[-1] == t_us:
            sizes[-1] = row  # one point per time: the state after its last event
        else:
            times.append(t_us)
            sizes.append(row)
    return [times, sizes]


def _rebuilt_totals(events: list[AllocationEvent]) -> list[tuple[int, int]]:
    """(time_ns, bytes in use) after each event, repairing frees the profiler did not record."""
    live: dict[int, int] = {}
    preexisting = 0
    for _, ptr, size, _ in events:
        if size > 0:
            live[ptr] = size
        elif live.pop(ptr, None) is None:
            preexisting -= size  # allocated before the window, freed during it
    live.clear()
    in_use = preexisting
    out: list[tuple[int, int]] = []
    for t_ns, ptr, size, _ in events:
        if size > 0:
            in_use += size - live.pop(ptr, 0)  # an old block here was freed unseen
            live[ptr] = size
        else:
            in_use -= live.pop(ptr, -size)
        out.append((t_ns, in_use))
    return out
