"""Communication by mesh dimension, as the renderers show it.

Reads `StepBreakdown.comm_by_dimension` (set only on ranks whose collectives use more than one
mesh dimension) and `Report.comm_dimensions` (each dimension's role and group size); a report
without them (single-group runs, older reports) shows nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from msgspec import UnsetType

from zdiag.analyzers.report import DimensionComm, Report, StepBreakdown
from zdiag.render.format import fmt_ms
from zdiag.render.stats import RankView
from zdiag.render.text_blocks import TextOut, fit_table


@dataclass(frozen=True)
class DimensionShare:
    """One rank's communication over one dimension, per step on average (ms)."""

    rank: int
    dimension: str
    role: str
    group_size: int | None
    calls_per_step: float
    comm_ms: float
    exposed_ms: float


def step_dimensions(step: StepBreakdown) -> list[DimensionComm]:
    """The step's split by dimension ([] when the report has none for it)."""
    dims = step.comm_by_dimension
    return [] if isinstance(dims, UnsetType) else list(dims)


def dimension_roles(report: Report) -> dict[str, tuple[str, int | None]]:
    """{dimension: (role, group size)} from `Report.comm_dimensions` ({} when absent)."""
    dims = report.comm_dimensions
    if isinstance(dims, UnsetType):
        return {}
    return {d.name: (d.role, d.group_size) for d in dims}


def dimension_shares(report: Report, ranks: Sequence[RankView]) -> list[DimensionShare]:
    """Per rank of `ranks` (in order) and dimension (in `Report.comm_dimensions` order), the mean
    per step over the rank's steps split by dimension; [] when none is."""
    roles = dimension_roles(report)
    out = []
    for rank in ranks:
        split = [step_dimensions(s) for s in rank.steps]
        split = [d for d in split if d]
        if not split:
            continue
        n = len(split)
        totals: dict[str, list[float]] = {}
        for dims in split:
            for d in dims:
                t = totals.setdefault(d.dimension, [0.0, 0.0, 0.0])
                t[0] += d.calls
                t[1] += d.comm_ms
                t[2] += d.exposed_comm_ms
        order = {name: i for i, name in enumerate(roles)}  # the report's order, then the rank's
        for name in sorted(totals, key=lambda n: order.get(n, len(order))):
            calls, comm, exposed = totals[name]
            role, size = roles.get(name, ("", None))
            out.append(
                DimensionShare(rank.rank, name, role, size, calls / n, comm / n, exposed / n)
            )
    return out


def dimension_label(share: DimensionShare) -> str:
    """The dimension with its role (unless the same word) and group size when known:
    "dp (dp-shard, 2 ranks)", "tp (2 ranks)"."""
    role = share.role if share.role != share.dimension else ""
    bits = [b for b in (role, f"{share.group_size} ranks" if share.group_size else "") if b]
    return f"{share.dimension} ({', '.join(bits)})" if bits else share.dimension


def add_dimensions_table(out: TextOut, report: Report, ranks: Sequence[RankView]) -> None:
    """The text report's "Communication by mesh dimension" table (nothing when no rank's
    steps are split by dimension)."""
    shares = dimension_shares(report, ranks)
    if not shares:
        return
    out.heading("Communication by mesh dimension (mean per step)")
    rows = [
        [
            str(s.rank),
            s.dimension,
            s.role or "-",
            str(s.group_size) if s.group_size else "-",
            _calls(s.calls_per_step),
            fmt_ms(s.comm_ms, unit=False),
            fmt_ms(s.exposed_ms, unit=False),
        ]
        for s in shares
    ]
    header = ["rank", "dimension", "role", "group", "calls", "comm ms", "exposed ms"]
    fit_table(out, header, rows, {3, 4, 5, 6}, shrink=1)
    out.add("  (time dimensions communicate at once is split between them: a rank's rows add up")
    out.add("  to its comm and exposed comm)")


def _calls(value: float) -> str:
    return f"{value:.0f}" if value == round(value) else f"{value:.1f}"
