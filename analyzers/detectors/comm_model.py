"""A latency-bandwidth (alpha-beta) model of collectives, fitted to the measured durations.

time(bytes) = alpha + bytes / beta. Measured durations include waiting for late peers (arrival
skew) and, on shared CPUs, scheduling noise: they scatter far above the true cost, never below
it. So the model is fitted to the *lower envelope*: for each message size, the fastest
execution seen. `half_bandwidth_bytes` (alpha x beta) is the size at which half the time is
per-collective overhead: below it a collective is latency-bound and merging collectives pays.
`judge_below_flat` says how firmly the executions place a message size on one side of where the
bandwidth flattens: a judgement the noise could flip is reported as undecided, not as a verdict.
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


def _envelope(records: Sequence[CollectiveRecord]) -> dict[int, np.ndarray]:
    """Message size -> the sorted durations of its executions (known sizes and times only)."""
    by_size: dict[int, list[float]] = defaultdict(list)
    for r in records:
        if r.bytes > 0 and r.dur_us > 0:
            by_size[r.bytes].append(r.dur_us)
    return {s: np.sort(np.array(d, dtype=np.float64)) for s, d in sorted(by_size.items())}


def _fit_points(sizes: np.ndarray, times: np.ndarray) -> AlphaBeta:
    """The Theil-Sen line through (size, fastest time) points (`fit_alpha_beta`)."""
    if len(sizes) >= 2:
        i, j = np.triu_indices(len(sizes), k=1)
        slope = float(np.median((times[j] - times[i]) / (sizes[j] - sizes[i])))
        if slope > 0:
            alpha = float(np.median(times - slope * sizes))
            alpha = min(max(alpha, 0.0), float(times.min()))
            return AlphaBeta(alpha, 1.0 / slope, len(sizes))
    # no growth with size: beta is the best bandwidth seen and the fastest time is all overhead
    # (the time left after the transfer at that bandwidth is 0 at the point that sets it, up to
    # rounding: an `== 0.0` test on it once let 1e-14 through as the latency)
    beta = float((sizes / times).max())
    return AlphaBeta(float(times.min()), beta, len(sizes))


def fit_alpha_beta(records: Sequence[CollectiveRecord]) -> AlphaBeta | None:
    """Fit alpha/beta to the fastest execution per message size; None without usable sizes.

    The line is a Theil-Sen fit (median of pairwise slopes, median intercept) over those
    envelope points: one size whose few samples all hit a slow moment moves it little, where a
    least-squares line would follow it. alpha is kept within [0, fastest time seen] (no
    collective can beat its own overhead). With one size, or a non-positive slope, beta is the
    best bandwidth seen and alpha the fastest time seen (all overhead: no growth with size tells
    the transfer apart).
    """
    env = _envelope(records)
    if not env:
        return None
    sizes = np.array(list(env), dtype=np.float64)
    return _fit_points(sizes, np.array([d[0] for d in env.values()]))


RESAMPLES = 500
"""Bootstrap resamples behind `SizeJudgement.below_share` (a fixed seed: the same records always
give the same share)."""


@dataclass(frozen=True)
class SizeJudgement:
    """Whether a message size lies below the size where the fitted bandwidth flattens, with the
    confidence the measured executions give it.

    `below_share` is the share of bootstrap resamples (each size's executions drawn again with
    replacement, the fit redone on their fastest) in which `message_bytes` is below
    `ratio x alpha x beta`; None when the records hold fewer than two sizes (one size cannot
    separate the per-collective latency from the bandwidth). `flat_low_bytes` / `flat_high_bytes`
    bound that flat size in 90% of the resamples (5th and 95th percentiles)."""

    fit: AlphaBeta
    message_bytes: float
    ratio: float
    below_share: float | None
    flat_low_bytes: float
    flat_high_bytes: float
    executions: int

    @property
    def flat_bytes(self) -> float:
        """The size where the fitted bandwidth flattens (`ratio x alpha x beta`)."""
        return self.ratio * self.fit.half_bandwidth_bytes


def judge_below_flat(
    records: Sequence[CollectiveRecord], message_bytes: float, ratio: float
) -> SizeJudgement | None:
    """Whether `message_bytes` is below `ratio x alpha x beta` of the records' fit, and in what
    share of bootstrap resamples (`SizeJudgement`); None without usable sizes.

    The fit is fitted to the fastest execution per size, and that minimum is the noisy part: a
    size with few executions may never have run at its true cost. Each resample draws every
    size's executions again (the minimum of n draws with replacement is the k-th fastest with
    probability ((n-k+1)/n)^n - ((n-k)/n)^n, drawn directly) and refits.
    """
    env = _envelope(records)
    if not env:
        return None
    sizes = np.array(list(env), dtype=np.float64)
    samples = list(env.values())
    fit = _fit_points(sizes, np.array([d[0] for d in samples]))
    n_exec = sum(len(d) for d in samples)
    flat = ratio * fit.half_bandwidth_bytes
    if len(sizes) < 2:
        return SizeJudgement(fit, message_bytes, ratio, None, flat, flat, n_exec)
    rng = np.random.default_rng(0)
    counts = np.array([len(d) for d in samples], dtype=np.float64)
    u = rng.random((RESAMPLES, len(samples)))
    ranks = np.minimum(np.floor(counts * (1.0 - u ** (1.0 / counts))), counts - 1).astype(int)
    flats = np.empty(RESAMPLES)
    for b in range(RESAMPLES):
        times = np.array([d[k] for d, k in zip(samples, ranks[b], strict=True)])
        flats[b] = ratio * _fit_points(sizes, times).half_bandwidth_bytes
    low, high = np.percentile(flats, [5, 95])
    share = float(np.mean(message_bytes < flats))
    return SizeJudgement(fit, message_bytes, ratio, share, float(low), float(high), n_exec)
