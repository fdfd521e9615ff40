"""Check a decoded `RankSummary` as strictly as the loader checks a trace.

A summary read from disk (an in-job summary, a cache entry) stands in for a trace, so whatever a
trace could not hold, a summary may not either: `check_summary` raises ValueError (one phrase,
for a warning: the caller then decodes the trace) when

- a number is not finite (NaN, inf) or an integer is out of the 64-bit range;
- the rank is not a rank (0..`MAX_RANK`), the world size is not one (1..`MAX_WORLD_SIZE`), or a
  part of the summary names another rank than the summary's own;
- a step number is negative or beyond 32 bits (-1, "outside every step", where allowed);
- the packed collective columns are not whole little-endian values, differ in length, or index
  past their `kinds`/`groups` tables, or their times are not finite;
- a memory timeline's columns differ in length or hold negative bytes;
- a list is longer than the map ever writes (`MAX_TIMELINE_SPANS`, `MAX_TIMELINE_POINTS`).

Strings are not restricted here: names come from traces too, and every text view makes them
printable (zdiag/render/printable.py).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from ...collectors.run_records import MAX_WORLD_SIZE
from ..inputs.loader import MAX_RANK
from ..memory.kineto_memory import MAX_TIMELINE_POINTS
from .summary import RankSummary
from .timeline import MAX_TIMELINE_SPANS

MAX_STEP = 2**31 - 1
"""Step numbers are ProfilerStep#N counters: 32-bit, as in the loader."""
_INT64 = 2**63

__all__ = ["MAX_STEP", "check_summary"]


def check_summary(summary: RankSummary) -> None:
    """Raise ValueError saying what is wrong when `summary` is not one the map could have made."""
    _check_numbers(summary, "summary")
    rank = summary.rank
    if not 0 <= rank <= MAX_RANK:
        raise ValueError(f"rank {rank} is not a rank (0 to {MAX_RANK})")
    for what, size in (
        ("world size", summary.world_size),
        ("facts.world_size", summary.facts.world_size),
    ):
        if size is not None and not 1 <= size <= MAX_WORLD_SIZE:
            raise ValueError(f"{what} {size} is not one (1 to {MAX_WORLD_SIZE})")
    _check_owner(summary)
    for s in summary.steps:
        _check_step(s.step, "a step", allow_none=False)
    if summary.timeline is not None:
        _check_step(summary.timeline.step, "the timeline's step", allow_none=False)
        if len(summary.timeline.spans) > MAX_TIMELINE_SPANS:
            raise ValueError(f"the timeline holds over {MAX_TIMELINE_SPANS} spans")
    if summary.ledger is not None:
        for r in summary.ledger.records:
            _check_step(r.step, "an FSDP collective's step", allow_none=True)
        for step in summary.ledger.steps:
            _check_step(step, "the ledger's step", allow_none=False)
    _check_columns(summary)
    _check_memory(summary)


def _check_owner(summary: RankSummary) -> None:
    """Every part that carries a rank carries the summary's."""
    parts: list[tuple[str, int]] = [("collective totals", c.rank) for c in summary.collective_stats]
    for what, part in (
        ("timeline", summary.timeline),
        ("ledger", summary.ledger),
        ("memory breakdown", summary.memory_breakdown),
        ("memory timeline", summary.memory_timeline),
    ):
        if part is not None:
            parts.append((what, part.rank))
    for what, rank in parts:
        if rank != summary.rank:
            raise ValueError(f"its {what} belong to rank {rank}, not to rank {summary.rank}")


def _check_step(step: int, what: str, *, allow_none: bool) -> None:
    low = -1 if allow_none else 0
    if not low <= step <= MAX_STEP:
        raise ValueError(f"{what} is {step}, not a step number ({low} to {MAX_STEP})")


_COLUMN_TYPES: dict[str, np.dtype[Any]] = {
    "start_us": np.dtype("<f8"),
    "end_us": np.dtype("<f8"),
    "kind": np.dtype("<u2"),
    "group": np.dtype("<u2"),
    "step": np.dtype("<i4"),
}


def _check_columns(summary: RankSummary) -> None:
    """The packed collective columns: whole values, one length, indexes inside their tables."""
    calls = summary.collectives
    lengths = set()
    for name, dtype in _COLUMN_TYPES.items():
        raw = getattr(calls, name)
        if len(raw) % dtype.itemsize:
            raise ValueError(f"its collective column {name} is not whole {dtype.name} values")
        lengths.add(len(raw) // dtype.itemsize)
    if len(lengths) > 1:
        raise ValueError("its collective columns differ in length")
    if not lengths or lengths == {0}:
        return
    cols = calls.columns(summary.rank)
    if not (np.isfinite(cols.start_us).all() and np.isfinite(cols.end_us).all()):
        raise ValueError("a collective's time is not a finite number")
    if int(cols.kind.max()) >= len(calls.kinds) or int(cols.group.max()) >= len(calls.groups):
        raise ValueError("a collective's kind or group indexes past its table")
    if int(cols.step.min()) < -1:
        raise ValueError("a collective's step is below -1")


def _check_memory(summary: RankSummary) -> None:
    tl = summary.memory_timeline
    if tl is None:
        return
    if len(tl.times_ms) > MAX_TIMELINE_POINTS:
        raise ValueError(f"its memory timeline holds over {MAX_TIMELINE_POINTS} points")
    for category, values in tl.bytes_by_category.items():
        if len(values) != len(tl.times_ms):
            raise ValueError(f"its memory timeline's {category!r} column differs in length")
        if any(v < 0 for v in values):
            raise ValueError(f"its memory timeline's {category!r} column holds negative bytes")


_SKIPPED = frozenset({str, bytes, bool, type(None)})


def _check_column(values: list[Any] | tuple[Any, ...], where: str) -> None:
    """`_check_numbers` over many values at once: only floats (None aside) are checked through
    their sum (finite unless a value is not, or the sum overflows: then value by value), only
    ints through their extremes; strings, bools and None need nothing; anything else goes value
    by value. The step models, the ledger and the process groups' member lists hold tens of
    thousands of values per rank."""
    kinds = set(map(type, values))
    if kinds <= _SKIPPED:
        return
    numbers = [v for v in values if v is not None] if type(None) in kinds else values
    kinds.discard(type(None))
    if kinds == {float} and math.isfinite(sum(numbers)):
        return
    if kinds == {int} and -_INT64 <= min(numbers) and max(numbers) < _INT64:
        return
    for v in values:
        _check_numbers(v, where)


def _check_sequence(items: list[Any] | tuple[Any, ...], where: str) -> None:
    """A list: structs of one class and tuples of one length a field (a column) at a time."""
    first = items[0]
    if isinstance(first, msgspec.Struct) and all(type(i) is type(first) for i in items):
        for name in first.__struct_fields__:
            _check_column([getattr(i, name) for i in items], f"{where}.{name}")
    elif type(first) is tuple and all(type(i) is tuple and len(i) == len(first) for i in items):
        for column in zip(*items, strict=True):
            _check_column(column, where)
    else:
        _check_column(items, where)


def _check_numbers(value: Any, where: str) -> None:
    """Every float finite and every int inside 64 bits, through structs, lists and dicts."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}, not a finite number")
    elif isinstance(value, bool) or isinstance(value, str | bytes) or value is None:
        return
    elif isinstance(value, int):
        if not -_INT64 <= value < _INT64:
            raise ValueError(f"{where} is an integer beyond 64 bits")
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            _check_numbers(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list | tuple):
        if len(value) > 1:
            _check_sequence(value, where)
            return
        for item in value:
            _check_numbers(item, where)
    elif isinstance(value, dict):
        for item in value.values():
            _check_numbers(item, where)
