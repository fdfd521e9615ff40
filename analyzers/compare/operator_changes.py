"""Operators and kernels whose calls or time per step changed between two runs.

The classes are HTA's trace diff's (`TraceDiff.ops_diff`): a name run in B only is "added", in A
only "deleted"; with calls on both sides, more calls per step is "increased", fewer
"decreased". A name with the same calls whose time per step moved beyond the spread is "slower"
or "faster". The rest is unchanged (counted, not listed). Calls compare within
COUNT_TOLERANCE_PCT (a per-step mean over steps whose counts vary, as polling calls do).
"""

from __future__ import annotations

from msgspec import UNSET

from ..report import OperatorRow, Report
from .model import OperatorChange
from .spread import SPREAD_FLOOR_MS, SPREAD_FLOOR_PCT

COUNT_TOLERANCE_PCT = 1.0
"""Calls per step within this share of A's count are the same count."""

TIME_ONLY = ("slower", "faster")

MAX_LISTED = 300
"""Changed names listed, the largest time change first (the rest are counted)."""


def _rows(report: Report) -> tuple[dict[tuple[str, str], OperatorRow], bool]:
    table = report.operators
    if table is UNSET:
        return {}, False
    return {(r.name, r.device): r for r in table.rows}, table.complete


def has_operators(report: Report) -> bool:
    """Whether the report holds an operator table (reports from before it do not)."""
    return report.operators is not UNSET


def _change(a: OperatorRow | None, b: OperatorRow | None) -> str:
    ca, cb = (a.count if a else 0.0), (b.count if b else 0.0)
    if ca == 0 and cb > 0:
        return "added"
    if cb == 0 and ca > 0:
        return "deleted"
    if abs(cb - ca) > ca * COUNT_TOLERANCE_PCT / 100.0:
        return "increased" if cb > ca else "decreased"
    ma, mb = (a.ms if a else 0.0), (b.ms if b else 0.0)
    if abs(mb - ma) > max(ma * SPREAD_FLOOR_PCT / 100.0, SPREAD_FLOOR_MS):
        return "slower" if mb > ma else "faster"
    return "unchanged"


def operator_changes(a: Report, b: Report) -> tuple[list[OperatorChange], int, bool]:
    """(the changed names, the largest time change first; how many are unchanged; whether both
    tables were complete)."""
    ra, complete_a = _rows(a)
    rb, complete_b = _rows(b)
    changed: list[OperatorChange] = []
    unchanged = 0
    for key in sorted(set(ra) | set(rb)):
        oa, ob = ra.get(key), rb.get(key)
        change = _change(oa, ob)
        if change == "unchanged":
            unchanged += 1
            continue
        changed.append(
            OperatorChange(
                name=key[0],
                device=key[1],
                change=change,
                count_a=oa.count if oa else 0.0,
                count_b=ob.count if ob else 0.0,
                ms_a=oa.ms if oa else 0.0,
                ms_b=ob.ms if ob else 0.0,
            )
        )
    # count changes (HTA's classes) first, then time-only changes; the largest time change first
    changed.sort(key=lambda c: (c.change in TIME_ONLY, -abs(c.ms_b - c.ms_a), c.name))
    return changed[:MAX_LISTED], unchanged, complete_a and complete_b
