"""The HTML report's "Large run" section (LARGE_RUN_RANKS ranks or more; issue 16.4).

From `stats.large_run_stats`: the distributions over ranks, the top-k slowest and most-exposed
ranks, and every host with its ranks' median step time and communication per step (a sortable
table would need script; the hosts come sorted by communication, the most first). The rank x
step heatmaps of the Steps section already show every rank. Then the process groups
(Report.process_groups). Every value is escaped.
"""

from __future__ import annotations

from zdiag.analyzers.report import Report
from zdiag.render._html_parts import _table, e
from zdiag.render.format import fmt_ints, fmt_ms
from zdiag.render.stats import LargeRunStats, Outlier, Spread, large_run_stats
from zdiag.render.text_large_run import group_label

MAX_HOST_ROWS = 64
"""Hosts listed (the most communication per step first); the rest are counted."""
MAX_GROUP_ROWS = 64
"""Process groups listed (the most communication per step first); the rest are counted."""


def _spread_row(label: str, spread: Spread | None) -> list[str]:
    if spread is None:
        return [e(label), "—", "—", "—", "—", "—"]
    return [
        e(label),
        *(e(fmt_ms(v)) for v in (spread.min, spread.p50, spread.p90, spread.p99, spread.max)),
    ]


def _z(z: float | None) -> str:
    if z is None:
        return "—"
    return ">99" if z > 99 else "<-99" if z < -99 else f"{z:.1f}"


def _outliers(title: str, outliers: tuple[Outlier, ...]) -> str:
    if not outliers:
        return f'<h3>{e(title)}</h3><p class="note">No rank above the median.</p>'
    rows = [
        [
            e(o.label),
            e(o.host or "—"),
            e(fmt_ms(o.value_ms)),
            e(f"{(o.value_ms / o.median_ms - 1) * 100:+.1f}%" if o.median_ms > 0 else "—"),
            e(_z(o.robust_z)),
        ]
        for o in outliers
    ]
    return f"<h3>{e(title)}</h3>" + _table(
        ["rank", "host", "value", "vs median", "robust z"],
        rows,
        f"median over ranks {fmt_ms(outliers[0].median_ms)}",
    )


def _hosts(st: LargeRunStats) -> str:
    if len(st.nodes) < 2:
        return ""
    z = {o.label: o.robust_z for o in st.node_outliers}
    rows = [
        [
            e(n.host),
            e(fmt_ints(list(n.ranks), 3)),
            e(fmt_ms(n.median_step_ms)),
            e(fmt_ms(n.comm_ms)),
            e(fmt_ms(n.exposed_comm_ms)),
            e(_z(z.get(n.host))),
        ]
        for n in st.nodes[:MAX_HOST_ROWS]
    ]
    more = len(st.nodes) - len(rows)
    note = f"{more} more hosts communicate less; every rank is in the JSON report" if more else ""
    return f"<h3>Hosts by communication per step ({len(st.nodes)})</h3>" + _table(
        ["host", "ranks", "median step", "comm / step", "exposed comm / step", "robust z"],
        rows,
        note,
    )


def _process_groups(report: Report) -> str:
    groups = report.process_groups
    if not groups:
        return ""
    rows = [
        [
            e(group_label(g)),
            e(str(len(g.ranks)) + (f" of {g.declared_size}" if g.declared_size else "")),
            e(fmt_ints(g.ranks, 3)),
            e(", ".join(g.kinds)),
            e(f"{g.calls_per_rank:g}"),
            e(fmt_ms(g.comm_ms_per_step)),
            e(fmt_ms(g.median_skew_ms)),
            e(fmt_ms(g.max_skew_ms)),
            e(fmt_ms(g.wait_caused_ms)),
            e(
                f"rank {g.top_waiter} ({fmt_ms(g.top_waiter_ms)})"
                if g.top_waiter is not None
                else "—"
            ),
        ]
        for g in groups[:MAX_GROUP_ROWS]
    ]
    more = len(groups) - len(rows)
    note = "waiting caused: summed over all steps, above the straggler noise" + (
        f"; {more} more groups communicate less (JSON report)" if more else ""
    )
    return f"<h3>Process groups ({len(groups)})</h3>" + _table(
        [
            "group",
            "ranks",
            "which",
            "kinds",
            "calls / rank",
            "comm / rank / step",
            "median skew",
            "max skew",
            "wait caused",
            "most waited for",
        ],
        rows,
        note,
    )


def large_run_section(report: Report) -> str:
    """The section (see the module docstring)."""
    st = large_run_stats(report)
    spreads = _table(
        ["over ranks", "min", "p50", "p90", "p99", "max"],
        [
            _spread_row("step time (each rank's median)", st.step_ms),
            _spread_row("exposed communication per step", st.exposed_comm_ms),
        ],
    )
    return (
        '<section id="large-run"><h2>Large run</h2>'
        f"<p>{st.rank_count} ranks on {len(st.nodes)} host(s), steps "
        f"{e(fmt_ints(list(st.steps), 4))}: summarized here; the Steps heatmaps show every rank "
        "and step.</p>"
        + spreads
        + _outliers("Slowest ranks by median step time", st.slowest_ranks)
        + _outliers("Most exposed communication per step", st.most_exposed_ranks)
        + _hosts(st)
        + _process_groups(report)
        + "</section>"
    )
