"""The sections of a run diff, each from the two Reports alone (no trace is read again).

Per-step samples: a metric's value in one step is its mean over the ranks that ran the step.
Per-rank-and-step figures (units, collectives, operators) divide a rank's totals by its steps,
then average over ranks, so runs of different lengths compare.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from msgspec import UNSET

from ..report import Report, StepBreakdown
from .model import (
    CollectiveDelta,
    ConfigChange,
    Delta,
    FindingChange,
    GroupDelta,
    MemoryDelta,
    RankDelta,
    Share,
    UnitDelta,
)
from .spread import delta

Metric = Callable[[StepBreakdown], float]

BREAKDOWN: tuple[tuple[str, Metric], ...] = (
    ("step time", lambda s: s.duration_ms),
    ("compute", lambda s: s.compute_ms),
    ("comm", lambda s: s.comm_ms),
    ("exposed comm", lambda s: s.exposed_comm_ms),
    ("idle", lambda s: s.idle_ms),
    ("memcpy", lambda s: s.memcpy_ms),
)
"""The breakdown metrics, step time first; compute + exposed comm + memcpy + idle = step time."""

PARTS = ("compute", "exposed comm", "memcpy", "idle")


def dimensions(*reports: Report) -> list[str]:
    """The mesh dimensions either run split its communication by (empty for 1-D runs)."""
    dims: set[str] = set()
    for r in reports:
        for rank in r.ranks:
            for s in rank.steps:
                if s.comm_by_dimension is not UNSET:
                    dims.update(d.dimension for d in s.comm_by_dimension)
    return sorted(dims) if len(dims) > 1 else []


def _exposed_in(dim: str) -> Metric:
    def metric(s: StepBreakdown) -> float:
        if s.comm_by_dimension is UNSET:
            return 0.0
        return sum(d.exposed_comm_ms for d in s.comm_by_dimension if d.dimension == dim)

    return metric


def metrics(dims: list[str]) -> list[tuple[str, Metric]]:
    """The breakdown metrics, then exposed comm per mesh dimension."""
    return [*BREAKDOWN, *((f"exposed comm ({d})", _exposed_in(d)) for d in dims)]


def step_samples(report: Report, metric: Metric) -> list[float]:
    """One sample per step number: the metric's mean over the ranks that ran that step."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for rank in report.ranks:
        for s in rank.steps:
            by_step[s.step].append(metric(s))
    return [sum(v) / len(v) for _, v in sorted(by_step.items())]


def steps_per_rank(report: Report) -> int:
    """The fewest steps any rank analyzed (0 without ranks)."""
    return min((len(r.steps) for r in report.ranks), default=0)


def run_deltas(a: Report, b: Report, dims: list[str]) -> list[Delta]:
    """The run's breakdown in A and B, per step."""
    return [delta(name, step_samples(a, m), step_samples(b, m)) for name, m in metrics(dims)]


def rank_deltas(a: Report, b: Report, dims: list[str]) -> list[RankDelta]:
    """Each rank present in both runs: its own breakdown in A and B."""
    b_ranks = {r.rank: r for r in b.ranks}
    out = []
    for ra in a.ranks:
        rb = b_ranks.get(ra.rank)
        if rb is None:
            continue
        out.append(
            RankDelta(
                rank=ra.rank,
                metrics=[
                    delta(name, [m(s) for s in ra.steps], [m(s) for s in rb.steps])
                    for name, m in metrics(dims)
                ],
            )
        )
    return out


def _mean(samples: list[float]) -> float:
    return sum(samples) / len(samples) if samples else 0.0


def shares(a: Report, b: Report, dims: list[str]) -> list[Share]:
    """The mean step-time change split into its parts (the parts add up to it exactly); exposed
    comm is split by mesh dimension when the runs name more than one."""
    total = _mean(step_samples(b, BREAKDOWN[0][1])) - _mean(step_samples(a, BREAKDOWN[0][1]))
    named = dict(BREAKDOWN)
    parts: list[tuple[str, Metric]] = [(p, named[p]) for p in PARTS]
    if dims:
        parts = [p for p in parts if p[0] != "exposed comm"]
        parts += [(f"exposed comm ({d})", _exposed_in(d)) for d in dims]
        parts.append(
            (
                "exposed comm (other)",
                lambda s: s.exposed_comm_ms - sum(_exposed_in(d)(s) for d in dims),
            )
        )
    out = []
    for name, m in parts:
        d = _mean(step_samples(b, m)) - _mean(step_samples(a, m))
        out.append(
            Share(
                component=name,
                delta_ms=round(d, 4) + 0.0,  # no -0.0
                share=round(d / total, 4) + 0.0 if abs(total) > 1e-9 else 0.0,
            )
        )
    return [s for s in out if abs(s.delta_ms) > 1e-6 or s.component in PARTS]


def _per_rank(report: Report, total: Callable[[Any], float]) -> list[float]:
    """One sample per rank: a per-trace total divided by the rank's steps."""
    return [total(r) / max(len(r.steps), 1) for r in report.ranks if r.steps]


def idle_causes(a: Report, b: Report) -> list[Delta]:
    """What the traces measured of the host's own waits, per step: time in kernel-launch calls
    (per-step samples), the DataLoader's `next()` ms and host syncs (per-rank samples: the
    trace's totals over its steps). Only the causes either run shows."""
    out = [
        delta("host launch ms", step_samples(a, lambda s: s.host_launch_ms),
              step_samples(b, lambda s: s.host_launch_ms)),
        delta("data loading ms", _per_rank(a, lambda r: r.data_loading_ms),
              _per_rank(b, lambda r: r.data_loading_ms)),
        delta("host syncs", _per_rank(a, lambda r: float(r.host_syncs)),
              _per_rank(b, lambda r: float(r.host_syncs))),
    ]  # fmt: skip
    return [d for d in out if d.a or d.b]


def _steps_of(report: Report) -> dict[int, int]:
    return {r.rank: max(len(r.steps), 1) for r in report.ranks}


def _per_rank_step(
    rows: Iterable[tuple[str, int, tuple[float, ...]]], steps: dict[int, int]
) -> dict[str, tuple[float, ...]]:
    """{key: each value per step, averaged over the ranks that have the key} from per-rank
    totals (a unit or kind only some ranks run is not diluted by the others)."""
    acc: dict[str, list[float]] = {}
    holders: dict[str, set[int]] = defaultdict(set)
    for key, rank, values in rows:
        slot = acc.setdefault(key, [0.0] * len(values))
        holders[key].add(rank)
        per = steps.get(rank, 1)
        for i, v in enumerate(values):
            slot[i] += v / per
    return {k: tuple(v / len(holders[k]) for v in vals) for k, vals in acc.items()}


def unit_deltas(a: Report, b: Report) -> list[UnitDelta]:
    """FSDP units in A and B, the largest exposed-wait change first."""

    def table(r: Report) -> dict[str, tuple[float, ...]]:
        rows = (
            (
                u.name,
                u.rank,
                (u.all_gather_ms, u.reduce_ms, u.exposed_wait_ms, float(u.all_gather_bytes)),
            )
            for u in r.fsdp_units
        )
        return _per_rank_step(rows, _steps_of(r))

    ta, tb = table(a), table(b)
    zero = (0.0, 0.0, 0.0, 0.0)
    out = []
    for name in sorted(set(ta) | set(tb)):
        va, vb = ta.get(name, zero), tb.get(name, zero)
        out.append(
            UnitDelta(
                unit=name,
                gather_ms_a=round(va[0], 4),
                gather_ms_b=round(vb[0], 4),
                reduce_ms_a=round(va[1], 4),
                reduce_ms_b=round(vb[1], 4),
                exposed_wait_ms_a=round(va[2], 4),
                exposed_wait_ms_b=round(vb[2], 4),
                gathered_bytes_a=round(va[3]),
                gathered_bytes_b=round(vb[3]),
                only_in="" if name in ta and name in tb else ("A" if name in ta else "B"),
            )
        )
    out.sort(key=lambda u: -abs(u.exposed_wait_ms_b - u.exposed_wait_ms_a))
    return out


def _gbps(nbytes: float, ms: float) -> float | None:
    return round(nbytes / ms / 1e6, 3) if ms > 0 and nbytes > 0 else None


def collective_deltas(a: Report, b: Report) -> list[CollectiveDelta]:
    """Collectives by kind in A and B, the largest time change first."""

    def table(r: Report) -> dict[str, tuple[float, ...]]:
        rows = (
            (c.kind, c.rank, (float(c.count), float(c.total_bytes), c.total_ms, c.exposed_ms))
            for c in r.collectives
        )
        return _per_rank_step(rows, _steps_of(r))

    ta, tb = table(a), table(b)
    zero = (0.0, 0.0, 0.0, 0.0)
    out = []
    for kind in sorted(set(ta) | set(tb)):
        va, vb = ta.get(kind, zero), tb.get(kind, zero)
        out.append(
            CollectiveDelta(
                kind=kind,
                count_a=round(va[0], 3),
                count_b=round(vb[0], 3),
                bytes_a=round(va[1]),
                bytes_b=round(vb[1]),
                ms_a=round(va[2], 4),
                ms_b=round(vb[2], 4),
                exposed_ms_a=round(va[3], 4),
                exposed_ms_b=round(vb[3], 4),
                gbps_a=_gbps(va[1], va[2]),
                gbps_b=_gbps(vb[1], vb[2]),
            )
        )
    out.sort(key=lambda c: -abs(c.ms_b - c.ms_a))
    return out


def group_deltas(a: Report, b: Report) -> list[GroupDelta]:
    """Process-group instances (matched by description and members) in A and B, the largest
    communication change first."""

    def table(r: Report) -> dict[tuple[str, tuple[int, ...]], Any]:
        return {(g.description or g.name, tuple(g.ranks)): g for g in r.process_groups}

    ta, tb = table(a), table(b)
    out = []
    for key in sorted(set(ta) | set(tb)):
        ga, gb = ta.get(key), tb.get(key)
        out.append(
            GroupDelta(
                group=key[0],
                ranks=list(key[1]),
                comm_ms_a=ga.comm_ms_per_step if ga else None,
                comm_ms_b=gb.comm_ms_per_step if gb else None,
                median_skew_ms_a=ga.median_skew_ms if ga else None,
                median_skew_ms_b=gb.median_skew_ms if gb else None,
                wait_caused_ms_a=ga.wait_caused_ms if ga else None,
                wait_caused_ms_b=gb.wait_caused_ms if gb else None,
            )
        )
    out.sort(key=lambda g: -abs((g.comm_ms_b or 0.0) - (g.comm_ms_a or 0.0)))
    return out


def peak_memory(report: Report) -> dict[str, int]:
    """Peak bytes by category ("total" for the whole), the largest over ranks: the memory
    timelines first, else the snapshots' and memory events' breakdowns."""
    out: dict[str, int] = {}
    sources: list[tuple[int | None, dict[str, int]]] = [
        (m.peak_bytes, m.peak_category_bytes) for m in report.memory
    ]
    if not sources:
        sources = [(b.peak_bytes, b.peak_category_bytes) for b in report.memory_breakdowns]
    for total, categories in sources:
        if total:
            out["total"] = max(out.get("total", 0), total)
        for cat, n in categories.items():
            out[cat] = max(out.get(cat, 0), n)
    return out


def memory_deltas(a: Report, b: Report) -> list[MemoryDelta]:
    """Peak memory by category in A and B ("total" first), when either run recorded memory."""
    pa, pb = peak_memory(a), peak_memory(b)
    keys = sorted(set(pa) | set(pb), key=lambda k: (k != "total", k))
    return [MemoryDelta(category=k, a_bytes=pa.get(k), b_bytes=pb.get(k)) for k in keys]


def finding_changes(a: Report, b: Report) -> list[FindingChange]:
    """Findings raised in one run only (by id), the worst first."""
    from ..report import SEVERITY_ORDER

    ids_a = {f.id for f in a.findings}
    ids_b = {f.id for f in b.findings}
    out = [
        FindingChange(id=f.id, severity=f.severity, title=f.title, change="appeared")
        for f in b.findings
        if f.id not in ids_a
    ] + [
        FindingChange(id=f.id, severity=f.severity, title=f.title, change="gone")
        for f in a.findings
        if f.id not in ids_b
    ]
    seen: set[tuple[str, str]] = set()
    unique = []
    for c in sorted(out, key=lambda c: (c.change, -SEVERITY_ORDER[c.severity])):
        if (c.id, c.change) not in seen:
            seen.add((c.id, c.change))
            unique.append(c)
    return unique


def config_of(report: Report) -> dict[str, Any]:
    """The run's configuration table: what every trace says (device kind, ranks, world size),
    completed by `Report.run["config"]` (what the run recorded)."""
    run = report.run or {}
    out: dict[str, Any] = {}
    devices = sorted({r.device for r in report.ranks if r.device != "unknown"})
    if devices:
        out["device"] = ", ".join(devices)
    gpus = sorted({r.device_name for r in report.ranks if r.device_name})
    if gpus:
        out["gpu"] = ", ".join(gpus)
    if run.get("world_size"):
        out["world size"] = run["world_size"]
    if run.get("backend"):
        out["backend"] = run["backend"]
    out["ranks analyzed"] = len(report.ranks)
    config = run.get("config")
    if isinstance(config, dict):
        out.update(config)
    return out


def config_changes(ca: dict[str, Any], cb: dict[str, Any]) -> list[ConfigChange]:
    """Configuration keys whose values differ between two tables (`config_of`), in A's key
    order then B's new keys."""
    keys = list(ca) + [k for k in cb if k not in ca]
    return [ConfigChange(key=k, a=ca.get(k), b=cb.get(k)) for k in keys if ca.get(k) != cb.get(k)]
