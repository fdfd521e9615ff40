"""The decoded batches of one Kineto trace joined into trace-wide columns, in file order.

Batches (`kineto_batches.Batch`) are joined with their keys re-interned trace-wide and their
kept args re-indexed; the bad values each batch noted are raised here, in file order, as one
InputError sentence. Events whose time lies far outside the trace are then left out with a
warning (`drop_time_outliers`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zdiag.errors import InputError

from .kineto_batches import Batch, EventArgs, Ids, Problem


def check_number_column(problems: list[Problem | None], path: Path, field: str) -> None:
    """InputError for the first non-numeric value of a column, else for its first NaN/inf."""
    for kind, message in (
        ("value", "a non-numeric '{field}' ({bad!r})"),
        ("nan", "a NaN or infinite '{field}'"),
    ):
        bad = next((p for p in problems if p is not None and p[0] == kind), None)
        if bad is not None:
            what = message.format(field=field, bad=bad[1])
            raise InputError(f"{path}: an event has {what}; re-export the trace or fix that event.")


def check_ids(parts: list[Ids], path: Path, field: str) -> None:
    """InputError for an id no 64-bit integer holds (Kineto's ids are 64-bit)."""
    bad = next((p.out_of_range for p in parts if p.out_of_range is not None), None)
    if bad is not None:
        raise InputError(
            f"{path}: an event has an '{field}' of {bad}, beyond any 64-bit integer, so the "
            "trace is damaged; re-export it or fix that event."
        )


def join_ids(parts: list[Ids]) -> np.ndarray:
    """The trace-wide id column from the batches' columns (see `_id_values`)."""
    use_fast = all(p.fast is not None for p in parts)
    cols = [p.fast if use_fast or p.careful is None else p.careful for p in parts]
    return _concat([c for c in cols if c is not None], np.int64)


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    """The parts joined (an empty column of `dtype` when there are none)."""
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


@dataclass
class Columns:
    """All batches joined in file order (before sorting by time)."""

    ts: np.ndarray
    dur: np.ndarray
    key_id: np.ndarray  # into `keys`
    keys: list[tuple[Any, Any, Any, Any]]  # distinct (name, cat, pid, tid), first-seen order
    external_id: np.ndarray
    correlation: np.ndarray
    kept: dict[int, EventArgs]
    thread_names: dict[tuple[Any, Any], str]
    warnings: list[str] = field(default_factory=list)
    memory: list[tuple[Any, ...]] = field(default_factory=list)


def join_batches(batches: Iterable[Batch], path: Path) -> Columns:
    """Join batch columns in order: keys re-interned trace-wide, kept args re-indexed.

    Raises the InputError of the first bad 'ts' (then 'dur') value once every batch decoded,
    as the whole-document decode did (a decode error anywhere wins over a bad value).
    """
    key_index: dict[tuple[Any, Any, Any, Any], int] = {}
    parts: dict[str, list[Any]] = {
        k: [] for k in ("ts", "dur", "key_id", "ext", "corr", "ts_p", "dur_p")
    }
    kept: dict[int, EventArgs] = {}
    thread_names: dict[tuple[Any, Any], str] = {}
    memory: list[tuple[Any, ...]] = []
    offset = 0
    missing_time = 0
    for b in batches:
        missing_time += b.missing_time
        remap = np.fromiter(
            (key_index.setdefault(k, len(key_index)) for k in b.keys), np.int32, len(b.keys)
        )
        parts["key_id"].append(remap[b.key_id] if b.n else b.key_id)
        parts["ts"].append(b.ts)
        parts["dur"].append(b.dur)
        parts["ts_p"].append(b.ts_problem)
        parts["dur_p"].append(b.dur_problem)
        parts["ext"].append(b.external_id)
        parts["corr"].append(b.correlation)
        kept.update((offset + i, a) for i, a in b.kept.items())
        thread_names.update(b.thread_names)
        memory += b.memory
        offset += b.n
    check_number_column(parts["ts_p"], path, "ts")
    check_number_column(parts["dur_p"], path, "dur")
    check_ids(parts["ext"], path, "External id")
    check_ids(parts["corr"], path, "correlation")
    warnings = []
    if missing_time:
        warnings.append(
            f"{missing_time} complete events without a 'ts' or 'dur' (null or missing) were "
            "left out"
        )
    return Columns(
        ts=_concat(parts.pop("ts"), np.float64),
        dur=_concat(parts.pop("dur"), np.float64),
        key_id=_concat(parts.pop("key_id"), np.int32),
        keys=list(key_index),
        external_id=join_ids(parts.pop("ext")),
        correlation=join_ids(parts.pop("corr")),
        kept=kept,
        thread_names=thread_names,
        warnings=warnings,
        memory=memory,
    )


MAX_ABS_TS_US = float(2**53)
"""Beyond this `ts` (µs; year 2255 on the Unix clock) a double no longer holds microseconds."""
OUTLIER_SPAN_FACTOR = 10.0
"""An event is far outside the trace when it lies more than this many times the span of the
central 98% of start times (and at least `OUTLIER_MIN_MARGIN_US`) beyond that span."""
OUTLIER_MIN_MARGIN_US = 3600e6


def drop_time_outliers(cols: Columns) -> Columns:
    """`cols` without the events whose start or end lies far outside the trace's time span.

    One corrupt `ts` (1e300) would otherwise stretch every window the analysis computes until
    the real events' durations round to zero; they are left out with a warning instead.
    """
    ts, dur = cols.ts, cols.dur
    n = len(ts)
    if not n:
        return cols
    end = ts + np.maximum(dur, 0.0)
    keep = (np.abs(ts) <= MAX_ABS_TS_US) & (np.abs(end) <= MAX_ABS_TS_US)
    if keep.any():
        lo, hi = np.quantile(ts[keep], [0.01, 0.99], method="inverted_cdf")
        margin = max(OUTLIER_SPAN_FACTOR * float(hi - lo), OUTLIER_MIN_MARGIN_US)
        keep &= (ts >= lo - margin) & (end <= hi + margin)
    if keep.all():
        return cols
    dropped = int(n - keep.sum())
    first_bad = float(ts[np.flatnonzero(~keep)[0]])
    new_pos = np.cumsum(keep) - 1
    return Columns(
        ts=ts[keep],
        dur=dur[keep],
        key_id=cols.key_id[keep],
        keys=cols.keys,
        external_id=cols.external_id[keep],
        correlation=cols.correlation[keep],
        kept={int(new_pos[i]): a for i, a in cols.kept.items() if keep[i]},
        thread_names=cols.thread_names,
        warnings=[
            *cols.warnings,
            f"{dropped} events lie far outside the trace's time span (the first has ts "
            f"{first_bad:g} us) and were left out as damaged",
        ],
        memory=cols.memory,
    )
