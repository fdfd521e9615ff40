"""A latency-bandwidth (alpha-beta) model of collectives, fitted to the measured durations.

time(bytes) = alpha + bytes / beta. Measured durations include waiting for late peers (arrival
skew) and, on shared CPUs, scheduling noise: they scatter far above the true cost, never below
it. So the model is fitted to the *lower envelope*: for each message size, the fastest
execution seen. `half_bandwidth_bytes` (alpha x beta) is the size at which half the time is
per-collective overhead: below it a collective is latency-bound and merging collectives pays.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..rank.fsdp_ledger import CollectiveRecord


@dataclass(frozen=True)
class AlphaBeta:
    """Fitted per-collective latency (us) and bandwidth (bytes/us = MB/s)."""

    alpha_us: float
    beta_bytes_per_us: float
    sizes: int  # distinct message sizes in the envelope

    @property
    def half_bandwidth_bytes(self) -> float:
        """Message size at which overhead and transfer take equal time (n_1/2 = alpha x beta)."""
        return self.alpha_us * self.beta_bytes_per_us

    def time_us(self, nbytes: float) -> float:
        """Modeled duration of one collective of `nbytes`."""
        return self.alpha_us + nbytes / self.beta_bytes_per_us


def fit_alpha_beta(records: Sequence[CollectiveRecord]) -> AlphaBeta | None:
    """Fit alpha/beta to the fastest execution per message size; None without usable sizes.

    The line is a Theil-Sen fit (median of pairwise slopes, median intercept) over those
    envelope points: one size whose few samples all hit a slow moment moves it little, where a
    least-squares line would follow it. alpha is kept within [0, fastest time seen] (no
    collective can beat its own overhead). With one size, or a non-positive slope, beta is the
    best bandwidth seen and alpha the fastest time minus its transfer at that bandwidth.
    """
    fastest: dict[int, float] = defaultdict(lambda: float("inf"))
    for r in records:
        if r.bytes > 0 and r.dur_us > 0:
            fastest[r.bytes] = min(fastest[r.bytes], r.dur_us)
    if not fastest:
        return None
    sizes = np.array(sorted(fastest), dtype=np.float64)
    times = np.array([fastest[int(s)] for s in sizes], dtype=np.float64)
    if len(sizes) >= 2:
        i, j = np.triu_indices(len(sizes), k=1)
        slope = float(np.median((times[j] - times[i]) / (sizes[j] - sizes[i])))
        if slope > 0:
            alpha = float(np.median(times - slope * sizes))
            alpha = min(max(alpha, 0.0), float(times.min()))
            return AlphaBeta(alpha, 1.0 / slope, len(sizes))
    beta = float((sizes / times).max())
    alpha = float(max(0.0, (times - sizes / beta).min()))
    if alpha == 0.0:
        alpha = float(times.min())  # the smallest message's time is all overhead
    return AlphaBeta(alpha, beta, len(sizes))
