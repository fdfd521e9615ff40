"""`memory-imbalance`: one rank peaks much higher than the others.

With data parallelism every rank should hold about the same memory; a rank at least
IMBALANCE_RATIO times the median peak (uneven sequence lengths, a rank doing extra work such as
logging or evaluation, uneven pipeline or expert placement) sets the memory every rank must fit.
The gain is bringing that rank to the median: its peak minus the median. The category that
differs most from the median rank is named.
"""

from __future__ import annotations

import statistics

from ..report import Finding, Severity
from .context import DetectorContext
from .memory_common import MIB, rank_peaks
from .rule import Rule, Threshold

# (the reasoning behind the value: RULE's thresholds, at the end of the module)
IMBALANCE_RATIO = 1.2


def detect(ctx: DetectorContext) -> list[Finding]:
    """The memory-imbalance finding, or none (fewer than two ranks with a known peak)."""
    peaks = [p for p in rank_peaks(ctx) if p.peak_bytes]
    if len(peaks) < 2:
        return []
    median = statistics.median(p.peak_bytes or 0 for p in peaks)
    worst = max(peaks, key=lambda p: p.peak_bytes or 0)
    assert worst.peak_bytes is not None
    if median <= 0 or worst.peak_bytes < IMBALANCE_RATIO * median:
        return []
    typical = min(peaks, key=lambda p: abs((p.peak_bytes or 0) - median))
    diffs = {
        c: worst.category_bytes.get(c, 0) - typical.category_bytes.get(c, 0)
        for c in set(worst.category_bytes) | set(typical.category_bytes)
    }
    top = max(diffs.items(), key=lambda kv: kv[1]) if diffs else None
    gain = int(worst.peak_bytes - median)
    severity: Severity = (
        "critical"
        if worst.over_capacity and not any(p.over_capacity for p in peaks if p.rank != worst.rank)
        else "warning"
    )
    return [
        Finding(
            id="memory-imbalance",
            severity=severity,
            title=(
                f"Rank {worst.rank} peaks at {worst.peak_bytes / MIB:.1f} MiB, "
                f"{worst.peak_bytes / median:.2f}x the median rank ({median / MIB:.1f} MiB)"
            ),
            ranks=[worst.rank],
            evidence={
                "peak_bytes_by_rank": {str(p.rank): p.peak_bytes for p in peaks},
                "median_peak_bytes": int(median),
                "ratio": round(worst.peak_bytes / median, 3),
                "threshold_ratio": IMBALANCE_RATIO,
                "largest_difference_category": top[0] if top and top[1] > 0 else None,
                "largest_difference_bytes": top[1] if top and top[1] > 0 else None,
                "compared_with_rank": typical.rank,
            },
            recommendation=(
                f"Find what rank {worst.rank} holds that the others do not"
                + (f" (mostly {top[0].lower()})" if top and top[1] > 0 else "")
                + ": balance the batch (same sequence lengths per rank), move rank-0-only "
                "work (logging, evaluation, checkpoint gathering) off the training device."
            ),
            expected_gain_bytes=gain,
            gain_method="the worst rank's peak minus the median rank's peak",
        )
    ]


RULE = Rule(
    id="memory-imbalance",
    summary="one rank peaks much higher than the others",
    detect=detect,
    what=(
        "One rank peaks at least 1.2x the median rank's peak (two or more ranks with a known "
        "peak); the category that differs most from the median rank is named."
    ),
    why=(
        "With data parallelism every rank should hold about the same memory; the heaviest "
        "rank (uneven sequence lengths, rank-0-only logging or evaluation, uneven expert "
        "placement) sets the memory every rank must fit."
    ),
    example="Rank 0 peaks at 9120.0 MiB, 1.45x the median rank (6290.0 MiB).",
    fix=(
        "Find what that rank holds that the others do not: balance the batch, move "
        "rank-0-only work (logging, evaluation, checkpoint gathering) off the training device."
    ),
    gain="The worst rank's peak minus the median rank's peak.",
    scope="runs with memory data for two or more ranks (snapshots, memory timelines, OOM records)",
    thresholds=(
        Threshold(
            "IMBALANCE_RATIO",
            IMBALANCE_RATIO,
            "Worst rank's peak over the median rank's peak from which the imbalance is "
            "reported: above ordinary differences (rank 0's extra buffers), below a rank "
            "doing real extra work.",
            evidence="threshold_ratio",
        ),
    ),
)
