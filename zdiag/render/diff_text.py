"""The text view of a run diff (`zdiag diff A B`): the attribution first, on one line, then the
step breakdown, ranks, units, collectives, memory, findings, configuration and operators.
Tables fit the width (text_blocks.fit_table); `--json` has every row."""

from __future__ import annotations

from zdiag.analyzers.compare.model import Delta, RunDiff
from zdiag.render.format import fmt_bytes, fmt_number
from zdiag.render.format import fmt_ranks as fmt_ints_short
from zdiag.render.text_blocks import TextOut, fit_table

MAX_ROWS = 12
"""Rows per table in the text (units, collectives, operators, ranks)."""


def _signed(value: float) -> str:
    return ("+" if value > 0 else "") + fmt_number(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def _delta_row(d: Delta) -> list[str]:
    return [
        d.metric,
        fmt_number(d.a),
        fmt_number(d.b),
        _signed(d.delta),
        _pct(d.pct),
        f"+-{fmt_number(d.spread)}",
        d.change,
    ]


def _more(out: TextOut, total: int, what: str) -> None:
    if total > MAX_ROWS:
        out.add(f"  ({total - MAX_ROWS} more {what}; --json has them)")


def _step(out: TextOut, diff: RunDiff) -> None:
    out.heading(
        f"Step breakdown, median ms per step ({diff.steps_a} steps in A, {diff.steps_b} in B)"
    )
    header = ["metric", "A", "B", "B-A", "%", "spread", "change"]
    fit_table(out, header, [_delta_row(d) for d in diff.step], {1, 2, 3, 4, 5})
    if diff.shares:
        parts = ", ".join(
            f"{s.component} {_signed(s.delta_ms)} ms ({100 * s.share:.0f}%)" for s in diff.shares
        )
        out.wrap(f"Where the mean step-time change went: {parts}.", indent="  ")
    if diff.idle_causes:
        out.heading("Host waits the traces measured, per step (causes of idle)")
        header = ["cause", "A", "B", "B-A", "%", "spread", "change"]
        fit_table(out, header, [_delta_row(d) for d in diff.idle_causes], {1, 2, 3, 4, 5})


def _ranks(out: TextOut, diff: RunDiff) -> None:
    if len(diff.ranks) < 2:
        return
    out.heading("Ranks, B - A in ms per step (median), the largest change first")
    names = [m.metric for m in diff.ranks[0].metrics]
    rows = [
        [
            str(r.rank),
            *(_signed(m.delta) + ("" if m.change != "no change" else " ~") for m in r.metrics),
        ]
        for r in sorted(diff.ranks, key=lambda r: -max(abs(m.delta) for m in r.metrics))[:MAX_ROWS]
    ]
    fit_table(out, ["rank", *names], rows, set(range(1, len(names) + 1)))
    if any(cell.endswith(" ~") for row in rows for cell in row):
        out.add("  (~: inside the step-to-step spread)")
    _more(out, len(diff.ranks), "ranks")


def _units(out: TextOut, diff: RunDiff) -> None:
    if not diff.units:
        return
    out.heading("FSDP units, ms per rank and step (largest exposed-wait change first)")
    rows = [
        [
            (u.unit or "(root)") + (f" [{u.only_in} only]" if u.only_in else ""),
            f"{fmt_number(u.exposed_wait_ms_a)} -> {fmt_number(u.exposed_wait_ms_b)}",
            f"{fmt_number(u.gather_ms_a)} -> {fmt_number(u.gather_ms_b)}",
            f"{fmt_number(u.reduce_ms_a)} -> {fmt_number(u.reduce_ms_b)}",
            f"{fmt_bytes(u.gathered_bytes_a)} -> {fmt_bytes(u.gathered_bytes_b)}",
        ]
        for u in diff.units[:MAX_ROWS]
    ]
    fit_table(
        out, ["unit", "exposed wait", "all-gather", "reduce", "gathered"], rows, set(), shrink=0
    )
    _more(out, len(diff.units), "units")


def _gbps(value: float | None) -> str:
    return "-" if value is None else fmt_number(value)


def _collectives(out: TextOut, diff: RunDiff) -> None:
    if not diff.collectives:
        return
    out.heading("Collectives by kind, per rank and step (largest time change first)")
    rows = [
        [
            c.kind,
            f"{fmt_number(c.count_a)} -> {fmt_number(c.count_b)}",
            f"{fmt_number(c.ms_a)} -> {fmt_number(c.ms_b)}",
            f"{fmt_number(c.exposed_ms_a)} -> {fmt_number(c.exposed_ms_b)}",
            f"{fmt_bytes(c.bytes_a)} -> {fmt_bytes(c.bytes_b)}" if c.bytes_a or c.bytes_b else "-",
            f"{_gbps(c.gbps_a)} -> {_gbps(c.gbps_b)}",
        ]
        for c in diff.collectives[:MAX_ROWS]
    ]
    header = ["kind", "calls", "ms", "exposed ms", "bytes", "GB/s"]
    fit_table(out, header, rows, set(), shrink=0)
    _more(out, len(diff.collectives), "kinds")


def _opt(value: float | None) -> str:
    return "-" if value is None else fmt_number(value)


def _groups(out: TextOut, diff: RunDiff) -> None:
    if not diff.groups:
        return
    out.heading("Process groups, per step (largest comm change first)")
    rows = [
        [
            g.group,
            fmt_ints_short(g.ranks),
            f"{_opt(g.comm_ms_a)} -> {_opt(g.comm_ms_b)}",
            f"{_opt(g.median_skew_ms_a)} -> {_opt(g.median_skew_ms_b)}",
            f"{_opt(g.wait_caused_ms_a)} -> {_opt(g.wait_caused_ms_b)}",
        ]
        for g in diff.groups[:MAX_ROWS]
    ]
    header = ["group", "ranks", "comm ms", "median skew ms", "wait caused ms"]
    fit_table(out, header, rows, set(), shrink=0)
    _more(out, len(diff.groups), "groups")


def _memory(out: TextOut, diff: RunDiff) -> None:
    if not diff.memory:
        return
    out.heading("Peak memory by category (largest over ranks)")
    rows = []
    for m in diff.memory:
        change = (
            _signed((m.b_bytes - m.a_bytes) / 2**20) + " MiB"
            if m.a_bytes is not None and m.b_bytes is not None
            else "-"
        )
        rows.append([m.category, fmt_bytes(m.a_bytes), fmt_bytes(m.b_bytes), change])
    fit_table(out, ["category", "A", "B", "B-A"], rows, {1, 2, 3})


def _findings_and_config(out: TextOut, diff: RunDiff) -> None:
    if diff.findings:
        out.heading("Findings")
        for f in diff.findings:
            mark = "+ new in B" if f.change == "appeared" else "- gone in B"
            out.wrap(f"{mark}: {f.id} [{f.severity}] {f.title}", indent="  ")
    if diff.config:
        out.heading("Configuration and environment differences")
        for c in diff.config:
            out.wrap(f"{c.key}: {c.a} -> {c.b}", indent="  ")


def _operators(out: TextOut, diff: RunDiff) -> None:
    if not diff.operators:
        return
    out.heading(
        f"Operators and kernels, per rank and step ({len(diff.operators)} changed, "
        f"{diff.operators_unchanged} unchanged)"
    )
    rows = [
        [
            o.change,
            o.device,
            f"{fmt_number(o.count_a)} -> {fmt_number(o.count_b)}",
            f"{fmt_number(o.ms_a)} -> {fmt_number(o.ms_b)}",
            o.name,
        ]
        for o in diff.operators[:MAX_ROWS]
    ]
    fit_table(out, ["change", "on", "calls", "ms", "name"], rows, set(), shrink=4)
    _more(out, len(diff.operators), "changed names")
    if not diff.operators_complete:
        out.add(
            "  (a side's table was cut at its size limit: an absent name may have run below it)"
        )


def render_diff_text(diff: RunDiff, width: int, color: bool = False) -> str:
    """The text view (see the module docstring); the first line is the attribution."""
    out = TextOut(width, color)
    out.add(diff.headline)
    out.add(f"A (baseline): {diff.baseline}", f"B (candidate): {diff.candidate}")
    for w in diff.warnings:
        out.wrap(f"warning: {w}")
    _step(out, diff)
    _ranks(out, diff)
    _units(out, diff)
    _collectives(out, diff)
    _groups(out, diff)
    _memory(out, diff)
    _findings_and_config(out, diff)
    _operators(out, diff)
    return "\n".join(out.lines) + "\n"
