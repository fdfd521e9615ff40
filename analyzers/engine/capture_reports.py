"""Each triggered capture of a run, analyzed and summarized into the run's Report.

A triggered capture (`captures/capture-<K>/`, taken when the monitor asked every rank for a
profile) is its own window. `with_captures(report, run_dir, options)` analyzes each (at most
MAX_CAPTURES_ANALYZED, in capture order: their in-job summaries first, so a capture costs little)
and puts one compact entry per capture in `report.run["captures"]`: its folder, ranks, steps,
median step, most common step verdict and findings (id, severity, title, ranks, expected gain),
or the one sentence saying why it could not be read. The renderers show them after the
findings. A damaged or empty capture never fails the run's analysis.
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from zdiag.errors import UserError

from ..inputs.run_dir import capture_windows
from ..report import Report
from .summary_pipeline import SummaryOptions, analyze_via_summaries

MAX_CAPTURES_ANALYZED = 4
"""Captures analyzed per run (the collectors take at most this many: MAX_CAPTURES_PER_RUN)."""


def capture_entry(rel: str, report: Report) -> dict[str, Any]:
    """The compact entry of one analyzed capture."""
    steps = [s for r in report.ranks for s in r.steps]
    verdicts = Counter(s.verdict for s in steps)
    return {
        "capture": rel,
        "ranks": sorted({r.rank for r in report.ranks}),
        "steps": sorted({s.step for s in steps}),
        "median_step_ms": round(statistics.median(s.duration_ms for s in steps), 3) if steps else None,
        "verdict": verdicts.most_common(1)[0][0] if verdicts else None,
        "findings": [
            {"id": f.id, "severity": f.severity, "title": f.title, "ranks": list(f.ranks),
             "expected_gain_ms": f.expected_gain_ms}
            for f in report.findings
        ],
    }  # fmt: skip


def with_captures(report: Report, run_dir: Path, options: SummaryOptions) -> Report:
    """`report` with an entry per triggered capture of `run_dir` in `run["captures"]` (the
    report as it is when the run holds none)."""
    windows = capture_windows(run_dir)[:MAX_CAPTURES_ANALYZED]
    if not windows:
        return report
    entries: list[dict[str, Any]] = []
    for rel, _n in windows:
        try:
            captured = analyze_via_summaries([run_dir / rel], options).report
        except (UserError, OSError, ValueError) as exc:  # damaged or empty: said, not fatal
            entries.append({"capture": rel, "error": str(exc)})
            continue
        entries.append(capture_entry(rel, captured))
    run = dict(report.run or {})
    run["captures"] = entries
    return msgspec.structs.replace(report, run=run)
