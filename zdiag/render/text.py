"""Plain-text rendering of a Report (the default output of `zdiag analyze`).

Summary first, then details:

1. the run in one line, then **Summary**: ranks grouped by their dominant verdict (median step,
   where the time went), the findings ranked by expected gain (`stats.by_gain`), and detectors
   that failed (never "none" next to a failed detector);
2. the large-run section (`_large_run_section`: one line per rank for runs with more than
   MAX_DETAILED_RANKS ranks; the place for the 1000+-rank aggregates);
3. **Details**: per rank its summary and step table, collective totals, communication by mesh
   dimension (ranks of several groups only), FSDP units, stragglers,
   every finding with its evidence (labels and units, not dicts), warnings and thresholds.

Prose is word-wrapped to `width` columns; tables drop trailing columns (and say which) rather
than wrap; code is never wrapped (it must stay copy-pastable). GPU-only step columns are hidden
on CPU-only runs. With `color=True`, verdicts and severities get ANSI colours
(`zdiag.render.terminal` decides: a TTY, not NO_COLOR). Steps are numbered as the profiler numbers
them (ProfilerStep#N, 0-based); the root FSDP unit prints as "(root)" (it is "" in JSON).
"""

from __future__ import annotations

import textwrap
from collections import Counter
from collections.abc import Sequence

from zdiag.analyzers.report import Report, StepBreakdown
from zdiag.render.columns import StepColumn, shown_columns, step_cells, step_headers
from zdiag.render.dimensions import add_dimensions_table
from zdiag.render.format import (
    fmt_bytes,
    fmt_gain,
    fmt_ms,
    fmt_ranks,
    fmt_share,
    known_bytes,
    unit_label,
)
from zdiag.render.memory_view import memory_lines
from zdiag.render.printable import printable_report
from zdiag.render.renderer import Destination, Rendered, Renderer
from zdiag.render.stats import (
    LARGE_RUN_RANKS,
    RankStats,
    RankView,
    by_gain,
    detailed_ranks,
    rank_groups,
    rank_stats,
)
from zdiag.render.terminal import DEFAULT_WIDTH, paint
from zdiag.render.text_blocks import (
    CellPainter,
    TextOut,
    add_finding,
    add_thresholds,
    fit_table,
)
from zdiag.render.text_large_run import render_large_run_text

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


def _verdict_painter(out: TextOut, column: int) -> CellPainter:
    """Colour the cells of one column as verdicts."""

    def paint_cell(i: int, plain: str, padded: str) -> str:
        return padded.replace(plain, out.verdict(plain), 1) if i == column and plain else padded

    return paint_cell


def _run_line(report: Report) -> str:
    steps = sum(len(r.steps) for r in report.ranks)
    devices = sorted({r.device for r in report.ranks})
    n = len(report.ranks)
    version = f"zdiag {report.zdiag_version}".rstrip()
    head = f"{version} · {n} rank{'s' if n != 1 else ''}"
    if devices:
        head += f" ({', '.join(devices)})"
    head += f" · {steps} rank-step{'s' if steps != 1 else ''}"
    nf = len(report.findings)
    return head + f" · {nf} finding{'s' if nf != 1 else ''}"


def _no_findings(report: Report) -> str:
    """The line for a report without findings: it must not contradict its step verdicts."""
    steps = [b for r in report.ranks for b in r.steps]
    verdicts = Counter(b.verdict for b in steps)
    if not verdicts or verdicts.most_common(1)[0][0] == "compute-bound":
        return "none: nothing in the traces crossed a threshold"
    verdict, n = verdicts.most_common(1)[0]  # the steps' dominant verdict is not healthy
    return (
        f"no finding: no rule's evidence is met, but the steps are not healthy ({verdict} in "
        f"{n} of {len(steps)} steps, above); too few steps or ranks for a finding, or traffic "
        "no rule covers"
    )


def _summary(out: TextOut, report: Report) -> None:
    out.heading("Summary")
    groups = rank_groups(report.ranks)
    if not groups:
        out.add("  no ranks analyzed")
    for g in groups:
        who = fmt_ranks(list(g.ranks))
        if not g.verdict:
            out.wrap(f"{who}: no steps analyzed", "  ")
            continue
        low, high = g.median_ms_low, g.median_ms_high
        median = fmt_ms(low)
        if fmt_ms(high) != median:
            median = f"{fmt_ms(low, unit=False)}–{fmt_ms(high)}"
        verdict = out.verdict(g.verdict)
        plain = f"{who}: {g.verdict} in {g.verdict_steps} of {g.steps} steps, median step {median}"
        first = textwrap.wrap(plain, out.width - 2, break_on_hyphens=False)
        for k, line in enumerate(first):
            out.add(("  " if k == 0 else "      ") + line.replace(g.verdict, verdict, 1))
        out.wrap(
            f"compute {_pct(g.compute_share)}, exposed comm {_pct(g.exposed_comm_share)}, "
            f"idle {_pct(g.idle_share)} of step time",
            "    ",
        )
    failed = report.failed_detectors
    out.add("", "  Findings, largest expected gain first")
    ordered = sorted(report.findings, key=by_gain)
    for k, f in enumerate(ordered, 1):
        gain = fmt_gain(f)
        text = f"{f.id}: {f.title}" + (f" (gain {gain})" if gain else "")
        lead = f"  {k:>2}. "
        lines = textwrap.wrap(
            f"[{f.severity.upper()}] {text}",
            out.width,
            initial_indent=lead,
            subsequent_indent=" " * len(lead) + "  ",
            break_on_hyphens=False,
        )
        lines[0] = lines[0].replace(f"[{f.severity.upper()}]", out.badge(f.severity), 1)
        out.add(*lines)
    if not ordered and not failed:
        out.wrap(_no_findings(report), "      ")
    elif not ordered:
        out.add("      none found by the detectors that ran")
    if failed:
        out.wrap(
            f"{len(failed)} detector{'s' if len(failed) != 1 else ''} failed, so "
            f"{'their' if len(failed) != 1 else 'its'} findings are missing: "
            f"{', '.join(failed)} (see Warnings)",
            "      ",
        )


def _large_run_section(out: TextOut, report: Report) -> list[RankView]:
    """The section for runs too large to detail rank by rank; returns the ranks detailed below.

    Today: one line per rank and the choice of MAX_DETAILED_RANKS ranks to detail. This is where
    the aggregates of 1000+-rank runs (by node, top-k, heatmaps) go, right after the summary.
    """
    if len(report.ranks) <= MAX_DETAILED_RANKS:
        return list(report.ranks)
    out.heading("Ranks")
    rows = []
    for r in report.ranks:
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
    fit_table(out, header, rows, {2, 3, 4, 5, 6}, painter=_verdict_painter(out, 7))
    detailed: list[RankView] = list(detailed_ranks(report.ranks, MAX_DETAILED_RANKS))
    out.add("")
    out.wrap(
        f"Per-step detail for {len(detailed)} of {len(report.ranks)} ranks (rank 0 and the "
        "slowest; --rank N shows any rank)"
    )
    return detailed


def _rank_detail(out: TextOut, rank: RankView, columns: Sequence[StepColumn]) -> None:
    where = f" on {rank.host}" if rank.host else ""
    out.add("", paint(f"Rank {rank.rank} ({rank.device}{where})", "bold", out.color))
    out.wrap(f"source: {rank.source}", "  ")
    stats = rank_stats(rank)
    if not stats.step_count:
        out.add("  no steps analyzed")
        return
    out.wrap(
        f"{stats.step_count} step(s)"
        + (f" from {rank.step_source}" if rank.step_source else "")
        + f", median {fmt_ms(stats.median_ms)}, min {fmt_ms(stats.min_ms)}, "
        f"max {fmt_ms(stats.max_ms)}",
        "  ",
    )
    out.wrap(
        f"time: compute {_pct(stats.compute_share)}, "
        f"exposed comm {_pct(stats.exposed_comm_share)}, "
        + (f"memcpy {_pct(stats.memcpy_share)}, " if len(columns) == 11 else "")
        + f"idle {_pct(stats.idle_share)} (comm {_pct(stats.comm_share)}, "
        f"of which overlapped {_pct(stats.overlapped_of_comm)})",
        "  ",
    )
    verdicts = stats.verdicts
    main_verdict, count = verdicts[0]
    others = ", ".join(f"{v} {c}" for v, c in verdicts[1:])
    out.add(
        f"  verdict: {out.verdict(main_verdict)} in {count} of {stats.step_count} step(s)"
        + (f" ({others})" if others else "")
    )
    reason = next((s.verdict_reason for s in rank.steps if s.verdict == main_verdict), "")
    if reason:  # the thresholds that decided it, on its median-like step
        out.wrap(f"why: {reason}", "    ", "      ")
    shown, hidden = _step_rows(rank.steps)
    out.add("")
    verdict_col = next(i for i, c in enumerate(columns) if c.kind == "verdict")
    fit_table(
        out,
        step_headers(columns),
        [step_cells(s, columns) for s in shown],
        {i for i, c in enumerate(columns) if c.numeric},
        painter=_verdict_painter(out, verdict_col),
    )
    if hidden:
        out.add(f"  ({hidden} middle steps not shown; use --json for all)")


def _step_rows(steps: list[StepBreakdown]) -> tuple[list[StepBreakdown], int]:
    if len(steps) <= MAX_STEP_ROWS:
        return steps, 0
    half = MAX_STEP_ROWS // 2
    shown = steps[:half] + steps[-half:]
    return shown, len(steps) - len(shown)


def _collectives(out: TextOut, report: Report, detailed: list[RankView]) -> None:
    if not report.collectives:
        return
    collectives = report.collectives
    if len(detailed) < len(report.ranks):  # many ranks: the detailed ones only
        shown_ranks = {r.rank for r in detailed}
        collectives = [c for c in collectives if c.rank in shown_ranks]
    out.heading("Collectives (all steps)")
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
    header = ["rank", "kind", "count", "bytes", "total ms", "exposed ms", "dtypes"]
    fit_table(out, header, rows, {2, 3, 4, 5}, shrink=1)
    if len(collectives) < len(report.collectives):
        out.add(
            f"  (the {len(detailed)} ranks detailed above; the other "
            f"{len(report.ranks) - len(detailed)} in --json)"
        )


def _units(out: TextOut, report: Report) -> None:
    if not report.fsdp_units:
        return
    out.heading("FSDP units (most exposed wait first; the root module is (root))")
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
    header = ["rank", "unit", "kind", "gathered", "reduced", "gather ms", "reduce ms", "exposed ms"]
    fit_table(out, header, rows, {3, 4, 5, 6, 7}, shrink=1)
    if len(report.fsdp_units) > MAX_UNIT_ROWS:
        out.add(f"  ({len(report.fsdp_units) - MAX_UNIT_ROWS} more units; use --json)")


def _stragglers(out: TextOut, report: Report) -> None:
    if not report.stragglers:
        return
    out.heading("Stragglers (last arrivals at matched collectives; wait summed over all steps)")
    ordered = sorted(report.stragglers, key=lambda s: -s.wait_caused_ms)
    rows = [
        [
            str(s.rank),
            str(s.last_arrivals),
            str(s.matched_collectives),
            fmt_ms(s.wait_caused_ms, unit=False),
            fmt_ms(s.mean_skew_ms, unit=False),
        ]
        for s in ordered[:MAX_STRAGGLER_ROWS]
    ]
    header = ["rank", "last", "matched", "wait caused ms", "mean late ms"]
    fit_table(out, header, rows, {1, 2, 3, 4})
    if len(report.stragglers) > MAX_STRAGGLER_ROWS:
        out.add(
            f"  ({len(report.stragglers) - MAX_STRAGGLER_ROWS} ranks causing less wait; use --json)"
        )


def _captures(out: TextOut, report: Report) -> None:
    """The triggered captures, each its own window: its steps, verdict and findings."""
    captures = (report.run or {}).get("captures") or []
    if not captures:
        return
    out.heading(f"Triggered captures ({len(captures)}), each its own profiler window")
    for c in captures:
        if c.get("error"):
            out.wrap(f"- {c['capture']}: not analyzed: {c['error']}", "  ")
            continue
        steps = c.get("steps") or []
        span = (
            f"steps {steps[0]}-{steps[-1]}"
            if len(steps) > 1
            else f"step {steps[0]}"
            if steps
            else "no step"
        )
        median = c.get("median_step_ms")
        out.wrap(
            f"- {c['capture']}: {span}, {fmt_ranks(c.get('ranks') or [])}"
            + (f", median step {fmt_ms(median)}" if median is not None else "")
            + (f", mostly {c['verdict']}" if c.get("verdict") else ""),
            "  ",
        )
        for f in c.get("findings") or []:
            ranks = f" ({fmt_ranks(f['ranks'])})" if f.get("ranks") else ""
            out.wrap(f"    {f['severity']} {f['id']}{ranks}: {f['title']}", "      ")
        if not c.get("findings"):
            out.add("    no finding")


def _cores_line(report: Report) -> str | None:
    """ "cores: ..." for the busiest host (Report.run's host_cores), None without a measure."""
    hosts = (report.run or {}).get("host_cores") or []
    hosts = [h for h in hosts if isinstance(h, dict) and h.get("cores")]
    if not hosts:
        return None
    top = max(hosts, key=lambda h: float(h.get("busy", 0)) / float(h["cores"]))
    more = f" (the busiest of {len(hosts)} hosts)" if len(hosts) > 1 else ""
    return f"cores: {top.get('sentence', '')}{': full' if top.get('full') else ''}{more}"


def render_text(
    report: Report, *, width: int = DEFAULT_WIDTH, color: bool = False, verbose: bool = False
) -> str:
    """The report as text `width` columns wide (code excepted), ending with a newline; names
    from the traces are made `printable` (no terminal control reaches the screen). `verbose`:
    every finding's full evidence and the list of all thresholds at the end."""
    report = printable_report(report)
    if len(report.ranks) >= LARGE_RUN_RANKS:  # large runs: summarized (text_large_run.py)
        return render_large_run_text(report)
    out = TextOut(width, color)
    out.wrap(_run_line(report), hang="  ")
    if report.run:
        bits = [f"{k}={v}" for k, v in report.run.items() if isinstance(v, str | int | float)]
        if bits:
            out.wrap("run: " + ", ".join(bits), hang="  ")
    out.add(f"inputs: {len(report.inputs)} file(s), {len(report.ranks)} rank(s)")
    cores = _cores_line(report)
    if cores:
        out.wrap(cores, hang="  ")
    _summary(out, report)
    detailed = _large_run_section(out, report)
    columns = shown_columns(r.device for r in report.ranks)
    if len(columns) < len(shown_columns([])):
        hidden = ", ".join(c.header for c in shown_columns([]) if c not in columns)
        out.add("", f"(CPU-only run: GPU-only columns hidden: {hidden})")
    for rank in detailed:
        _rank_detail(out, rank, columns)
    _collectives(out, report, detailed)
    add_dimensions_table(out, report, detailed)
    _units(out, report)
    _stragglers(out, report)
    out.add(*memory_lines(report))
    out.heading(f"Findings ({len(report.findings)})")
    for f in sorted(report.findings, key=by_gain):
        add_finding(out, f, verbose=verbose)
    if not report.findings:
        out.add(
            "  none" + (" (some detectors failed: see Warnings)" if report.failed_detectors else "")
        )
    _captures(out, report)
    warnings = list(report.warnings)
    ranks_by_warning: dict[str, list[int]] = {}
    for rank in report.ranks:
        for w in rank.warnings:
            ranks_by_warning.setdefault(w, []).append(rank.rank)
    warnings += [f"{fmt_ranks(ranks)}: {w}" for w, ranks in ranks_by_warning.items()]
    if warnings:
        out.heading("Warnings")
        for w in warnings:
            out.wrap(f"- {w}", "  ")
    if verbose:
        add_thresholds(out, report.thresholds)
    return "\n".join(out.lines) + "\n"


class TextRenderer(Renderer):
    """The text report (`zdiag analyze`'s default output, `zdiag render --text`)."""

    name = "text"

    def render(self, report: Report, destination: Destination) -> Rendered:
        """The text as UTF-8 at the destination's width and colour: on a terminal its width and
        colour (unless NO_COLOR), in files and pipes DEFAULT_WIDTH columns without colour."""
        text = render_text(
            report, width=destination.width, color=destination.color, verbose=destination.verbose
        )
        return Rendered.one(destination, text.encode("utf-8"))
