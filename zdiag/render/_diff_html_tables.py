"""The tables of the diff page (`zdiag diff A B --html`): one function per RunDiff section.

Every function returns HTML whose values went through `e` (the model's strings are read from
traces and run configurations, so they are untrusted). Numbers are formatted by render/format.py,
as in every other view; a numeric column is right-aligned by the `num-from-N` wrapper class
(every cell from column N on).
"""

from __future__ import annotations

from collections.abc import Sequence

from zdiag.analyzers.compare.model import (
    CollectiveDelta,
    Delta,
    OperatorChange,
    RunDiff,
    UnitDelta,
)
from zdiag.render._html_parts import _table, e, severity_chip
from zdiag.render.format import (
    NONE_SHOWN,
    fmt_bytes,
    fmt_ms,
    fmt_number,
    fmt_ranks,
    known_bytes,
    unit_label,
)

MAX_ROWS = 64
"""Rows of one table (ranks, units, collectives); the rest are in the JSON diff."""

MAX_OPERATOR_ROWS = 100
"""Rows of one operator change class."""

MAX_NAME_CHARS = 160
"""Characters of an operator name shown (C++ template names run to kilobytes)."""

OPERATOR_CLASSES = ("added", "deleted", "increased", "decreased", "slower", "faster")
"""The operator change classes, in the order the page lists them."""

CHANGE_CLASS = {
    "up": "chg-up",
    "down": "chg-down",
    "no change": "chg-same",
    "undetermined": "chg-unknown",
    "appeared": "chg-up",
    "gone": "chg-down",
    "added": "chg-up",
    "increased": "chg-up",
    "slower": "chg-up",
    "deleted": "chg-down",
    "decreased": "chg-down",
    "faster": "chg-down",
}
"""CSS class of a change word (the page's stylesheet colors them)."""


TEXT_CLASS = {"up": "txt-up", "down": "txt-down"}
"""CSS class of a number colored by its change word."""


def change_chip(change: str) -> str:
    """A colored label for a change word ("up", "down", "no change", ...)."""
    return f'<span class="chg {CHANGE_CLASS.get(change, "chg-same")}">{e(change)}</span>'


def numeric(table: str, first: int = 2) -> str:
    """`table` with its cells from column `first` (1-based) on right-aligned."""
    return f'<div class="num-from-{first}">{table}</div>'


def signed_ms(value: float) -> str:
    """A duration delta with its sign ("+2.07", "-14.2", "0")."""
    shown = fmt_number(value)
    return shown if value <= 0 or shown.startswith("+") else f"+{shown}"


def pct(value: float | None) -> str:
    """A signed percentage ("+3.4%"; "—" when the baseline is 0)."""
    return NONE_SHOWN if value is None else f"{value:+.1f}%"


def _cut(rows: list[list[str]], limit: int, what: str) -> tuple[list[list[str]], str]:
    """At most `limit` rows, and a note saying how many were left out."""
    if len(rows) <= limit:
        return rows, ""
    return rows[:limit], f"The first {limit} of {len(rows)} {what}; all are in the JSON diff."


def _delta_row(d: Delta) -> list[str]:
    return [
        e(d.metric),
        e(fmt_ms(d.a, unit=False)),
        e(fmt_ms(d.b, unit=False)),
        e(signed_ms(d.delta)),
        e(pct(d.pct)),
        e(f"±{fmt_number(d.spread)}"),
        change_chip(d.change),
    ]


def step_table(diff: RunDiff) -> str:
    """The run's breakdown per step (medians over steps): A, B, delta, pct, spread, change."""
    headers = ["metric (ms/step)", "A", "B", "Δ", "Δ %", "spread", "change"]
    note = "Medians over steps; a delta within ±spread is no change."
    return numeric(_table(headers, [_delta_row(d) for d in diff.step], note))


def idle_causes_table(diff: RunDiff) -> str:
    """The host waits the traces measured, per step (kernel launches, the DataLoader, syncs)."""
    headers = ["cause (per step)", "A", "B", "Δ", "Δ %", "spread", "change"]
    note = "Launch time: medians over steps; data loading and syncs: over ranks (trace totals)."
    return numeric(_table(headers, [_delta_row(d) for d in diff.idle_causes], note))


def shares_table(diff: RunDiff) -> str:
    """Where the mean step-time change went: each part's delta and its share."""
    rows = [
        [e(s.component), e(signed_ms(s.delta_ms)), e(f"{100 * s.share + 0.0:.0f}%")]
        for s in diff.shares
    ]
    note = "Means over steps; the parts add up to the mean step-time delta."
    return numeric(_table(["part", "Δ ms/step", "share of the change"], rows, note))


def ranks_table(diff: RunDiff) -> str:
    """Each rank in both runs: its step time in A and B, then every metric's delta."""
    if not diff.ranks:
        return '<p class="empty">No rank is in both runs.</p>'
    names = [m.metric for m in diff.ranks[0].metrics[1:]]
    headers = ["rank", "step A", "step B", "Δ step", "change", *(f"Δ {n}" for n in names)]
    ordered = sorted(diff.ranks, key=lambda r: -abs(r.metrics[0].delta) if r.metrics else 0.0)
    rows = []
    for r in ordered if len(diff.ranks) > MAX_ROWS else diff.ranks:
        step, rest = r.metrics[0], r.metrics[1:]
        rows.append(
            [
                e(r.rank),
                e(fmt_ms(step.a, unit=False)),
                e(fmt_ms(step.b, unit=False)),
                e(signed_ms(step.delta)),
                change_chip(step.change),
                *(
                    f'<span class="{TEXT_CLASS.get(m.change, "")}" title="{e(m.change)}: '
                    f'{e(fmt_ms(m.a))} → {e(fmt_ms(m.b))}">{e(signed_ms(m.delta))}</span>'
                    for m in rest
                ),
            ]
        )
    rows, note = _cut(rows, MAX_ROWS, "ranks (largest step-time change first)")
    return numeric(_table(headers, rows, note or "ms per step, medians over the rank's steps."))


def _unit_row(u: UnitDelta) -> list[str]:
    def side(value: float, which: str, fmt: str = "ms") -> str:
        if u.only_in and u.only_in != which:
            return NONE_SHOWN
        return fmt_bytes(value) if fmt == "bytes" else fmt_ms(value, unit=False)

    where = f' <span class="note">({e(u.only_in)} only)</span>' if u.only_in else ""
    return [
        f"<code>{e(unit_label(u.unit))}</code>{where}",
        e(side(u.exposed_wait_ms_a, "A")),
        e(side(u.exposed_wait_ms_b, "B")),
        e(signed_ms(u.exposed_wait_ms_b - u.exposed_wait_ms_a)),
        e(side(u.gather_ms_a, "A")),
        e(side(u.gather_ms_b, "B")),
        e(side(u.reduce_ms_a, "A")),
        e(side(u.reduce_ms_b, "B")),
        e(side(u.gathered_bytes_a, "A", "bytes")),
        e(side(u.gathered_bytes_b, "B", "bytes")),
    ]


def units_table(diff: RunDiff) -> str:
    """FSDP units, the largest exposed-wait change first (ms per rank and step)."""
    if not diff.units:
        return '<p class="empty">Neither run has FSDP units.</p>'
    headers = ["unit", "wait A", "wait B", "Δ wait"]
    headers += ["gather A", "gather B", "reduce A", "reduce B", "gathered A", "gathered B"]
    rows, note = _cut([_unit_row(u) for u in diff.units], MAX_ROWS, "units")
    note = note or "Exposed wait, gather and reduce in ms per rank and step; bytes per step."
    return numeric(_table(headers, rows, note))


def collective_size(nbytes: float, count: float) -> str:
    """A collective kind's bytes per step: "unknown" when its calls recorded no size, "—" when
    the kind did not run."""
    if count == 0 and nbytes == 0:
        return NONE_SHOWN  # the kind did not run on this side
    return fmt_bytes(known_bytes(round(nbytes), 1 if count > 0 else 0))


def gbps(value: float | None) -> str:
    """A bandwidth in GB/s (3 significant digits; "—" when unknown)."""
    return NONE_SHOWN if value is None else f"{value:.3g}"


def _collective_row(c: CollectiveDelta) -> list[str]:
    return [
        e(c.kind),
        e(fmt_number(c.count_a)),
        e(fmt_number(c.count_b)),
        e(collective_size(c.bytes_a, c.count_a)),
        e(collective_size(c.bytes_b, c.count_b)),
        e(fmt_ms(c.ms_a, unit=False)),
        e(fmt_ms(c.ms_b, unit=False)),
        e(signed_ms(c.ms_b - c.ms_a)),
        e(fmt_ms(c.exposed_ms_a, unit=False)),
        e(fmt_ms(c.exposed_ms_b, unit=False)),
        e(gbps(c.gbps_a)),
        e(gbps(c.gbps_b)),
    ]


def collectives_table(diff: RunDiff) -> str:
    """Collectives by kind, the largest time change first, with their bandwidth."""
    if not diff.collectives:
        return '<p class="empty">Neither run has collectives.</p>'
    headers = ["kind", "calls A", "calls B", "bytes A", "bytes B", "ms A", "ms B", "Δ ms"]
    headers += ["exposed A", "exposed B", "GB/s A", "GB/s B"]
    rows, note = _cut([_collective_row(c) for c in diff.collectives], MAX_ROWS, "kinds")
    note = note or (
        "Per rank and step. GB/s is bytes over time (— where the trace recorded no size)."
    )
    return numeric(_table(headers, rows, note))


def groups_table(diff: RunDiff) -> str:
    """Process-group instances: communication, arrival skew and wait caused, in A and B."""
    if not diff.groups:
        return '<p class="empty">No process group with 2+ ranks on either side.</p>'

    def ms(v: float | None) -> str:
        return e(NONE_SHOWN if v is None else fmt_number(v))

    rows = [
        [
            e(g.group),
            e(fmt_ranks(g.ranks)),
            *(ms(v) for v in (g.comm_ms_a, g.comm_ms_b, g.median_skew_ms_a, g.median_skew_ms_b)),
            *(ms(v) for v in (g.wait_caused_ms_a, g.wait_caused_ms_b)),
        ]
        for g in diff.groups
    ]
    rows, note = _cut(rows, MAX_ROWS, "groups")
    headers = ["group", "ranks", "comm ms A", "comm ms B", "skew A", "skew B", "wait A", "wait B"]
    return numeric(_table(headers, rows, note or "Per step; skew is the median arrival skew."))


def memory_table(diff: RunDiff) -> str:
    """Peak memory by category, the largest over ranks, in A and B."""
    if not diff.memory:
        return '<p class="empty">Neither run recorded memory.</p>'
    rows = []
    for m in diff.memory:
        both = m.a_bytes is not None and m.b_bytes is not None
        d = (m.b_bytes or 0) - (m.a_bytes or 0)
        rows.append(
            [
                e(m.category),
                e(fmt_bytes(m.a_bytes) if m.a_bytes is not None else "not recorded"),
                e(fmt_bytes(m.b_bytes) if m.b_bytes is not None else "not recorded"),
                e(("+" if d > 0 else "") + fmt_bytes(d) if both else NONE_SHOWN),
                e(f"{100 * d / m.a_bytes:+.1f}%" if both and m.a_bytes else NONE_SHOWN),
            ]
        )
    return numeric(_table(["category", "peak A", "peak B", "Δ", "Δ %"], rows))


def findings_table(diff: RunDiff) -> str:
    """Findings raised in one run only: appeared (B only) and gone (A only)."""
    if not diff.findings:
        return '<p class="empty">Both runs raised the same findings.</p>'
    rows = [
        [change_chip(f.change), severity_chip(f.severity), f"<code>{e(f.id)}</code>", e(f.title)]
        for f in diff.findings
    ]
    return _table(["change", "severity", "id", "finding"], rows)


def _config_value(value: object) -> str:
    return (
        '<span class="empty">not recorded</span>' if value is None else f"<code>{e(value)}</code>"
    )


def config_table(diff: RunDiff) -> str:
    """The configuration keys whose values differ."""
    if not diff.config:
        return '<p class="empty">The recorded configurations are the same.</p>'
    rows = [[e(c.key), _config_value(c.a), _config_value(c.b)] for c in diff.config]
    return f'<div class="keys">{_table(["key", "A", "B"], rows)}</div>'


def _short(name: str) -> str:
    return name if len(name) <= MAX_NAME_CHARS else name[: MAX_NAME_CHARS - 1] + "…"


def _operator_rows(changes: Sequence[OperatorChange]) -> list[list[str]]:
    return [
        [
            f'<code title="{e(o.name)}">{e(_short(o.name))}</code>',
            e(o.device),
            e(fmt_number(o.count_a)),
            e(fmt_number(o.count_b)),
            e(fmt_ms(o.ms_a, unit=False)),
            e(fmt_ms(o.ms_b, unit=False)),
            e(signed_ms(o.ms_b - o.ms_a)),
        ]
        for o in changes
    ]


def operators_tables(diff: RunDiff) -> str:
    """The changed operators and kernels, one folded table per change class."""
    headers = ["name", "device", "calls A", "calls B", "ms A", "ms B", "Δ ms"]
    parts = []
    for change in OPERATOR_CLASSES:
        group = [o for o in diff.operators if o.change == change]
        if not group:
            continue
        rows, note = _cut(_operator_rows(group), MAX_OPERATOR_ROWS, f"{change} names")
        parts.append(
            f"<details open><summary>{change_chip(change)} {len(group)} name(s)</summary>"
            f"{numeric(_table(headers, rows, note), 3)}</details>"
        )
    if not parts:
        parts.append('<p class="empty">No operator or kernel changed.</p>')
    tail = f"{diff.operators_unchanged} unchanged name(s) are not listed. Calls and ms per step."
    if not diff.operators_complete:
        tail += " A run's operator table was cut at its size limit: a name absent on one side may have run below the cut."
    return "".join(parts) + f'<p class="note">{e(tail)}</p>'
