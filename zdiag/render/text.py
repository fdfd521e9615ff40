"""Plain-text rendering of a Report (the default output of `zdiag analyze`).

Sections: the run, one summary per rank (median step, verdict counts, where time went), a
per-step table per rank, collective totals, FSDP units, findings, warnings. Pure: returns a
string; the command prints it.
"""

from __future__ import annotations

import statistics
from collections import Counter

from zdiag.analyzers.report import Finding, RankReport, Report, StepBreakdown
from zdiag.render._output import unit_label, worst_first

MAX_STEP_ROWS = 40
"""Per-step rows shown per rank; longer runs show the first and last rows and say so."""

MAX_UNIT_ROWS = 20

MAX_DETAILED_RANKS = 8
"""Runs with more ranks get a one-line-per-rank overview and per-step tables (and collective
totals) for 8 of them."""
MAX_STRAGGLER_ROWS = 8
"""Straggler table rows: the ranks causing the most waiting (all of them are in --json)."""


def _ms(v: float) -> str:
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole > 0 else "-"


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)
        ).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _rank_summary(rank: RankReport) -> list[str]:
    steps = rank.steps
    where = f" on {rank.host}" if rank.host else ""
    head = f"Rank {rank.rank} ({rank.device}{where}) - {rank.source}"
    if not steps:
        return [head, "  no steps analyzed"]
    dur = [s.duration_ms for s in steps]
    total = sum(dur)
    verdicts = Counter(s.verdict for s in steps)
    main_verdict, count = verdicts.most_common(1)[0]

    def share(attr: str) -> str:
        return _pct(sum(getattr(s, attr) for s in steps), total)

    return [
        head,
        f"  {len(steps)} step(s)"
        + (f" from {rank.step_source}" if rank.step_source else "")
        + f", median {_ms(statistics.median(dur))} ms, "
        f"min {_ms(min(dur))} ms, max {_ms(max(dur))} ms",
        f"  time: compute {share('compute_ms')}, exposed comm {share('exposed_comm_ms')}, "
        f"memcpy {share('memcpy_ms')}, idle {share('idle_ms')} "
        f"(comm {share('comm_ms')}, of which overlapped {_pct(sum(s.overlapped_ms for s in steps), sum(s.comm_ms for s in steps))})",
        f"  verdict: {main_verdict} in {count} of {len(steps)} step(s)"
        + (
            ""
            if len(verdicts) == 1
            else " (" + ", ".join(f"{v} {c}" for v, c in verdicts.most_common()[1:]) + ")"
        ),
    ]


def _step_rows(steps: list[StepBreakdown]) -> tuple[list[list[str]], int]:
    shown = steps
    hidden = 0
    if len(steps) > MAX_STEP_ROWS:
        half = MAX_STEP_ROWS // 2
        shown = steps[:half] + steps[-half:]
        hidden = len(steps) - len(shown)
    rows = [
        [
            str(s.step),
            _ms(s.duration_ms),
            _ms(s.compute_ms),
            _ms(s.comm_ms),
            _ms(s.overlapped_ms),
            _ms(s.exposed_comm_ms),
            _ms(s.memcpy_ms),
            _ms(s.idle_ms),
            _ms(s.host_launch_ms),
            str(s.kernel_count),
            s.verdict,
        ]
        for s in shown
    ]
    return rows, hidden


STEP_HEADER = [
    "step",
    "dur ms",
    "compute",
    "comm",
    "overlap",
    "exposed",
    "memcpy",
    "idle",
    "launch",
    "kernels",
    "verdict",
]


def _finding_lines(f: Finding) -> list[str]:
    where = []
    if f.ranks:
        where.append(
            "rank " + ",".join(map(str, f.ranks[:16])) + ("..." if len(f.ranks) > 16 else "")
        )
    if f.steps:
        where.append(
            "step " + ",".join(map(str, f.steps[:16])) + ("..." if len(f.steps) > 16 else "")
        )
    if f.units:
        names = [unit_label(u) for u in f.units[:8]]
        where.append("unit " + ", ".join(names) + ("..." if len(f.units) > 8 else ""))
    lines = [
        f"[{f.severity.upper()}] {f.id}: {f.title}" + (f" ({'; '.join(where)})" if where else "")
    ]
    if f.evidence:
        shown = [(k, v) for k, v in f.evidence.items() if v not in (None, {}, [])][:8]
        ev = ", ".join(f"{k}={_fmt_value(v)}" for k, v in shown)
        lines.append(f"    evidence: {ev}")
    if f.recommendation:
        lines.append(f"    do: {f.recommendation}")
    if f.code:
        lines.extend(f"      {line}" for line in f.code.splitlines())
    if f.expected_gain_ms is not None:
        how = f" ({f.gain_method})" if f.gain_method else ""
        lines.append(f"    expected gain: {_ms(f.expected_gain_ms)} ms per step{how}")
    if f.expected_gain_bytes is not None:
        lines.append(f"    expected saving: {_bytes(f.expected_gain_bytes)} peak memory")
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


def _fmt_value(v: object) -> str:
    """An evidence value, also inside nested dicts (per rank): floats like table cells, tiny
    ones (probabilities) with two significant digits instead of 0.00."""
    if isinstance(v, float):
        return f"{v:.2g}" if 0 < abs(v) < 0.01 else _ms(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple) and len(v) > 6:
        return "[" + ", ".join(map(str, v[:6])) + ", ...]"
    return str(v)


def _rank_list(ranks: list[int]) -> str:
    """ "rank 3", "ranks 0-7", "ranks 0,2,5" (runs of consecutive ranks collapsed)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(parts)


def _median_ms(rank: RankReport) -> float:
    return statistics.median([s.duration_ms for s in rank.steps]) if rank.steps else 0.0


def _rank_overview(ranks: list[RankReport]) -> list[str]:
    """One line per rank: median step, shares, the most common verdict."""
    rows = []
    for r in ranks:
        total = sum(s.duration_ms for s in r.steps)
        verdict = Counter(s.verdict for s in r.steps).most_common(1)
        rows.append(
            [
                str(r.rank),
                r.device,
                str(len(r.steps)),
                _ms(_median_ms(r)),
                _pct(sum(s.compute_ms for s in r.steps), total),
                _pct(sum(s.exposed_comm_ms for s in r.steps), total),
                _pct(sum(s.idle_ms for s in r.steps), total),
                verdict[0][0] if verdict else "-",
            ]
        )
    header = ["rank", "device", "steps", "median ms", "compute", "exposed", "idle", "verdict"]
    return _table(header, rows, {2, 3, 4, 5, 6})


def _detailed_ranks(ranks: list[RankReport]) -> list[RankReport]:
    """Rank 0 (or the first) and the slowest ranks by median step, in rank order."""
    first = ranks[0]
    slowest = sorted(ranks[1:], key=lambda r: -_median_ms(r))[: MAX_DETAILED_RANKS - 1]
    return sorted([first, *slowest], key=lambda r: r.rank)


def render_text(report: Report) -> str:
    """The report as plain text, ending with a newline."""
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
        detailed = _detailed_ranks(report.ranks)
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
            out.extend("  " + line for line in _table(STEP_HEADER, rows, set(range(1, 10))))
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
                _bytes(c.total_bytes) if c.total_bytes else "-",
                _ms(c.total_ms),
                _ms(c.exposed_ms),
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
                _bytes(u.all_gather_bytes),
                _bytes(u.reduce_bytes),
                _ms(u.all_gather_ms),
                _ms(u.reduce_ms),
                _ms(u.exposed_wait_ms),
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
                _ms(s.wait_caused_ms),
                _ms(s.mean_skew_ms),
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
        who = _rank_list(ranks) if len(report.ranks) > 1 else f"rank {ranks[0]}"
        warnings.append(f"{who}: {w}")
    if warnings:
        out += ["", "Warnings"]
        out.extend(f"  - {w}" for w in warnings)
    out.extend(_threshold_lines(report.thresholds))
    return "\n".join(out) + "\n"
