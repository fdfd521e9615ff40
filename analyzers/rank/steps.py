"""Step segmentation: where each training step starts and ends on one rank.

Markers, in order of preference (the first that is present wins):

1. `ProfilerStep#N` ranges on the CPU (what `torch.profiler.profile(schedule=...)` + `prof.step()`
   records). Step number = N.
2. Optimizer-step annotations (`Optimizer.step#AdamW.step`, ...): a step ends where an
   optimizer step ends; the first window starts at the trace's first event. Numbered 0, 1, ...
3. Forward-start markers repeated at least twice (`FSDP::root_pre_forward`,
   `DistributedDataParallel.forward`, `## forward ##`): a step runs from one forward start to
   the next; the last one ends at the trace's last event. Numbered 0, 1, ...
4. None: one window (step 0) and a warning says so. On GPU runs the window is the device's
   active span (first device activity to last), so CUDA initialisation and teardown before the
   first and after the last kernel are left out; on host-only runs it is the whole trace.

Device windows (GPU runs). Kernels run after the CPU enqueued them, so a step's GPU work can
spill past its CPU range. Each device event is attributed to the step whose CPU range holds the
call that launched it (CUDA/HIP correlation id; the event's own start when there is none). Step
N's device window starts at b_N = min(first device start of N, max(CPU start of N, last device end
of N-1)) and ends where step N+1's begins (the last step ends at max(its CPU end, its last device
end)). Windows are contiguous and never overlap, so device time is counted once, and a host-bound
step (GPU idle while the CPU prepares) keeps its idle time. Host-only runs use the CPU ranges.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from zdiag.errors import InputError

from .. import frameworks
from ..inputs.events import DEVICE_KINDS, EventKind, RankTrace

_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
_OPTIMIZER_RE = r"^Optimizer\.step#"
# One label per forward pass: each framework's own (analyzers/frameworks/), then the plain
# record_function("## forward ##") a script may write.
_FORWARD_MARKERS = (*frameworks.forward_markers(), r"^## forward ##$")

Arr = npt.NDArray[np.float64]


@dataclass
class StepWindows:
    """One rank's steps: step number and [start_us, end_us) on the trace clock.

    `source` says how the steps were found: "ProfilerStep", "optimizer step",
    "step log", or "whole trace" (no step markers: one window with a warning).
    `cpu_start_us`/`cpu_end_us` are the host-side marker spans; `start_us`/`end_us` are the
    windows used for the device breakdown (see steps.py for how GPU lag is handled).
    """

    step: npt.NDArray[np.int64]
    start_us: npt.NDArray[np.float64]
    end_us: npt.NDArray[np.float64]
    cpu_start_us: npt.NDArray[np.float64]
    cpu_end_us: npt.NDArray[np.float64]
    source: str

    def __len__(self) -> int:
        return len(self.step)

    def index_of(self, ts_us: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
        """For each time, the index of the window holding it, or -1 when none does."""
        pos = np.searchsorted(self.start_us, ts_us, side="right") - 1
        ok = (pos >= 0) & (ts_us < self.end_us[np.clip(pos, 0, None)])
        return np.where(ok, pos, -1)


def find_steps(trace: RankTrace) -> tuple[StepWindows, list[str]]:
    """The step windows of one rank (see the module docstring) and the warnings saying how they
    were found when not from `ProfilerStep` markers."""
    warnings: list[str] = []
    n = len(trace)
    if n == 0:
        warnings.append("the trace holds no complete events: nothing to analyze")
        z = np.zeros(0)
        return StepWindows(np.zeros(0, np.int64), z, z, z, z, "none"), warnings
    first = float(trace.ts_us.min())
    last = float(trace.end_us.max())

    numbers, cpu_s, cpu_e, source = _profiler_steps(trace)
    if not len(numbers):
        numbers, cpu_s, cpu_e, source = _optimizer_steps(trace, first)
    if not len(numbers):
        numbers, cpu_s, cpu_e, source = _forward_steps(trace, last)
    if not len(numbers):
        warnings.append(
            "no step markers (ProfilerStep#N, Optimizer.step#..., forward markers): the whole trace "
            "is analyzed as one window; record with torch.profiler's schedule and call prof.step() "
            "each iteration to get per-step results"
        )
        numbers = np.zeros(1, np.int64)
        cpu_s, cpu_e, source = np.array([first]), np.array([last]), "whole trace"
    if source == "optimizer step":
        warnings.append(
            "no ProfilerStep markers: steps are delimited by optimizer-step annotations "
            "(the first window starts at the first event)"
        )
    elif source == "forward marker":
        warnings.append(
            "no ProfilerStep or optimizer-step markers: steps run from one forward start to the next"
        )
    if source == "whole trace":
        dev = trace.of_kind(*DEVICE_KINDS)
        if len(dev):  # GPU runs: the device's active span (skips CUDA init, teardown)
            start = np.array([float(trace.ts_us[dev].min())])
            end = np.array([float((trace.ts_us[dev] + trace.dur_us[dev]).max())])
        else:
            start, end = np.array([first]), np.array([last])
    else:
        start, end = device_windows(trace, cpu_s, cpu_e)
    return StepWindows(numbers, start, end, cpu_s, cpu_e, source), warnings


def _profiler_steps(trace: RankTrace) -> tuple[npt.NDArray[np.int64], Arr, Arr, str]:
    idx = trace.of_kind(EventKind.PROFILER_STEP)
    by_step: dict[int, tuple[float, float]] = {}
    for i in idx:
        m = _STEP_RE.match(trace.name(int(i)))
        if not m:
            continue
        k = int(m.group(1))
        if k > 2**63 - 1:  # damaged: no run has that many steps (and numpy holds 64 bits)
            raise InputError(
                f"{trace.source}: a step is named {trace.name(int(i))[:60]!r}, a number beyond "
                "any 64-bit integer, so the trace is damaged; re-export it or fix that event."
            )
        s = float(trace.ts_us[i])
        e = s + float(trace.dur_us[i])
        if k in by_step:  # the same step on several threads: keep the widest range
            s0, e0 = by_step[k]
            s, e = min(s, s0), max(e, e0)
        by_step[k] = (s, e)
    return _sorted_windows(by_step, "ProfilerStep")


def _optimizer_steps(trace: RankTrace, first: float) -> tuple[npt.NDArray[np.int64], Arr, Arr, str]:
    idx = trace.matching(_OPTIMIZER_RE)
    idx = idx[np.isin(trace.kind[idx], [int(EventKind.USER_ANNOTATION), int(EventKind.CPU_OP)])]
    if not len(idx):
        return _sorted_windows({}, "")
    ends = np.unique(trace.ts_us[idx] + trace.dur_us[idx])
    starts = np.concatenate([[first], ends[:-1]])
    return np.arange(len(ends), dtype=np.int64), starts, ends, "optimizer step"


def _forward_steps(trace: RankTrace, last: float) -> tuple[npt.NDArray[np.int64], Arr, Arr, str]:
    for pattern in _FORWARD_MARKERS:
        idx = trace.matching(pattern)
        idx = idx[~np.isin(trace.kind[idx], [int(EventKind.GPU_ANNOTATION)])]
        if len(idx) >= 2:
            starts = np.unique(trace.ts_us[idx])
            ends = np.concatenate([starts[1:], [last]])
            return np.arange(len(starts), dtype=np.int64), starts, ends, "forward marker"
    return _sorted_windows({}, "")


def _sorted_windows(
    by_step: dict[int, tuple[float, float]], source: str
) -> tuple[npt.NDArray[np.int64], Arr, Arr, str]:
    if not by_step:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0), source
    items = sorted(by_step.items(), key=lambda kv: kv[1][0])
    numbers = np.array([k for k, _ in items], dtype=np.int64)
    s = np.array([v[0] for _, v in items])
    e = np.array([v[1] for _, v in items])
    return numbers, s, e, source


def launch_times(trace: RankTrace, device_idx: npt.NDArray[np.int64]) -> Arr:
    """For device events, the start of the host call that launched them (own start if unknown)."""
    calls = trace.launch_calls(device_idx)
    own = trace.ts_us[device_idx]
    return np.where(calls >= 0, trace.ts_us[np.maximum(calls, 0)], own)


def device_windows(trace: RankTrace, cpu_s: Arr, cpu_e: Arr) -> tuple[Arr, Arr]:
    """Device-side windows from CPU step ranges (see the module docstring)."""
    dev = trace.of_kind(*DEVICE_KINDS)
    if not len(dev):
        return cpu_s.copy(), cpu_e.copy()
    launch = launch_times(trace, dev)
    k = len(cpu_s)
    step_of = np.searchsorted(cpu_s, launch, side="right") - 1
    inside = (step_of >= 0) & (launch < cpu_e[np.clip(step_of, 0, None)])
    step_of, d = step_of[inside], dev[inside]
    first_dev = np.full(k, np.inf)
    last_dev = np.full(k, -np.inf)
    np.minimum.at(first_dev, step_of, trace.ts_us[d])
    np.maximum.at(last_dev, step_of, trace.ts_us[d] + trace.dur_us[d])
    start = cpu_s.copy()
    prev_end = np.concatenate([[-np.inf], last_dev[:-1]])
    start = np.minimum(first_dev, np.maximum(cpu_s, prev_end))
    start = np.maximum.accumulate(start)
    end = np.empty(k)
    end[:-1] = start[1:]
    end[-1] = max(float(cpu_e[-1]), float(last_dev[-1]))
    return start, end


def drop_unfinished_tail(windows: StepWindows, completed: int) -> tuple[StepWindows, list[int]]:
    """Leave out the trailing `ProfilerStep` windows numbered `completed` or more.

    `completed` is how many steps the rank finished (`zdiag run`'s manifest `steps`, which
    numbers ProfilerStep#N as step N). When a run ends inside the profiler window, the profiler
    stops inside a step that never reached its optimizer step: the script's teardown (a barrier,
    destroying the process group), not training. Returns the kept windows and the dropped step
    numbers; nothing is dropped unless at least one window stays.
    """
    if windows.source != "ProfilerStep" or completed <= 0:
        return windows, []
    keep = windows.step < completed
    first_dropped = int(np.argmin(keep)) if not keep.all() else len(keep)
    if first_dropped == 0 or keep[first_dropped:].any():  # all dropped, or not only a tail
        return windows, []
    dropped = windows.step[first_dropped:].tolist()
    cut = slice(0, first_dropped)
    return (
        StepWindows(
            windows.step[cut],
            windows.start_us[cut],
            windows.end_us[cut],
            windows.cpu_start_us[cut],
            windows.cpu_end_us[cut],
            windows.source,
        ),
        dropped,
    )
