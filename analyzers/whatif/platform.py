"""The platform model: what overlaps what on this run, and what a collective costs.

Overlap. On GPUs, NCCL/RCCL collectives run on their own streams, so a gather issued ahead of
its use runs under the compute kernels. On CPU/gloo, FSDP1's and FSDP2's default all-gathers
block the training thread: a prefetch setting moves them, it does not hide them. They overlap
only when the unshard runs as an async op (FSDP2 `_set_unshard_async_op(True)`) or the framework
issues them as async ops (DeepSpeed ZeRO-3), when gloo's worker thread runs them. The run's
captured configuration says which; without it, the trace does: gathers that the measured
timeline hid (at least OVERLAP_EVIDENCE_SHARE of their time under compute) can overlap.

Cost. Per comm lane (process group and kind), `dur = alpha + bytes / bandwidth`, fitted on the
run's own calls: the lower quartile of the durations at each message size (the fastest calls
wait least for peers), then least squares over the sizes (a negative intercept: no latency;
no growth with size: the fastest size's time as the latency and the line through the largest
size's point). With fewer than two sizes apart by at least SIZE_SPREAD the latency cannot be
told from the bandwidth: alpha is 0 and the fit says so. `error` is the median relative error of the fit over every call it covers.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec
import numpy as np

from ..rank.step_model import ModelOp, StepModel

OVERLAP_EVIDENCE_SHARE = 0.25
"""A CPU run's gathers can overlap when at least this share of their time was hidden."""

SIZE_SPREAD = 1.5
"""Message sizes must span at least this factor for the fit to separate latency from bandwidth."""


@dataclass(frozen=True)
class Platform:
    """Whether FSDP gathers can overlap compute on this run, and why."""

    device: str
    gathers_overlap: bool
    reason: str


def gather_hidden_share(models: Iterable[StepModel]) -> float | None:
    """Share of the FSDP all-gather time the measured timeline hid (None: no gathers)."""
    total = waited = 0.0
    for m in models:
        for op in m.ops:
            if op.family == "all_gather" and op.dur_us > 0:
                total += op.dur_us
                waited += min(op.waited_us, op.dur_us)
    return None if total <= 0 else 1.0 - waited / total


def platform_of(
    device: str,
    models: Iterable[StepModel],
    *,
    framework: str | None = None,
    unshard_async_op: bool | None = None,
    overlap: tuple[bool, str] | None = None,
) -> Platform:
    """The platform model of a run (see the module docstring); `overlap` (whether gathers can
    overlap, and why) is the caller's judgement when it has one (the detectors' fact sheet)."""
    if overlap is not None:
        return Platform(device, overlap[0], overlap[1])
    if device in ("cuda", "rocm"):
        return Platform(device, True, "GPU: collectives run on their own streams")
    if framework == "deepspeed":
        return Platform(device, True, "CPU/gloo: ZeRO-3 issues its gathers as async ops")
    if unshard_async_op:
        return Platform(device, True, "CPU/gloo: the run sets FSDP2's unshard async op")
    hidden = gather_hidden_share(models)
    if hidden is not None and hidden >= OVERLAP_EVIDENCE_SHARE:
        return Platform(
            device, True, f"CPU/gloo: the trace hid {hidden:.0%} of the gather time under compute"
        )
    why = "blocking all-gathers run on the training thread"
    if unshard_async_op is False:
        why += " (the run does not set the unshard async op)"
    return Platform(device, False, f"CPU/gloo: {why}")


@dataclass(frozen=True)
class CommFit:
    """`dur = alpha_us + bytes / bytes_per_us` on one comm lane, and how well it fits."""

    lane: str
    alpha_us: float
    bytes_per_us: float
    calls: int
    sizes: int
    error: float  # median |fit - measured| / measured over the calls
    latency_known: bool  # False: one message size, alpha set to 0

    def duration_us(self, nbytes: int) -> float:
        """The fitted duration of a call of `nbytes`."""
        return self.alpha_us + max(nbytes, 0) / self.bytes_per_us


def fit_comm(models: Iterable[StepModel]) -> dict[str, CommFit]:
    """One fit per comm lane whose calls carry message sizes (see the module docstring)."""
    by_lane: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for m in models:
        for op in m.ops:
            if op.bytes > 0 and op.dur_us > 0:
                by_lane[op.lane][op.bytes].append(op.dur_us)
    out: dict[str, CommFit] = {}
    for lane, sizes in by_lane.items():
        xs = np.array(sorted(sizes), dtype=np.float64)
        ys = np.array([float(np.percentile(sizes[int(x)], 25)) for x in xs])
        alpha, per_byte = 0.0, float(np.median(ys / xs))
        known = bool(len(xs) >= 2 and xs[-1] / xs[0] >= SIZE_SPREAD)
        if known:
            slope, intercept = np.polyfit(xs, ys, 1)
            if slope > 0 and intercept >= 0:
                alpha, per_byte = float(intercept), float(slope)
            elif slope > 0:
                per_byte = float(slope)
            else:  # no growth with size seen: the fastest call's latency, and the line to
                # the largest size's point (never cheaper per byte than that call)
                alpha = float(ys.min())
                per_byte = max(float(ys[-1]) - alpha, 0.0) / float(xs[-1]) or 1e-12
        fit = CommFit(lane, alpha, 1.0 / per_byte, 0, len(xs), 0.0, known)
        errs = [abs(fit.duration_us(b) - d) / d for b, ds in sizes.items() for d in ds if d > 0]
        out[lane] = CommFit(
            lane,
            alpha,
            1.0 / per_byte,
            sum(len(ds) for ds in sizes.values()),
            len(xs),
            statistics.median(errs) if errs else 0.0,
            known,
        )
    return out


def latency_part(op: ModelOp, fits: Mapping[str, CommFit]) -> float:
    """The part of a call's measured duration that is its lane's fitted latency (at most the
    whole call; 0 without a fit, or where one message size left the latency unknown)."""
    fit = fits.get(op.lane)
    return min(fit.alpha_us, op.dur_us) if fit is not None else 0.0


def with_bytes_share(op: ModelOp, share: float, fits: Mapping[str, CommFit]) -> ModelOp:
    """`op` carrying `share` of its bytes: its lane's latency plus that share of the rest."""
    alpha = latency_part(op, fits)
    return msgspec.structs.replace(
        op,
        dur_us=alpha + (op.dur_us - alpha) * share,
        bytes=int(op.bytes * share) if op.bytes > 0 else op.bytes,
    )


@dataclass(frozen=True)
class OverheadFit:
    """Per FSDP unit and step, the progress spent in the unit's own ranges (hooks, copy-in and
    copy-out; CPU traces): `c0_us + us_per_byte * gathered bytes`, fitted over the run's units."""

    c0_us: float
    us_per_byte: float
    units: int
    error: float  # median relative error over the units
    sizes: int = 1  # distinct unit sizes seen: with one, the fixed cost is not told from bytes

    def overhead_us(self, nbytes: int) -> float:
        """The fitted per-step overhead of a unit gathering `nbytes`."""
        return self.c0_us + self.us_per_byte * max(nbytes, 0)


def fit_unit_overhead(models: Iterable[StepModel]) -> OverheadFit | None:
    """The overhead fit (None: fewer than two units with known sizes, or no unit ranges)."""
    xs: list[float] = []
    ys: list[float] = []
    for m in models:
        sizes: dict[str, int] = {}
        for op in m.ops:
            if op.family == "all_gather" and op.bytes > 0:
                sizes[op.unit] = max(sizes.get(op.unit, 0), op.bytes)
        spent: dict[str, float] = defaultdict(float)
        for _pos, length, unit in m.unit_chunks:
            spent[unit] += length
        for unit, us in spent.items():
            if unit in sizes:
                xs.append(float(sizes[unit]))
                ys.append(us)
    if len(xs) < 2:
        return None
    x, y = np.array(xs), np.array(ys)
    c0, slope = float(np.median(y)), 0.0
    if x.max() / max(x.min(), 1.0) >= SIZE_SPREAD:
        slope_fit, intercept = np.polyfit(x, y, 1)
        if slope_fit >= 0 and intercept >= 0:
            c0, slope = float(intercept), float(slope_fit)
        elif slope_fit >= 0:
            c0, slope = 0.0, float(np.median(y / np.maximum(x, 1.0)))
    fit = OverheadFit(c0, slope, len(xs), 0.0)
    errs = [abs(fit.overhead_us(int(a)) - b) / b for a, b in zip(xs, ys, strict=True) if b > 0]
    return OverheadFit(c0, slope, len(xs), statistics.median(errs) if errs else 0.0, len(set(xs)))
