"""A rule as a record: the finding id, what it detects and why, its thresholds, scope and function.

Each detector module declares its `RULE` (or `RULES`); the registry (detectors/__init__.py) is a
list of them, in report order. `zdiag explain ID` and docs/detectors.md are written from these
records (detectors/docs.py), and tests/unit/detectors/test_rules.py checks that every rule is documented and
that every threshold it declares is reported where the record says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..report import Finding
from .context import DetectorContext

Detect = Callable[[DetectorContext], list[Finding]]

MIB = 1024**2


@dataclass(frozen=True)
class Threshold:
    """One named constant a rule decides with.

    - `name`: the constant's name in the detector's module (`WHOLE_MODEL_SHARE`).
    - `value`: its value.
    - `why`: the reasoning behind the value.
    - `evidence`: the key of the finding's evidence that shows the value, when it does.
    - `report`: the key of `Report.thresholds` that shows it, when it does.
    A threshold with neither is used but not reported (tests/unit/detectors/test_rules.py pins which).
    """

    name: str
    value: float
    why: str
    evidence: str | None = None
    report: str | None = None

    def reported_as(self) -> str:
        """Where a report shows the value, in words ("not reported" when nowhere)."""
        places = []
        if self.evidence is not None:
            places.append(f"evidence `{self.evidence}`")
        if self.report is not None:
            places.append(f"Report.thresholds `{self.report}`")
        return ", ".join(places) or "not reported"

    def shown(self) -> str:
        """The value as the docs show it (bytes in MiB too)."""
        if isinstance(self.value, int) and self.value >= MIB and self.value % MIB == 0:
            return f"{self.value} ({self.value // MIB} MiB)"
        return f"{self.value:g}"


@dataclass(frozen=True)
class Rule:
    """One detector and everything said about it.

    - `id`: the stable finding id (`Finding.id`).
    - `summary`: what it detects, in one line (`zdiag explain` lists these).
    - `detect`: the function (a `DetectorContext` in, zero or more findings out).
    - `what`: what it detects (when it fires).
    - `why`: why that matters.
    - `example`: a finding it gives, or the situation it catches, in one or two sentences.
    - `fix`: what it recommends.
    - `gain`: how the expected gain is estimated.
    - `scope`: which runs it applies to, in words.
    - `fsdp_only`: only FSDP/ZeRO traffic can raise it (none on DDP or single-device traces).
    - `thresholds`: the named constants it decides with.
    - `markers`: the collective kinds its Perfetto markers sit on (`()`: every collective;
      None: no event markers, the finding keeps its step markers).
    """

    id: str
    summary: str
    detect: Detect
    what: str
    why: str
    example: str
    fix: str
    gain: str
    scope: str
    fsdp_only: bool = False
    thresholds: tuple[Threshold, ...] = ()
    markers: tuple[str, ...] | None = None

    def scope_text(self) -> str:
        """The scope, with "FSDP/ZeRO traffic only" when only that can raise it."""
        return self.scope + ("; raised only by FSDP/ZeRO traffic" if self.fsdp_only else "")

    def report_thresholds(self) -> dict[str, float]:
        """The thresholds `Report.thresholds` shows, by their report keys, in declared order."""
        return {t.report: t.value for t in self.thresholds if t.report is not None}
