"""Plain-text rendering of a Report (the default output of `zdiag analyze`).

Sections: the run, one summary per rank (median step, verdict counts, where time went), a
per-step table per rank, collective totals, FSDP units, findings, warnings. Pure: returns a
string; the command prints it.
"""

from __future__ import annotations

from collections.abc import Sequence

from zdiag.analyzers.report import Finding, Report, StepBreakdown
from zdiag.render.columns import STEP_COLUMNS, step_cells, step_headers
from zdiag.render.format import (
    fmt_bytes,
    fmt_ints,
    fmt_list,
    fmt_ms,
    fmt_ranks,
    fmt_share,
    fmt_value,
    known_bytes,
    unit_label,
)
from zdiag.render.memory_view import memory_lines
from zdiag.render.renderer import Destination, Renderer
from zdiag.render.stats import (
    LARGE_RUN_RANKS,
    RankStats,
    RankView,
    detailed_ranks,
    rank_stats,
    worst_first,
)

MAX_STEP_ROWS = 40
"""Per-step rows shown per rank; longer runs show the first and last rows and say so."""

MAX_UNIT_ROWS = 20

MAX_DETAILED_RANKS = 8
"""Runs with more ranks get a one-line-per-rank overview and per-step tables (and collective
totals) for 8 of them."""
MAX_STRAGGLER_ROWS = 8
"""Straggler table rows: the ranks causing the most waiting (all of them are in --json)."""


def _pct(share: float | None) -> str:
    return fmt_share(share, 1.0) if share is not None else "-"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)
        ).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _rank_head(rank: RankView) -> str:
    where = f" on {rank.host}" if rank.host else ""
    return f"Rank {rank.rank} ({rank.device}{where}) - {rank.source}"


def _rank_summary(rank: RankView) -> list[str]:
    stats = rank_stats(rank)
    head = _rank_head(rank)
    if not stats.step_count:
        return [head, "  no steps analyzed"]
    step_source = rank.step_source
    verdicts = stats.verdicts
    main_verdict, count = verdicts[0]
    return [
        head,
        f"  {stats.step_count} step(s)"
        + (f" from {step_source}" if step_source else "")
        + f", median {fmt_ms(stats.median_ms)}, "
        f"min {fmt_ms(stats.min_ms)}, max {fmt_ms(stats.max_ms)}",
        f"  time: compute {_pct(stats.compute_share)}, "
        f"exposed comm {_pct(stats.exposed_comm_share)}, "
        f"memcpy {_pct(stats.memcpy_share)}, idle {_pct(stats.idle_share)} "
        f"(comm {_pct(stats.comm_share)}, of which overlapped {_pct(stats.overlapped_of_comm)})",
        f"  verdict: {main_verdict} in {count} of {stats.step_count} step(s)"
        + (
            ""
            if len(verdicts) == 1
            else " (" + ", ".join(f"{v} {c}" for v, c in verdicts[1:]) + ")"
        ),
    ]


def _step_rows(steps: list[StepBreakdown]) -> tuple[list[list[str]], int]:
    shown = steps
    hidden = 0
    if len(steps) > MAX_STEP_ROWS:
        half = MAX_STEP_ROWS // 2
        shown = steps[:half] + steps[-half:]
        hidden = len(steps) - len(shown)
    return [step_cells(s) for s in shown], hidden


STEP_NUMERIC = {i for i, c in enumerate(STEP_COLUMNS) if c.numeric}


def _finding_lines(f: Finding) -> list[str]:
    where = []
    if f.ranks:
        where.append(fmt_ranks(f.ranks))
    if f.steps:
        where.append(("step " if len(set(f.steps)) == 1 else "steps ") + fmt_ints(f.steps, 16))
    if f.units:
        where.append(
            ("unit " if len(f.units) == 1 else "units ")
            + fmt_list([unit_label(u) for u in f.units], 8)
        )
    lines = [
        f"[{f.severity.upper()}] {f.id}: {f.title}" + (f" ({'; '.join(where)})" if where else "")
    ]
    if f.evidence:
        shown = [(k, v) for k, v in f.evidence.items() if v not in (None, {}, [])][:8]
        ev = ", ".join(f"{k}={fmt_value(v)}" for k, v in shown)
        lines.append(f"    evidence: {ev}")
    if f.recommendation:
        lines.append(f"    do: {f.recommendation}")
    if f.code:
        lines.extend(f"      {line}" for line in f.code.splitlines())
    if f.expected_gain_ms is not None:
        how = f" ({f.gain_method})" if f.gain_method else ""
        lines.append(f"    expected gain: {fmt_ms(f.expected_gain_ms)} per step{how}")
    if f.expected_gain_bytes is not None:
        lines.append(f"    expected saving: {fmt_bytes(f.expected_gain_bytes)} peak memory")
    return lines


STRAGGLER_PREFIX = "straggler_"
"""Report.thresholds keys that belong to the cross-rank straggler ranking (crossrank.py); the
others are the per-step verdict's (verdict.py)."""


def _threshold_lines(thresholds: dict[str, float]) -> list[str]:
    """The verdict thresholds and the straggler thresholds, each on its own labelled line."""
    verdict = {k: v for k, v in thresholds.items() if not k.startswith(STRAGGLER_PREFIX)}
    straggler = {
        k.removeprefix(STRAGGLER_PREFIX): v
        for k, v in thresholds.items()
        if k.startswith(STRAGGLER_PREFIX)
    }
    lines = []
    for label, values in (("Verdict", verdict), ("Straggler", straggler)):
        if values:
            lines.append(
                f"{label} thresholds: " + ", ".join(f"{k}={v:g}" for k, v in values.items())
            )
    return ["", *lines] if lines else []


def _rank_overview(ranks: Sequence[RankView]) -> list[str]:
    """One line per rank: median step, shares, the most common verdict."""
    rows = []
    for r in ranks:
        stats: RankStats = rank_stats(r)
        rows.append(
            [
                str(r.rank),
                r.device,
                str(stats.step_count),
                fmt_ms(stats.median_ms, unit=False),
                _pct(stats.compute_share),
                _pct(stats.exposed_comm_share),
                _pct(stats.idle_share),
                stats.dominant_verdict or "-",
            ]
        )
    header = ["rank", "device", "steps", "median ms", "compute", "exposed", "idle", "verdict"]
    return _table(header, rows, {2, 3, 4, 5, 6})


def render_text(report: Report) -> str:
    """The report as plain text, ending with a newline."""
    if len(report.ranks) >= LARGE_RUN_RANKS:  # large runs: summarized (text_large_run.py)
        from zdiag.render.text_large_run import render_large_run_text

        return render_large_run_text(report)
    out: list[str] = [f"zdiag {report.zdiag_version} - {report.schema}"]
    if report.run:
        bits = [f"{k}={v}" for k, v in report.run.items() if isinstance(v, str | int | float)]
        if bits:
            out.append("run: " + ", ".join(bits))
    out.append(f"inputs: {len(report.inputs)} file(s), {len(report.ranks)} rank(s)")
    detailed = report.ranks
    if len(report.ranks) > MAX_DETAILED_RANKS:
        out += ["", "Ranks"]
        out.extend("  " + line for line in _rank_overview(report.ranks))
        detailed = detailed_ranks(report.ranks, MAX_DETAILED_RANKS)
        out += [
            "",
            f"Per-step detail for {len(detailed)} of {len(report.ranks)} ranks (rank 0 and the "
            "slowest; --rank N shows any rank)",
        ]
    for rank in detailed:
        out.append("")
        out.extend(_rank_summary(rank))
        if rank.steps:
            rows, hidden = _step_rows(rank.steps)
            out.append("")
            out.extend("  " + line for line in _table(step_headers(), rows, STEP_NUMERIC))
            if hidden:
                out.append(f"  ({hidden} middle steps not shown; use --json for all)")
    if report.collectives:
        collectives = report.collectives
        if detailed is not report.ranks:  # many ranks: the detailed ones only
            shown_ranks = {r.rank for r in detailed}
            collectives = [c for c in collectives if c.rank in shown_ranks]
        out += ["", "Collectives (all steps)"]
        rows = [
            [
                str(c.rank),
                c.kind,
                str(c.count),
                fmt_bytes(known_bytes(c.total_bytes, c.count)),
                fmt_ms(c.total_ms, unit=False),
                fmt_ms(c.exposed_ms, unit=False),
                ",".join(c.dtypes) or "-",
            ]
            for c in collectives
        ]
        out.extend(
            "  " + line
            for line in _table(
                ["rank", "kind", "count", "bytes", "total ms", "exposed ms", "dtypes"],
                rows,
                {2, 3, 4, 5},
            )
        )
        if len(collectives) < len(report.collectives):
            out.append(
                f"  (the {len(detailed)} ranks detailed above; the other "
                f"{len(report.ranks) - len(detailed)} in --json)"
            )
    if report.fsdp_units:
        out += ["", "FSDP units"]
        units = sorted(report.fsdp_units, key=lambda u: -u.exposed_wait_ms)[:MAX_UNIT_ROWS]
        rows = [
            [
                str(u.rank),
                unit_label(u.name),
                u.framework,
                fmt_bytes(known_bytes(u.all_gather_bytes, u.all_gather_count)),
                fmt_bytes(known_bytes(u.reduce_bytes, u.reduce_count)),
                fmt_ms(u.all_gather_ms, unit=False),
                fmt_ms(u.reduce_ms, unit=False),
                fmt_ms(u.exposed_wait_ms, unit=False),
            ]
            for u in units
        ]
        out.extend(
            "  " + line
            for line in _table(
                [
                    "rank",
                    "unit",
                    "kind",
                    "gathered",
                    "reduced",
                    "gather ms",
                    "reduce ms",
                    "exposed ms",
                ],
                rows,
                {3, 4, 5, 6, 7},
            )
        )
        if len(report.fsdp_units) > MAX_UNIT_ROWS:
            out.append(f"  ({len(report.fsdp_units) - MAX_UNIT_ROWS} more units; use --json)")
    if report.stragglers:
        out += [
            "",
            "Stragglers (last arrivals at matched collectives; wait summed over all steps)",
        ]
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
        out.extend(
            "  " + line
            for line in _table(
                ["rank", "last", "matched", "wait caused ms", "mean late ms"], rows, {1, 2, 3, 4}
            )
        )
        if len(report.stragglers) > MAX_STRAGGLER_ROWS:
            out.append(
                f"  ({len(report.stragglers) - MAX_STRAGGLER_ROWS} ranks causing less wait; "
                "use --json)"
            )
    out += memory_lines(report)
    out += ["", f"Findings ({len(report.findings)})"]
    if report.findings:
        for f in sorted(report.findings, key=worst_first):
            out.extend("  " + line for line in _finding_lines(f))
    else:
        out.append("  none")
    warnings = list(report.warnings)
    ranks_by_warning: dict[str, list[int]] = {}
    for rank in report.ranks:
        for w in rank.warnings:
            ranks_by_warning.setdefault(w, []).append(rank.rank)
    for w, ranks in ranks_by_warning.items():
        who = fmt_ranks(ranks)
        warnings.append(f"{who}: {w}")
    if warnings:
        out += ["", "Warnings"]
        out.extend(f"  - {w}" for w in warnings)
    out.extend(_threshold_lines(report.thresholds))
    return "\n".join(out) + "\n"


class TextRenderer(Renderer):
    """The plain-text report (`zdiag analyze`'s default output, `zdiag render --text`)."""

    name = "text"

    def render(self, report: Report, destination: Destination) -> None:
        """Write `render_text(report)` as UTF-8."""
        destination.write(render_text(report).encode("utf-8"))
