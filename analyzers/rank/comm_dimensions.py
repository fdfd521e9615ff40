"""A rank's communication per step, split by mesh dimension (`StepBreakdown.comm_by_dimension`).

Each collective belongs to the dimension of its process group, read from the trace header
(`distributedInfo.pg_config`, `declared_groups.py`): a DeviceMesh group's description is
"mesh_<dim>" (-> "<dim>"), the default group's "default_pg" (-> "world"), a user's group keeps
its description ("undefined", torch's default, -> "group <name>"); a call whose group is not
declared, or names none on a rank of several groups of different members, is "other".

The breakdown's communication set (`breakdown.ActivitySets`) also holds comm events that are not
collectives of the table: on host-only runs, the training thread's own comm ops (issuing a
collective, `wait_tensor`), whose group the trace does not say. Each takes the dimension of the
collective in flight whose end is nearest its own end (a wait ends when what it waits for
does), else "other". Then, cut at every boundary, each stretch of communication goes to the
dimensions active in it, split equally between them when several are: the dimensions' shares
add up to the step's `comm_ms`, and those outside compute to its `exposed_comm_ms`.

Only a rank whose collectives span two dimensions or more besides "other", or one and "other"
on a DeviceMesh of two dimensions or more, gets the split (`is_split`): single-group runs are
left as they were, and so is a rank whose calls mostly name no group among groups of different
members, outside a mesh (a vLLM trace: custom all-reduces naming none, one NCCL all-gather on an
"undefined" group), where the split would say nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from ..inputs.events import Collectives, RankTrace
from ..report import DimensionComm, StepBreakdown
from . import intervals as iv
from .breakdown import US_PER_MS, ActivitySets
from .collective_table import collectives_of
from .declared_groups import ProcessGroupInfo, trace_groups
from .steps import StepWindows

OTHER = "other"
WORLD = "world"


def dimension_label(info: ProcessGroupInfo) -> str:
    """The dimension label of a declared group (see the module docstring)."""
    desc = info.description
    if desc.startswith("mesh_") and len(desc) > len("mesh_"):
        return desc[len("mesh_") :]
    if desc == "default_pg":
        return WORLD
    if desc and desc != "undefined":
        return desc
    return f"group {info.name}"


def dimension_labels(infos: Sequence[ProcessGroupInfo], names: Sequence[str]) -> list[str]:
    """Per process-group name of a rank's calls, its dimension label. "" (the call names no
    group) is the rank's one group when all its declared groups have the same members (the
    default group's label first), else "other"."""
    by_name: dict[str, str] = {}
    for info in infos:
        by_name.setdefault(info.name, dimension_label(info))
    members = {tuple(i.ranks) for i in infos if i.ranks is not None}
    unnamed = OTHER
    if len(members) == 1 and infos:
        default = next((i for i in infos if i.description == "default_pg"), infos[0])
        unnamed = dimension_label(default)
    return [by_name.get(n, OTHER) if n else unnamed for n in names]


def _event_labels(
    trace: RankTrace, col: Collectives, sets: ActivitySets, call_labels: Sequence[str]
) -> npt.NDArray[np.int64]:
    """Per event of `sets.comm_events`, the index (into `call_labels`' distinct labels + OTHER,
    in `_label_list` order) of its dimension (module docstring)."""
    labels = _label_list(call_labels)
    code_of = {lab: j for j, lab in enumerate(labels)}
    call_code = np.fromiter((code_of[lab] for lab in call_labels), np.int64, len(call_labels))
    events = sets.comm_events
    out = np.full(len(events), code_of[OTHER], dtype=np.int64)
    rows = np.asarray(col.event, dtype=np.int64)
    pos = {int(e): j for j, e in enumerate(rows.tolist())}
    start_c = trace.ts_us[rows]
    end_c = start_c + trace.dur_us[rows]
    by_end = np.argsort(end_c, kind="stable")
    ends_sorted = end_c[by_end]
    for k, e in enumerate(events.tolist()):
        j = pos.get(e)
        if j is not None:
            out[k] = call_code[j]
            continue
        s, t = float(trace.ts_us[e]), float(trace.ts_us[e] + trace.dur_us[e])
        best = _nearest_end_in_flight(ends_sorted, by_end, start_c, s, t)
        if best is not None:
            out[k] = call_code[best]
    return out


def _nearest_end_in_flight(
    ends_sorted: npt.NDArray[np.float64],
    by_end: npt.NDArray[np.int64],
    starts: npt.NDArray[np.float64],
    s: float,
    t: float,
) -> int | None:
    """The collective overlapping [s, t) whose end is nearest t (the latest ending by t, else
    the first ending after it), None when none overlaps."""
    i = int(np.searchsorted(ends_sorted, t, side="right"))
    candidates = []
    if i > 0 and ends_sorted[i - 1] > s and starts[by_end[i - 1]] < t:
        candidates.append((t - ends_sorted[i - 1], int(by_end[i - 1])))
    if i < len(ends_sorted) and starts[by_end[i]] < t:
        candidates.append((ends_sorted[i] - t, int(by_end[i])))
    return min(candidates)[1] if candidates else None


def _label_list(call_labels: Sequence[str]) -> list[str]:
    """The distinct labels of the calls in first-seen order, then OTHER (when not among them)."""
    seen = list(dict.fromkeys(call_labels))
    return seen if OTHER in seen else [*seen, OTHER]


def is_split(infos: Sequence[ProcessGroupInfo], call_labels: Sequence[str]) -> bool:
    """Whether a rank's calls are split by dimension: they span two dimensions or more besides
    "other", or, on a rank of a DeviceMesh of two dimensions or more (its groups' descriptions
    name them), a dimension and "other" (gloo's point-to-point calls of a pipeline run on the
    calling thread, so the thread map cannot say their group)."""
    labels = set(call_labels)
    mesh_dims = {i.description for i in infos if i.description.startswith("mesh_")}
    return len(labels - {OTHER}) >= 2 or (len(labels) >= 2 and len(mesh_dims) >= 2)


def with_comm_by_dimension(
    trace: RankTrace, windows: StepWindows, sets: ActivitySets, steps: Sequence[StepBreakdown]
) -> list[StepBreakdown]:
    """`steps` with `comm_by_dimension` set, when the rank's collectives are split (`is_split`);
    else `steps` as they are."""
    col = collectives_of(trace)
    infos = trace_groups(trace)
    call_labels = dimension_labels(infos, col.process_group)
    if not is_split(infos, call_labels) or not len(windows) or len(steps) != len(windows):
        return list(steps)
    labels = _label_list(call_labels)
    codes = _event_labels(trace, col, sets, call_labels)
    comm, exposed = _shares(trace, windows, sets, codes, len(labels))
    starts = windows.index_of(trace.ts_us[np.asarray(col.event, dtype=np.int64)])
    code_of = {lab: j for j, lab in enumerate(labels)}
    call_code = np.fromiter((code_of[lab] for lab in call_labels), np.int64, len(call_labels))
    out = []
    for k, step in enumerate(steps):
        calls = np.bincount(call_code[starts == k], minlength=len(labels))
        dims = [
            DimensionComm(
                dimension=lab,
                comm_ms=round(float(comm[d, k]) / US_PER_MS, 6),
                exposed_comm_ms=round(float(exposed[d, k]) / US_PER_MS, 6),
                calls=int(calls[d]),
            )
            for d, lab in enumerate(labels)
            if comm[d, k] > 0 or calls[d] > 0 or lab != OTHER
        ]
        out.append(msgspec.structs.replace(step, comm_by_dimension=dims))
    return out


def _shares(
    trace: RankTrace,
    windows: StepWindows,
    sets: ActivitySets,
    codes: npt.NDArray[np.int64],
    n_labels: int,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(comm, exposed) in µs per label and step window: elementary segments between every
    boundary of the labels' unions, the compute set and the windows, each shared equally by the
    labels active in it."""
    ev = sets.comm_events
    unions = [
        iv.union(
            trace.ts_us[ev[codes == d]], trace.ts_us[ev[codes == d]] + trace.dur_us[ev[codes == d]]
        )
        for d in range(n_labels)
    ]
    pts = np.unique(
        np.concatenate(
            [a for u in unions for a in u]
            + [sets.compute[0], sets.compute[1], windows.start_us, windows.end_us]
        )
    )
    shape = (n_labels, len(windows))
    if len(pts) < 2:
        return np.zeros(shape), np.zeros(shape)
    lo, hi = pts[:-1], pts[1:]
    mid = (lo + hi) / 2
    active = np.array([iv.covers(u, mid) for u in unions], dtype=bool).reshape(n_labels, -1)
    count = active.sum(axis=0)
    window = windows.index_of(mid)
    keep = (count > 0) & (window >= 0)
    share = np.where(keep, (hi - lo) / np.maximum(count, 1), 0.0)
    outside = ~iv.covers(sets.compute, mid)
    comm = np.zeros(shape)
    exposed = np.zeros(shape)
    for d in range(n_labels):
        on = keep & active[d]
        comm[d] = np.bincount(window[on], weights=share[on], minlength=len(windows))
        off = on & outside
        exposed[d] = np.bincount(window[off], weights=share[off], minlength=len(windows))
    return comm, exposed
