"""The per-step columns, defined once for every view: the text table, the TUI's step table, the
HTML page's step tables and the Perfetto overlay's step-slice arguments.

Each `StepColumn` names a `StepBreakdown` field (`key`, also the JSON key and the Perfetto
argument name), its short header and how its cells are formatted.

Adding a step column touches at most 3 files:

1. `analyzers/report.py`: the field on `StepBreakdown`, with a default so old reports load
   (e.g. `host_launch_ms: float = 0.0`);
2. the analyzer that computes it (for `host_launch_ms`: `analyzers/rank/breakdown.py`);
3. this file: one line in `STEP_COLUMNS`.

Text, TUI, HTML and Perfetto pick it up from here; tests/unit/render/test_renderers.py checks that each of
them shows every column.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from zdiag.analyzers.report import StepBreakdown
from zdiag.render.format import fmt_ms

ColumnKind = Literal["step", "ms", "count", "verdict"]


@dataclass(frozen=True)
class StepColumn:
    """One per-step column: the `StepBreakdown` field, its header and how to format it."""

    key: str  # the StepBreakdown field: JSON key and Perfetto argument name
    header: str  # short table header (text, TUI, HTML)
    label: str  # the name in a detail view (TUI step panel)
    kind: ColumnKind
    description: str  # one line: what the number is (HTML header tooltip)
    gpu_only: bool = False  # always 0 on CPU-only runs: views hide it there

    def value(self, step: StepBreakdown) -> float | int | str:
        """The raw value of this column for `step`."""
        value: float | int | str = getattr(step, self.key)
        return value

    def cell(self, step: StepBreakdown) -> str:
        """The formatted cell (ms without the unit: the header says it)."""
        value = self.value(step)
        if self.kind == "ms" and isinstance(value, int | float):
            return fmt_ms(value, unit=False)
        return str(value)

    @property
    def numeric(self) -> bool:
        """Whether the column holds numbers (right-aligned in tables)."""
        return self.kind != "verdict"


_col = StepColumn  # one line per column: key, header, label, kind, description
STEP_COLUMNS: tuple[StepColumn, ...] = (
    _col("step", "step", "step", "step", "the step number the analysis gave the step"),
    _col("verdict", "verdict", "verdict", "verdict", "compute-, comm-, host-bound or exposed-comm"),
    _col("duration_ms", "dur ms", "duration", "ms", "step time"),
    _col("compute_ms", "compute", "compute", "ms", "time with compute kernels running"),
    _col("comm_ms", "comm", "communication", "ms", "time with communication running"),
    _col("overlapped_ms", "overlap", "  overlapped", "ms", "communication hidden under compute"),
    _col("exposed_comm_ms", "exposed", "  exposed", "ms", "communication not hidden by compute"),
    _col(
        "memcpy_ms",
        "memcpy",
        "memcpy (uncovered)",
        "ms",
        "memcpy/memset outside compute/comm",
        True,
    ),
    _col("idle_ms", "idle", "idle", "ms", "no device activity at all"),
    _col(
        "host_launch_ms",
        "launch",
        "host launch",
        "ms",
        "host time in kernel-launch API calls",
        True,
    ),
    _col("kernel_count", "kernels", "kernels", "count", "device kernels in the step", True),
)
"""The step columns, in display order: the verdict right after the step number, so a narrow
terminal still shows it."""


def shown_columns(devices: Iterable[str]) -> tuple[StepColumn, ...]:
    """The step columns worth showing for ranks on `devices`: without the GPU-only columns when
    no rank ran on a GPU (they are 0 there); every column when the device is not known."""
    kinds = set(devices)
    if kinds and kinds <= {"cpu"}:
        return tuple(c for c in STEP_COLUMNS if not c.gpu_only)
    return STEP_COLUMNS


def step_headers(columns: Sequence[StepColumn] = STEP_COLUMNS) -> list[str]:
    """The short headers of `columns` (default: every step column), in order."""
    return [c.header for c in columns]


def step_cells(step: StepBreakdown, columns: Sequence[StepColumn] = STEP_COLUMNS) -> list[str]:
    """One step's formatted cells, in `columns` order."""
    return [c.cell(step) for c in columns]


def step_values(step: StepBreakdown) -> dict[str, float | int | str]:
    """One step's raw values keyed by field name, in `STEP_COLUMNS` order (Perfetto arguments)."""
    return {c.key: c.value(step) for c in STEP_COLUMNS}
