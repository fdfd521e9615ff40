"""HTML fragments of the report page (summary, findings, tables); every value is escaped here."""

from __future__ import annotations

import html
from collections import defaultdict
from typing import Any

from zdiag.analyzers.report import Finding, Report
from zdiag.render._html_figures import VERDICT_COLORS
from zdiag.render.columns import shown_columns
from zdiag.render.format import (
    evidence_item,
    fmt_bytes,
    fmt_gain,
    fmt_ints,
    fmt_list,
    fmt_ms,
    fmt_share,
    fmt_value,
    known_bytes,
    unit_label,
)
from zdiag.render.memory_view import breakdown_lines
from zdiag.render.stats import (
    detailed_ranks,
    rank_stats,
    run_stats,
    worst_first,
)

MAX_EVIDENCE_ITEMS = 40
MAX_VALUE_CHARS = 400
MAX_TABLE_ROWS = 64
TOP_FINDINGS = 5
MAX_STEP_TABLE_RANKS = 8
"""Ranks with a per-step table on the page: the first and the slowest (as in the text report)."""
MAX_STEP_TABLE_ROWS = 200
"""Rows of one rank's step table; longer runs show the first and last rows and say so."""


def e(value: object) -> str:
    """Escape any value for HTML text or a quoted attribute."""
    return html.escape(str(value), quote=True)


def _table(headers: list[str], rows: list[list[str]], note: str = "") -> str:
    """A table whose cells are ALREADY escaped HTML."""
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    extra = f'<p class="note">{e(note)}</p>' if note else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{extra}"


def verdict_chip(verdict: str) -> str:
    """A colored label for a verdict."""
    color = VERDICT_COLORS.get(verdict, "#555555")
    return f'<span class="chip" style="background:{color}">{e(verdict)}</span>'


def severity_chip(severity: str) -> str:
    """A colored label for a finding's severity."""
    return f'<span class="sev sev-{e(severity)}">{e(severity)}</span>'


def ordered_findings(report: Report) -> list[tuple[int, Finding]]:
    """Findings worst first (severity, then expected gain), with their index in the Report."""
    return sorted(
        enumerate(report.findings),
        key=lambda p: worst_first(p[1]),
    )


def summary(report: Report) -> str:
    """Run facts, verdict counts, top findings, warnings."""
    stats = run_stats(report)
    parts = ['<section id="summary"><h2>Summary</h2>']
    facts: list[tuple[str, str]] = [
        ("ranks", str(stats.rank_count)),
        ("rank × step rows", str(stats.row_count)),
        ("findings", str(len(report.findings))),
    ]
    if stats.row_count:
        facts.append(("mean step time", fmt_ms(stats.mean_step_ms)))
        facts.append(("slowest step", fmt_ms(stats.slowest_step_ms)))
    if report.zdiag_version:
        facts.append(("zdiag", report.zdiag_version))
    parts.append(
        '<dl class="facts">'
        + "".join(f"<div><dt>{e(k)}</dt><dd>{e(v)}</dd></div>" for k, v in facts)
        + "</dl>"
    )
    if stats.row_count:
        rows = [
            [verdict_chip(v), e(count), e(fmt_share(count, stats.row_count))]
            for v, count in stats.verdicts
        ]
        parts.append("<h3>Step verdicts (rank × step)</h3>")
        parts.append(_table(["verdict", "steps", "share"], rows))
    else:
        parts.append('<p class="empty">No steps were found in the inputs.</p>')
    parts.append("<h3>Top findings</h3>")
    top = ordered_findings(report)[:TOP_FINDINGS]
    if top:
        items = []
        for index, f in top:
            gain = (
                f" — expected gain {e(fmt_ms(f.expected_gain_ms))}/step"
                if f.expected_gain_ms and f.expected_gain_ms > 0
                else f" — expected cost {e(fmt_ms(-f.expected_gain_ms))}/step"
                if f.expected_gain_ms
                else ""
            )
            items.append(
                f'<li>{severity_chip(f.severity)} <a href="#finding-{index}">{e(f.title)}</a>'
                f" <code>{e(f.id)}</code>{gain}</li>"
            )
        parts.append('<ol class="top">' + "".join(items) + "</ol>")
    elif not report.failed_detectors:
        parts.append('<p class="empty">No findings: nothing in the traces crossed a threshold.</p>')
    parts.append(_failed_detectors_note(report))
    if report.warnings:
        parts.append("<h3>Warnings</h3><ul>")
        parts.extend(f"<li>{e(w)}</li>" for w in report.warnings[:MAX_TABLE_ROWS])
        if len(report.warnings) > MAX_TABLE_ROWS:
            parts.append(f"<li>… and {len(report.warnings) - MAX_TABLE_ROWS} more</li>")
        parts.append("</ul>")
    parts.append("</section>")
    return "".join(parts)


def _failed_detectors_note(report: Report) -> str:
    """A warning naming the detectors that crashed ("" when none did): their findings are
    missing, so the page never says "No findings" next to them."""
    failed = report.failed_detectors
    if not failed:
        return ""
    n = len(failed)
    return (
        f'<p class="notes">{n} detector{"s" if n != 1 else ""} failed, so '
        f"{'their' if n != 1 else 'its'} findings are missing: {e(', '.join(failed))} "
        "(see Warnings).</p>"
    )


def _value(value: Any) -> str:
    """An evidence or run value, formatted as every view formats it, shortened and escaped."""
    text = fmt_value(value, limit=MAX_EVIDENCE_ITEMS)
    if len(text) > MAX_VALUE_CHARS:
        text = text[:MAX_VALUE_CHARS] + "…"
    return e(text)


def findings(report: Report) -> str:
    """Every finding: what, where, evidence, recommendation, code, expected gain."""
    parts = ['<section id="findings"><h2>Findings</h2>']
    if not report.findings:
        note = _failed_detectors_note(report)
        parts.append((note or '<p class="empty">No findings.</p>') + "</section>")
        return "".join(parts)
    for index, f in ordered_findings(report):
        parts.append(f'<article class="finding sev-border-{e(f.severity)}" id="finding-{index}">')
        parts.append(f"<h3>{severity_chip(f.severity)} {e(f.title)} <code>{e(f.id)}</code></h3>")
        where = []
        if f.ranks:
            where.append(f"ranks {fmt_ints(f.ranks)}")
        if f.steps:
            where.append(f"steps {fmt_ints(f.steps)}")
        if f.units:
            where.append("units " + fmt_list([unit_label(u) for u in f.units], 8))
        if where:
            parts.append(f'<p class="where">{e("; ".join(where))}</p>')
        if f.evidence:
            items = list(f.evidence.items())
            rows = []
            for k, v in items[:MAX_EVIDENCE_ITEMS]:
                label, shown = evidence_item(str(k), v)  # unit from the key, as text and TUI
                if len(shown) > MAX_VALUE_CHARS:
                    shown = shown[:MAX_VALUE_CHARS] + "…"
                rows.append([f'<span title="{e(k)}">{e(label)}</span>', e(shown)])
            note = (
                f"{len(items) - MAX_EVIDENCE_ITEMS} more evidence items are in the JSON report."
                if len(items) > MAX_EVIDENCE_ITEMS
                else ""
            )
            parts.append(_table(["evidence", "value"], rows, note))
        if f.recommendation:
            parts.append(
                f'<p class="rec"><strong>What to change:</strong> {e(f.recommendation)}</p>'
            )
        if f.code:
            parts.append(f"<pre><code>{e(f.code)}</code></pre>")
        gain = fmt_gain(f)
        if gain:
            method = f" ({f.gain_method})" if f.gain_method else ""
            parts.append(f'<p class="gain">Expected gain: {e(gain + method)}</p>')
        parts.append("</article>")
    parts.append("</section>")
    return "".join(parts)


def collectives(report: Report) -> str:
    """Collective totals per kind over all ranks, and the straggler table."""
    parts = ['<section id="collectives"><h2>Collectives and stragglers</h2>']
    if report.collectives:
        agg: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0, 0])
        ranks_of: dict[str, set[int]] = defaultdict(set)
        for c in report.collectives:
            a = agg[c.kind]
            a[0] += c.count
            a[2] += c.total_ms
            a[3] += c.exposed_ms
            size = known_bytes(c.total_bytes, c.count)
            if size is None:
                a[4] += 1  # rows whose size the trace did not record
            else:
                a[1] += size
            ranks_of[c.kind].add(c.rank)

        def size_cell(a: list[float]) -> str:
            if not a[4]:
                return fmt_bytes(int(a[1]))
            return f"at least {fmt_bytes(int(a[1]))}" if a[1] else fmt_bytes(None)

        rows = [
            [
                e(kind),
                e(len(ranks_of[kind])),
                e(int(a[0])),
                e(size_cell(a)),
                e(fmt_ms(a[2])),
                e(fmt_ms(a[3])),
            ]
            for kind, a in sorted(agg.items(), key=lambda p: -p[1][2])
        ]
        parts.append(
            _table(
                ["kind", "ranks", "count", "bytes", "time", "exposed"],
                rows,
                "Totals over all ranks.",
            )
        )
    else:
        parts.append('<p class="empty">No collectives were found.</p>')
    if report.stragglers:
        worst = sorted(report.stragglers, key=lambda s: -s.wait_caused_ms)
        rows = [
            [
                e(s.rank),
                e(s.matched_collectives),
                e(s.last_arrivals),
                e(fmt_ms(s.wait_caused_ms)),
                e(fmt_ms(s.mean_skew_ms)),
            ]
            for s in worst[:MAX_TABLE_ROWS]
        ]
        note = (
            f"The {MAX_TABLE_ROWS} ranks that caused the most waiting."
            if len(worst) > MAX_TABLE_ROWS
            else ""
        )
        parts.append("<h3>Stragglers (who arrived last)</h3>")
        parts.append(
            _table(
                ["rank", "matched collectives", "last arrivals", "wait caused", "mean skew"],
                rows,
                note,
            )
        )
    parts.append("</section>")
    return "".join(parts)


def captures(report: Report) -> str:
    """The triggered captures, each its own window (the run's `captures`), or nothing."""
    entries = (report.run or {}).get("captures") or []
    if not entries:
        return ""
    rows = []
    for c in entries[:MAX_TABLE_ROWS]:
        if c.get("error"):
            rows.append(
                [
                    f"<code>{e(c['capture'])}</code>",
                    "",
                    "",
                    "",
                    "",
                    f"not analyzed: {e(c['error'])}",
                ]
            )
            continue
        steps = c.get("steps") or []
        found = "; ".join(
            f"{f['severity']} {f['id']}: {f['title']}" for f in c.get("findings") or []
        )
        rows.append(
            [
                f"<code>{e(c['capture'])}</code>",
                e(f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else steps[0] if steps else ""),
                e(", ".join(str(r) for r in c.get("ranks") or [])),
                e(c.get("median_step_ms") if c.get("median_step_ms") is not None else ""),
                e(c.get("verdict") or ""),
                e(found or "no finding"),
            ]
        )
    return (
        '<section id="captures"><h2>Triggered captures</h2><p>Each capture is its own profiler '
        "window, analyzed on its own.</p>"
        + _table(["capture", "steps", "ranks", "median step ms", "verdict", "findings"], rows)
        + "</section>"
    )


def run_facts(report: Report) -> str:
    """Inputs, the manifest summary and the verdict thresholds."""
    parts = ['<section id="run"><h2>Run and thresholds</h2>']
    if report.run:
        items = [(k, v) for k, v in report.run.items() if k != "captures"]
        rows = [[e(k), _value(v)] for k, v in items[:MAX_TABLE_ROWS]]
        parts.append(_table(["run", "value"], rows))
    if report.thresholds:
        rows = [[e(k), _value(v)] for k, v in report.thresholds.items()]
        parts.append(_table(["threshold", "value"], rows))
    if report.inputs:
        shown = report.inputs[:MAX_TABLE_ROWS]
        more = (
            f"<li>… and {len(report.inputs) - len(shown)} more</li>"
            if len(report.inputs) > len(shown)
            else ""
        )
        parts.append(
            f"<details><summary>{e(len(report.inputs))} input file(s)</summary><ul>"
            + "".join(f"<li><code>{e(p)}</code></li>" for p in shown)
            + more
            + "</ul></details>"
        )
    rank_warnings = [(r.rank, w) for r in report.ranks for w in r.warnings]
    if rank_warnings:
        parts.append("<h3>Per-rank warnings</h3><ul>")
        parts.extend(
            f"<li>rank {e(rank)}: {e(w)}</li>" for rank, w in rank_warnings[:MAX_TABLE_ROWS]
        )
        parts.append("</ul>")
    parts.append(f'<p class="note">Report schema {e(report.schema)}.</p></section>')
    return "".join(parts)


def step_tables(report: Report) -> list[str]:
    """Per-step tables (the shared step columns) for the first rank and the slowest ones, each
    folded in a <details> with the rank's summary line."""
    ranks = sorted(report.ranks, key=lambda r: r.rank)
    shown = detailed_ranks(ranks, MAX_STEP_TABLE_RANKS)
    if not any(r.steps for r in shown):
        return []
    columns = shown_columns(r.device for r in ranks)  # no GPU-only columns on CPU-only runs
    titles = "".join(f'<th title="{e(c.description)}">{e(c.header)}</th>' for c in columns)
    parts = ["<h3>Per-step breakdown (ms)</h3>"]
    if len(shown) < len(ranks):
        parts.append(
            f'<p class="note">Rank {shown[0].rank} and the slowest ranks by median step time: '
            f"{len(shown)} of {len(ranks)}; every rank is in the JSON report.</p>"
        )
    for rank in shown:
        if not rank.steps:
            continue
        stats = rank_stats(rank)
        steps = rank.steps
        hidden = 0
        if len(steps) > MAX_STEP_TABLE_ROWS:
            half = MAX_STEP_TABLE_ROWS // 2
            hidden = len(steps) - 2 * half
            steps = steps[:half] + steps[-half:]
        body = "".join(
            "<tr>"
            + "".join(
                f"<td>{verdict_chip(s.verdict)}</td>"
                if c.kind == "verdict"
                else f'<td class="num">{e(c.cell(s))}</td>'
                for c in columns
            )
            + "</tr>"
            for s in steps
        )
        note = (
            f'<p class="note">{hidden} middle steps are not shown; they are in the JSON report.</p>'
            if hidden
            else ""
        )
        summary_line = (
            f"rank {rank.rank}: {stats.step_count} step(s), median {fmt_ms(stats.median_ms)}, "
            f"max {fmt_ms(stats.max_ms)}, mostly {stats.dominant_verdict}"
        )
        parts.append(
            f"<details><summary>{e(summary_line)}</summary>"
            f"<table><thead><tr>{titles}</tr></thead><tbody>{body}</tbody></table>{note}"
            "</details>"
        )
    return parts


def memory_breakdowns(report: Report) -> list[str]:
    """The snapshots' breakdowns (peak by category, sites, what-ifs) as preformatted text, the
    text report's memory section without its timeline sparklines (the figures draw those)."""
    if not report.memory_breakdowns:
        return []
    lines = [
        line
        for b in sorted(report.memory_breakdowns, key=lambda b: b.rank)[:16]
        for line in breakdown_lines(b)
    ]
    return [f'<pre class="memory-breakdown">{e(chr(10).join(lines))}</pre>']
