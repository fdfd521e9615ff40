"""The plain-text report of a large run (`LARGE_RUN_RANKS` ranks or more; issue 16.4).

Instead of a line per rank, it summarizes (`stats.large_run_stats`): the distribution of the
ranks' step times and exposed communication, the top-k slowest and most-exposed ranks, hosts
by communication per step, process groups (members, communication, arrival skew and the rank
the others wait for most), a rank-group x step heatmap in text shades, then the stragglers,
collective totals over all ranks, findings and warnings, each capped, so that 1024 ranks fit in
at most `MAX_LINES` lines. `--json` holds every rank; `--rank N` details one.
"""

from __future__ import annotations

from collections import defaultdict

from zdiag.analyzers.report import ProcessGroupStats, Report
from zdiag.render.format import fmt_ints, fmt_ms, fmt_ranks
from zdiag.render.stats import LargeRunStats, Outlier, Spread, large_run_stats, worst_first
from zdiag.render.text_blocks import finding_lines, table_lines, threshold_lines

MAX_LINES = 150
"""The target: the whole report of a 1024-rank run in at most this many lines."""
MAX_WARNING_LINES = 12
MAX_FINDINGS = 8
MAX_STRAGGLER_ROWS = 5
MAX_SHORT_RANKS = 8
MAX_GROUP_ROWS = 8
"""Process groups listed (the most communication per step first); the rest are counted."""
SHADES = ((0.02, " "), (0.10, "."), (0.25, "+"), (float("inf"), "#"))
"""Heatmap cell: the group's slowest step time over the run's median step time, minus 1:
below 2% blank, below 10% '.', below 25% '+', else '#'."""


def _z(z: float | None) -> str:
    """A robust z for a table cell: "-" unknown, ">99" / "<-99" beyond (a near-zero spread)."""
    if z is None:
        return "-"
    return ">99" if z > 99 else "<-99" if z < -99 else f"{z:.1f}"


def _spread_line(label: str, spread: Spread | None) -> str:
    if spread is None:
        return f"  {label}: —"
    return (
        f"  {label}: min {fmt_ms(spread.min)}, p50 {fmt_ms(spread.p50)}, "
        f"p90 {fmt_ms(spread.p90)}, p99 {fmt_ms(spread.p99)}, max {fmt_ms(spread.max)}"
    )


def _outlier_rows(title: str, outliers: tuple[Outlier, ...], table) -> list[str]:  # type: ignore[no-untyped-def]
    if not outliers:
        return ["", f"{title}: none above the median"]
    rows = [
        [
            o.label,
            o.host or "-",
            fmt_ms(o.value_ms, unit=False),
            f"{(o.value_ms / o.median_ms - 1) * 100:+.1f}%" if o.median_ms > 0 else "-",
            _z(o.robust_z),
        ]
        for o in outliers
    ]
    median = fmt_ms(outliers[0].median_ms)
    return [
        "",
        f"{title} (median over ranks {median})",
        *(
            "  " + line
            for line in table(["who", "host", "ms", "vs median", "robust z"], rows, {2, 3, 4})
        ),
    ]


def _shade(value: float | None, median: float | None) -> str:
    if value is None:
        return "?"
    if not median:
        return " "
    excess = value / median - 1.0
    return next(ch for bound, ch in SHADES if excess < bound)


def _heatmap(st: LargeRunStats) -> list[str]:
    if not st.heatmap or not st.steps:
        return []
    label_w = max(len(f"{h.first_rank}-{h.last_rank}") for h in st.heatmap)
    lines = [
        "",
        f"Step time by rank group and step (slowest rank of each group vs the run's median step "
        f"{fmt_ms(st.run_median_step_ms)}: ' ' <2%, '.' <10%, '+' <25%, '#' more, '?' missing)",
        f"  {'ranks'.ljust(label_w)}  steps {fmt_ints(list(st.steps), 4)}",
    ]
    for h in st.heatmap:
        cells = "".join(_shade(v, st.run_median_step_ms) for v in h.step_ms)
        lines.append(f"  {f'{h.first_rank}-{h.last_rank}'.ljust(label_w)}  |{cells}|")
    return lines


def _nodes(st: LargeRunStats, table) -> list[str]:  # type: ignore[no-untyped-def]
    if len(st.nodes) < 2:
        return []
    z = {o.label: o.robust_z for o in st.node_outliers}
    rows = [
        [
            n.host,
            fmt_ints(list(n.ranks), 2),
            fmt_ms(n.median_step_ms, unit=False),
            fmt_ms(n.comm_ms, unit=False),
            fmt_ms(n.exposed_comm_ms, unit=False),
            _z(z.get(n.host)),
        ]
        for n in st.nodes[: len(st.node_outliers)]
    ]
    return [
        "",
        f"Hosts by communication per step ({len(st.nodes)} hosts; the top {len(rows)})",
        *(
            "  " + line
            for line in table(
                ["host", "ranks", "median step ms", "comm ms", "exposed ms", "robust z"],
                rows,
                {2, 3, 4, 5},
            )
        ),
    ]


def group_label(g: ProcessGroupStats) -> str:
    """A process group's name with its description ("3 (tp)"); "(unnamed)" when the traces
    give no name."""
    name = g.name or "(unnamed)"
    return f"{name} ({g.description})" if g.description else name


def _process_groups(report: Report, table) -> list[str]:  # type: ignore[no-untyped-def]
    groups = report.process_groups
    if not groups:
        return []
    rows = [
        [
            group_label(g),
            str(len(g.ranks)) + (f"/{g.declared_size}" if g.declared_size else ""),
            fmt_ints(g.ranks, 2),
            fmt_ms(g.comm_ms_per_step, unit=False),
            fmt_ms(g.median_skew_ms, unit=False),
            fmt_ms(g.wait_caused_ms, unit=False),
            str(g.top_waiter) if g.top_waiter is not None else "-",
        ]
        for g in groups[:MAX_GROUP_ROWS]
    ]
    more = len(groups) - len(rows)
    header = ["group", "ranks", "which", "comm ms", "p50 skew ms", "wait ms", "top waiter"]
    return [
        "",
        f"Process groups ({len(groups)}"
        + (f"; the top {len(rows)}" if more else "")
        + "): communication per rank and step, waiting caused over all steps",
        *("  " + line for line in table(header, rows, {1, 3, 4, 5, 6})),
    ]


def _collectives(report: Report, table) -> list[str]:  # type: ignore[no-untyped-def]
    if not report.collectives:
        return []
    by_kind: dict[str, list[float]] = defaultdict(list)
    exposed: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for c in report.collectives:
        by_kind[c.kind].append(c.total_ms)
        exposed[c.kind] += c.exposed_ms
        count[c.kind] += c.count
    rows = []
    for kind, totals in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        rows.append(
            [
                kind,
                str(len(totals)),
                str(count[kind]),
                fmt_ms(sum(totals) / len(totals), unit=False),
                fmt_ms(max(totals), unit=False),
                fmt_ms(exposed[kind] / len(totals), unit=False),
            ]
        )
    return [
        "",
        "Collectives (all steps; per rank: mean and max over the ranks)",
        *(
            "  " + line
            for line in table(
                ["kind", "ranks", "calls", "mean ms", "max ms", "mean exposed ms"],
                rows,
                {1, 2, 3, 4, 5},
            )
        ),
    ]


def render_large_run_text(report: Report) -> str:
    """The text report of a large run (see the module docstring), ending with a newline."""
    st = large_run_stats(report)
    out: list[str] = [f"zdiag {report.zdiag_version} - {report.schema}"]
    if report.run:
        bits = [f"{k}={v}" for k, v in report.run.items() if isinstance(v, str | int | float)]
        if bits:
            out.append("run: " + ", ".join(bits))
    out.append(f"inputs: {len(report.inputs)} file(s), {len(report.ranks)} rank(s)")
    out += [
        "",
        f"Large run: {st.rank_count} ranks on {len(st.nodes)} host(s), "
        f"steps {fmt_ints(list(st.steps), 4)} (summarized: --json holds every rank, "
        "--rank N details one)",
        _spread_line("step time per rank (median of its steps)", st.step_ms),
        _spread_line("exposed communication per rank and step", st.exposed_comm_ms),
    ]
    if st.short_ranks:
        shown = ", ".join(f"rank {r} ({n})" for r, n in st.short_ranks[:MAX_SHORT_RANKS])
        more = len(st.short_ranks) - MAX_SHORT_RANKS
        out.append(
            f"  fewer steps than the usual {st.usual_step_count} (trace ended early: hung, "
            f"crashed or killed?): {shown}" + (f" and {more} more" if more > 0 else "")
        )
    out += _outlier_rows("Slowest ranks by median step time", st.slowest_ranks, table_lines)
    out += _outlier_rows("Most exposed communication per step", st.most_exposed_ranks, table_lines)
    out += _nodes(st, table_lines)
    out += _process_groups(report, table_lines)
    out += _heatmap(st)
    if report.stragglers:
        rows = [
            [
                str(s.rank),
                str(s.last_arrivals),
                str(s.matched_collectives),
                fmt_ms(s.wait_caused_ms, unit=False),
                fmt_ms(s.mean_skew_ms, unit=False),
            ]
            for s in sorted(report.stragglers, key=lambda s: -s.wait_caused_ms)[:MAX_STRAGGLER_ROWS]
        ]
        out += ["", "Stragglers (the ranks causing the most waiting)"]
        out += [
            "  " + line
            for line in table_lines(
                ["rank", "last", "matched", "wait caused ms", "mean late ms"], rows, {1, 2, 3, 4}
            )
        ]
    out += _collectives(report, table_lines)
    findings = sorted(report.findings, key=worst_first)
    out += ["", f"Findings ({len(findings)})"]
    for f in findings[:MAX_FINDINGS]:
        out.extend("  " + line for line in finding_lines(f))
    if len(findings) > MAX_FINDINGS:
        out.append(f"  ({len(findings) - MAX_FINDINGS} more findings; use --json)")
    if not findings:
        out.append("  none")
    warnings = list(report.warnings)
    ranks_by_warning: dict[str, list[int]] = {}
    for rank in report.ranks:
        for w in rank.warnings:
            ranks_by_warning.setdefault(w, []).append(rank.rank)
    warnings += [f"{fmt_ranks(rs)}: {w}" for w, rs in ranks_by_warning.items()]
    if warnings:
        out += ["", "Warnings"]
        out.extend(f"  - {w}" for w in warnings[:MAX_WARNING_LINES])
        if len(warnings) > MAX_WARNING_LINES:
            out.append(f"  ({len(warnings) - MAX_WARNING_LINES} more warnings; use --json)")
    out.extend(threshold_lines(report.thresholds))
    return "\n".join(out) + "\n"
