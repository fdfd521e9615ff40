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

from zdiag.analyzers.fsdp_ledger import CollectiveRecord


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

    With one size (or a non-positive slope) beta is the best bandwidth seen and alpha the
    fastest small-message time minus its transfer at that bandwidth (never negative).
    """
    fastest: dict[int, float] = defaultdict(lambda: float("inf"))
    for r in records:
        if r.bytes > 0 and r.dur_us > 0:
            fastest[r.bytes] = min(fastest[r.bytes], r.dur_us)
    if not fastest:
        return None
    sizes = np.array(sorted(fastest), dtype=np.float64)
    times = np.array([fastest[int(s)] for s in sizes], dtype=np.float64)
    if len(sizes) >= 2 and sizes[-1] > sizes[0]:
        slope, intercept = np.polyfit(sizes, times, 1)
        if slope > 0 and intercept >= 0:
            return AlphaBeta(float(intercept), float(1.0 / slope), len(sizes))
    beta = float((sizes / times).max())
    alpha = float(max(0.0, (times - sizes / beta).min()))
    if alpha == 0.0:
        alpha = float(times.min())  # smallest message's time is all overhead
    return AlphaBeta(alpha, beta, len(sizes))
