"""Rich `Text` blocks for the terminal report browser (tui/report_app.py).

Everything is built with `Text.append` (never markup parsing), so names read from traces,
including ones that look like Rich/Textual markup (`[bold]`, `[/]`, `[@click=...]`), are shown
literally.
"""

from __future__ import annotations

from rich.text import Text

from zdiag.analyzers.report import Finding, Report, StepBreakdown
from zdiag.render.columns import STEP_COLUMNS
from zdiag.render.dimensions import dimension_roles, step_dimensions
from zdiag.render.format import (
    evidence_item,
    fmt_gain,
    fmt_ints,
    fmt_list,
    fmt_ms,
    fmt_share,
    fmt_value,
    unit_label,
)
from zdiag.render.stats import RankView, related_findings, run_stats

VERDICT_STYLES = {
    "compute-bound": "bold green",
    "exposed-comm": "bold dark_orange",
    "comm-bound": "bold red",
    "host-bound": "bold magenta",
}
SEVERITY_STYLES = {
    "critical": "bold white on red",
    "warning": "bold black on dark_orange",
    "info": "bold white on blue",
}


def verdict_text(verdict: str) -> Text:
    """A verdict, colored."""
    return Text(verdict, style=VERDICT_STYLES.get(verdict, "bold"))


def severity_text(severity: str) -> Text:
    """A severity as a colored badge."""
    return Text(f" {severity} ", style=SEVERITY_STYLES.get(severity, "reverse"))


def _line(text: Text, label: str, value: str | Text, style: str = "") -> None:
    # A label as long as the column still gets one space before its value.
    text.append(f"{label:<21} ", style="dim")
    if isinstance(value, Text):
        text.append_text(value)
    else:
        text.append(value, style=style)
    text.append("\n")


def step_detail(report: Report, rank: RankView, step: StepBreakdown) -> Text:
    """One step of one rank: its breakdown, verdict and the findings that concern it."""
    text = Text()
    text.append(f"Rank {rank.rank} · step {step.step}", style="bold")
    text.append("  ")
    text.append_text(verdict_text(step.verdict))
    text.append("\n")
    if step.verdict_reason:
        text.append(step.verdict_reason + "\n", style="italic")
    for column in STEP_COLUMNS:
        if column.kind == "ms":
            value = float(column.value(step))
            bold = column.key == "exposed_comm_ms" and value > 0
            _line(text, column.label, fmt_ms(value), "bold" if bold else "")
        elif column.kind == "count":
            _line(text, column.label, column.cell(step))
    _dimension_lines(text, report, step)
    related = related_findings(report, rank.rank, step.step)
    if related:
        text.append("Findings here: ", style="dim")
        text.append(", ".join(f.id for f in related) + "\n")
    return text


def _dimension_lines(text: Text, report: Report, step: StepBreakdown) -> None:
    """The step's communication by mesh dimension (ranks of several groups only)."""
    dims = step_dimensions(step)
    if not dims:
        return
    roles = dimension_roles(report)
    text.append("Comm by dimension\n", style="bold underline")
    for d in dims:
        role = roles.get(d.dimension, ("", None))[0]
        label = f"{d.dimension} ({role})" if role and role != d.dimension else d.dimension
        _line(
            text,
            label,
            f"{fmt_ms(d.comm_ms)} comm, {fmt_ms(d.exposed_comm_ms)} exposed, {d.calls} calls",
        )


def finding_detail(finding: Finding) -> Text:
    """Everything a finding says: where, evidence, what to change, code, expected gain."""
    text = Text()
    text.append_text(severity_text(finding.severity))
    text.append(" ")
    text.append(finding.title, style="bold")
    text.append("\n")
    text.append(finding.id + "\n\n", style="dim")
    if finding.ranks:
        _line(text, "ranks", fmt_ints(finding.ranks))
    if finding.steps:
        _line(text, "steps", fmt_ints(finding.steps))
    if finding.units:
        _line(text, "units", fmt_list([unit_label(u) for u in finding.units], 8))
    if finding.evidence:
        text.append("\nEvidence\n", style="bold underline")
        for key, value in list(finding.evidence.items())[:40]:
            label, shown = evidence_item(str(key), value)
            _line(text, label, shown[:300])
    if finding.recommendation:
        text.append("\nWhat to change\n", style="bold underline")
        text.append(finding.recommendation + "\n")
    if finding.code:
        text.append("\n")
        text.append(finding.code + "\n", style="cyan")
    gain = fmt_gain(finding)
    if gain:
        text.append("\nExpected gain: ", style="bold")
        text.append(gain)
        if finding.gain_method:
            text.append(f" ({finding.gain_method})", style="dim")
        text.append("\n")
    return text


def summary(report: Report) -> Text:
    """Verdict counts, findings by severity, warnings, run facts and inputs."""
    text = Text()
    stats = run_stats(report)
    text.append("zdiag report", style="bold")
    if report.zdiag_version:
        text.append(f"  (zdiag {report.zdiag_version}, {report.schema})", style="dim")
    text.append("\n\n")
    _line(text, "ranks", str(stats.rank_count))
    _line(text, "rank × step rows", str(stats.row_count))
    if stats.row_count:
        _line(text, "mean step time", fmt_ms(stats.mean_step_ms))
        _line(text, "slowest step", fmt_ms(stats.slowest_step_ms))
    _line(text, "findings", str(len(report.findings)))
    if stats.row_count:
        text.append("\nStep verdicts\n", style="bold underline")
        for v, count in stats.verdicts:
            _line(
                text,
                v,
                f"{count} ({fmt_share(count, stats.row_count)})",
                VERDICT_STYLES.get(v, ""),
            )
    else:
        text.append("\nNo steps were found in the inputs.\n", style="italic")
    if report.warnings:
        text.append("\nWarnings\n", style="bold underline")
        for w in report.warnings[:50]:
            text.append(f"• {w}\n")
    if report.run:
        text.append("\nRun\n", style="bold underline")
        for key, value in list(report.run.items())[:40]:
            _line(text, str(key), str(value)[:200])
    if report.thresholds:
        text.append("\nThresholds\n", style="bold underline")
        for key, value in report.thresholds.items():
            _line(text, str(key), fmt_value(value))
    if report.inputs:
        text.append("\nInputs\n", style="bold underline")
        for path in report.inputs[:20]:
            text.append(f"{path}\n")
        if len(report.inputs) > 20:
            text.append(f"… and {len(report.inputs) - 20} more\n", style="dim")
    return text
