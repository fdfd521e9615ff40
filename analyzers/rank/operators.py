"""Operators and kernels by name over one rank's analyzed steps, and their merge over ranks.

`operator_table(trace, windows)` counts, per name, the calls that start inside a step and their
inclusive time (a host op's time includes the ops nested in it, as in HTA's ops summary and
torch.profiler's `key_averages`): host ops, runtime calls and annotations against the steps'
host spans, kernels and copies against the steps' device windows. `ProfilerStep#N` itself is
left out (it is the step). The table keeps at most MAX_OPERATORS names, the most time first, and
says when it cut some. `merge_tables` turns the ranks' tables into one per-rank-per-step table
for the Report, which `zdiag diff` compares name by name.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ..inputs.events import EventKind, RankTrace
from ..report import OperatorRow, OperatorTable
from .steps import StepWindows

MAX_OPERATORS = 1000
"""Names kept per table (a real training trace has a few hundred; a longer tail is cut)."""

MAX_NAME_CHARS = 240
"""Longer names (templated kernel names run to thousands of characters) are cut, with "…"."""

HOST_KINDS = (
    EventKind.CPU_OP,
    EventKind.USER_ANNOTATION,
    EventKind.RUNTIME_LAUNCH,
    EventKind.RUNTIME_OTHER,
    EventKind.COMM_OP,
    EventKind.FSDP_ANNOTATION,
    EventKind.CPU_SYNC,
)
DEVICE_KINDS = (EventKind.COMPUTE_KERNEL, EventKind.COMM_KERNEL, EventKind.MEMCPY, EventKind.MEMSET)


def _inside(
    ts: npt.NDArray[np.float64], start: npt.NDArray[np.float64], end: npt.NDArray[np.float64]
) -> npt.NDArray[np.bool_]:
    """Which times fall in one of the (sorted, disjoint) windows [start, end)."""
    if len(start) == 0:
        return np.zeros(len(ts), dtype=bool)
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    j = np.searchsorted(start, ts, side="right") - 1
    ok = j >= 0
    ok[ok] = ts[ok] < end[j[ok]]
    return ok


def _short(name: str) -> str:
    return name if len(name) <= MAX_NAME_CHARS else name[: MAX_NAME_CHARS - 1] + "…"


def operator_table(trace: RankTrace, windows: StepWindows) -> OperatorTable:
    """The rank's operators and kernels per step (see the module docstring)."""
    steps = len(windows.step)
    if steps == 0 or len(trace) == 0:
        return OperatorTable(steps=steps)
    host = np.isin(trace.kind, np.asarray(HOST_KINDS, dtype=np.uint8))
    host &= _inside(trace.ts_us, windows.cpu_start_us, windows.cpu_end_us)
    device = np.isin(trace.kind, np.asarray(DEVICE_KINDS, dtype=np.uint8))
    device &= _inside(trace.ts_us, windows.start_us, windows.end_us)
    rows: list[OperatorRow] = []
    n_names = len(trace.names)
    for label, sel in (("cpu", host), ("gpu", device)):
        ids = trace.name_id[sel]
        counts = np.bincount(ids, minlength=n_names)
        total = np.bincount(ids, weights=trace.dur_us[sel], minlength=n_names)
        for nid in np.flatnonzero(counts):
            rows.append(
                OperatorRow(
                    name=_short(trace.names[nid]),
                    device=label,
                    count=round(float(counts[nid]) / steps, 4),
                    ms=round(float(total[nid]) / 1000.0 / steps, 6),
                )
            )
    return _capped(OperatorTable(steps=steps, rows=_merged_names(rows)))


def _merged_names(rows: list[OperatorRow]) -> list[OperatorRow]:
    """Rows of names equal after cutting, added together."""
    seen: dict[tuple[str, str], OperatorRow] = {}
    for r in rows:
        key = (r.name, r.device)
        if key in seen:
            old = seen[key]
            seen[key] = OperatorRow(r.name, r.device, old.count + r.count, old.ms + r.ms)
        else:
            seen[key] = r
    return list(seen.values())


def _capped(table: OperatorTable) -> OperatorTable:
    """The table sorted by time (then name), cut at MAX_OPERATORS rows."""
    rows = sorted(table.rows, key=lambda r: (-r.ms, r.device, r.name))
    complete = table.complete and len(rows) <= MAX_OPERATORS
    return OperatorTable(
        ranks=table.ranks, steps=table.steps, complete=complete, rows=rows[:MAX_OPERATORS]
    )


def merge_tables(tables: Sequence[OperatorTable]) -> OperatorTable | None:
    """One table for the run: each name's calls and time per rank and step (the mean over the
    ranks' tables; a name a rank did not run counts 0 there). None without any step."""
    tables = [t for t in tables if t.steps > 0]
    if not tables:
        return None
    n = len(tables)
    acc: dict[tuple[str, str], list[float]] = {}
    for t in tables:
        for r in t.rows:
            slot = acc.setdefault((r.name, r.device), [0.0, 0.0])
            slot[0] += r.count
            slot[1] += r.ms
    rows = [
        OperatorRow(name, device, round(c / n, 4), round(ms / n, 6))
        for (name, device), (c, ms) in acc.items()
    ]
    merged = OperatorTable(
        ranks=n,
        steps=round(sum(t.steps for t in tables) / n),
        complete=all(t.complete for t in tables),
        rows=rows,
    )
    return _capped(merged)
