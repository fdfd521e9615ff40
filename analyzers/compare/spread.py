"""Deltas judged against the step-to-step spread of each run.

Each run gives one sample per step (a metric's mean over the ranks in that step). A metric's
value is the median of its samples; its spread is the larger of the two runs' half
interquartile ranges, at least SPREAD_FLOOR_PCT of A's value (timers and scheduling jitter a
few percent on a quiet machine) and SPREAD_FLOOR_MS. A delta within the spread is "no change".
With fewer than MIN_STEPS steps on a side the spread cannot be estimated: "undetermined".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .model import Delta

MIN_STEPS = 3
"""Steps per side below which a change cannot be told from noise."""

SPREAD_FLOOR_PCT = 2.0
"""The spread is at least this share of the baseline's value, in percent."""

SPREAD_FLOOR_MS = 0.05
"""... and at least this many ms (a metric near zero on both sides is not a change)."""


def half_iqr(samples: Sequence[float]) -> float:
    """Half the interquartile range of `samples` (0 for fewer than two)."""
    if len(samples) < 2:
        return 0.0
    q1, q3 = np.percentile(np.asarray(samples, dtype=float), [25, 75])
    return float(q3 - q1) / 2.0


def median(samples: Sequence[float]) -> float:
    """The median (0 for no samples)."""
    return float(np.median(np.asarray(samples, dtype=float))) if len(samples) else 0.0


def delta(metric: str, a: Sequence[float], b: Sequence[float]) -> Delta:
    """The metric's median in A and B, the delta, its spread and the change word."""
    ma, mb = median(a), median(b)
    spread = max(half_iqr(a), half_iqr(b), abs(ma) * SPREAD_FLOOR_PCT / 100.0, SPREAD_FLOOR_MS)
    d = mb - ma
    if d == 0:
        change = "no change"  # the same run, or identical medians: whatever the steps
    elif min(len(a), len(b)) < MIN_STEPS:
        change = "undetermined"
    elif abs(d) <= spread:
        change = "no change"
    else:
        change = "up" if d > 0 else "down"
    return Delta(
        metric=metric,
        a=round(ma, 4),
        b=round(mb, 4),
        delta=round(d, 4),
        pct=round(100.0 * d / ma, 2) if ma else None,
        spread=round(spread, 4),
        change=change,
    )
