"""The statistics every view shows, defined once: per rank, over the run, and the orderings.

`rank_stats` is the only place that summarizes a rank's steps (median/mean/min/max step time,
where the time went as shares of the step time, verdict counts); the text report, the TUI's
rank table and the HTML page all read it. `run_stats` does the same over every rank × step row.
Values, not strings: the renderers format them with `zdiag.render.format`.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from zdiag.analyzers.report import SEVERITY_ORDER, VERDICTS, Finding, Report, StepBreakdown


class RankView(Protocol):
    """What the view layer reads of one rank of a Report (the Report's per-rank class; the
    views name this protocol, not the class)."""

    @property
    def rank(self) -> int: ...
    @property
    def source(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def host(self) -> str | None: ...
    @property
    def trace_start_us(self) -> float: ...
    @property
    def steps(self) -> list[StepBreakdown]: ...
    @property
    def warnings(self) -> list[str]: ...
    @property
    def step_source(self) -> str: ...


R = TypeVar("R", bound=RankView)


@dataclass(frozen=True)
class RankStats:
    """One rank's steps summarized. Times in ms; shares are fractions of the summed step time."""

    rank: int
    step_count: int
    total_ms: float
    median_ms: float | None  # None: no steps
    mean_ms: float | None
    min_ms: float | None
    max_ms: float | None
    compute_share: float | None  # None: no step time to share
    comm_share: float | None
    exposed_comm_share: float | None
    memcpy_share: float | None
    idle_share: float | None
    overlapped_of_comm: float | None  # overlapped / comm; None without communication
    verdicts: tuple[tuple[str, int], ...]  # most common first

    @property
    def dominant_verdict(self) -> str:
        """The verdict most steps got ("" without steps)."""
        return self.verdicts[0][0] if self.verdicts else ""


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def rank_stats(rank: RankView) -> RankStats:
    """Summarize one rank's steps (see `RankStats`)."""
    steps = rank.steps
    durations = [s.duration_ms for s in steps]
    total = sum(durations)
    comm = sum(s.comm_ms for s in steps)

    def share(attr: str) -> float | None:
        return _share(sum(getattr(s, attr) for s in steps), total)

    return RankStats(
        rank=rank.rank,
        step_count=len(steps),
        total_ms=total,
        median_ms=statistics.median(durations) if durations else None,
        mean_ms=total / len(durations) if durations else None,
        min_ms=min(durations) if durations else None,
        max_ms=max(durations) if durations else None,
        compute_share=share("compute_ms"),
        comm_share=share("comm_ms"),
        exposed_comm_share=share("exposed_comm_ms"),
        memcpy_share=share("memcpy_ms"),
        idle_share=share("idle_ms"),
        overlapped_of_comm=_share(sum(s.overlapped_ms for s in steps), comm),
        verdicts=tuple(Counter(s.verdict for s in steps).most_common()),
    )


@dataclass(frozen=True)
class RunStats:
    """Every rank × step row of a Report summarized."""

    rank_count: int
    row_count: int  # rank × step rows
    mean_step_ms: float | None
    slowest_step_ms: float | None
    verdicts: tuple[tuple[str, int], ...]  # known verdicts in VERDICTS order, then others


def run_stats(report: Report) -> RunStats:
    """Summarize the whole Report's steps (see `RunStats`)."""
    durations = [s.duration_ms for r in report.ranks for s in r.steps]
    counts = Counter(s.verdict for r in report.ranks for s in r.steps)
    order = list(VERDICTS) + sorted(set(counts) - set(VERDICTS))
    return RunStats(
        rank_count=len(report.ranks),
        row_count=len(durations),
        mean_step_ms=sum(durations) / len(durations) if durations else None,
        slowest_step_ms=max(durations) if durations else None,
        verdicts=tuple((v, counts[v]) for v in order if counts[v]),
    )


def detailed_ranks(ranks: Sequence[R], limit: int) -> list[R]:
    """At most `limit` ranks worth showing in detail: the first one and the slowest by median
    step time, in rank order (all of them when there are at most `limit`)."""
    if len(ranks) <= limit:
        return list(ranks)
    first, rest = ranks[0], ranks[1:]

    def median(r: R) -> float:
        return rank_stats(r).median_ms or 0.0

    slowest = sorted(rest, key=lambda r: -median(r))[: limit - 1]
    return sorted([first, *slowest], key=lambda r: r.rank)


def worst_first(finding: Finding) -> tuple[int, float]:
    """Sort key for findings, worst first: severity, then expected gain (ms per step)."""
    return (-SEVERITY_ORDER.get(finding.severity, 0), -(finding.expected_gain_ms or 0.0))


def related_findings(report: Report, rank: int, step: int) -> list[Finding]:
    """The findings that concern one rank and step (a finding naming no ranks/steps concerns all)."""
    return [
        f
        for f in report.findings
        if (not f.ranks or rank in f.ranks) and (not f.steps or step in f.steps)
    ]


def by_gain(finding: Finding) -> tuple[int, float, int, float]:
    """Sort key for findings by what fixing them gains, largest first.

    Critical memory findings (an out-of-memory run has no step time to gain) come first, then
    expected gain in ms per step, then severity, then the memory gain.
    """
    memory_blocker = finding.severity == "critical" and finding.expected_gain_ms is None
    return (
        0 if memory_blocker else 1,
        -(finding.expected_gain_ms or 0.0),
        -SEVERITY_ORDER.get(finding.severity, 0),
        -float(finding.expected_gain_bytes or 0),
    )


@dataclass(frozen=True)
class RankGroup:
    """Ranks that share a dominant verdict, with the spread of their median step times (ms)."""

    verdict: str  # "" for ranks without steps
    ranks: tuple[int, ...]
    steps: int  # steps of these ranks in all
    verdict_steps: int  # of which with `verdict`
    median_ms_low: float | None
    median_ms_high: float | None
    compute_share: float | None  # of the group's summed step time
    exposed_comm_share: float | None
    idle_share: float | None


def rank_groups(ranks: Sequence[RankView]) -> list[RankGroup]:
    """Ranks grouped by their dominant verdict, the group with most ranks first."""
    members: dict[str, list[tuple[RankView, RankStats]]] = {}
    for r in ranks:
        stats = rank_stats(r)
        members.setdefault(stats.dominant_verdict, []).append((r, stats))
    groups = []
    for verdict, rows in members.items():
        medians = [s.median_ms for _, s in rows if s.median_ms is not None]
        steps = [step for r, _ in rows for step in r.steps]
        total = sum(s.duration_ms for s in steps)
        groups.append(
            RankGroup(
                verdict=verdict,
                ranks=tuple(sorted(r.rank for r, _ in rows)),
                steps=len(steps),
                verdict_steps=sum(1 for s in steps if s.verdict == verdict),
                median_ms_low=min(medians) if medians else None,
                median_ms_high=max(medians) if medians else None,
                compute_share=_share(sum(s.compute_ms for s in steps), total),
                exposed_comm_share=_share(sum(s.exposed_comm_ms for s in steps), total),
                idle_share=_share(sum(s.idle_ms for s in steps), total),
            )
        )
    return sorted(groups, key=lambda g: (-len(g.ranks), g.ranks))


# --- large runs (issue 16.4): distributions, outliers, nodes, a rank-group x step heatmap -----

LARGE_RUN_RANKS = 64
"""From this many ranks on, views summarize the ranks instead of listing each one."""
TOP_K = 5
"""Outlier ranks and nodes shown per list."""
HEATMAP_GROUPS = 16
"""A large run's ranks are shown in at most this many contiguous groups (text heatmap rows)."""
MAX_HEATMAP_STEPS = 40
"""Steps shown in the text heatmap (the first ones)."""
ROBUST_Z_SCALE = 1.4826
"""MAD x 1.4826 estimates the standard deviation of normally distributed values."""


@dataclass(frozen=True)
class Spread:
    """A distribution over ranks: min, median, p90, p99, max."""

    min: float
    p50: float
    p90: float
    p99: float
    max: float


@dataclass(frozen=True)
class Outlier:
    """A rank (or node) whose value stands out: the value, the run's median, the robust z
    ((value - median) / (1.4826 x MAD); None when the values do not vary)."""

    label: str
    rank: int | None
    host: str | None
    value_ms: float
    median_ms: float
    robust_z: float | None


@dataclass(frozen=True)
class NodeStats:
    """One host's ranks: count, their median step time and mean comm / exposed comm per step."""

    host: str
    ranks: tuple[int, ...]
    median_step_ms: float
    comm_ms: float
    exposed_comm_ms: float


@dataclass(frozen=True)
class HeatRow:
    """A group of contiguous ranks: per step (in `LargeRunStats.steps` order), the slowest
    rank's step time in the group (None: no rank of the group has that step)."""

    first_rank: int
    last_rank: int
    step_ms: tuple[float | None, ...]


@dataclass(frozen=True)
class LargeRunStats:
    """A large run summarized (see `large_run_stats`)."""

    rank_count: int
    steps: tuple[int, ...]
    step_ms: Spread | None  # over ranks: each rank's median step time
    exposed_comm_ms: Spread | None  # over ranks: each rank's mean exposed comm per step
    slowest_ranks: tuple[Outlier, ...]
    most_exposed_ranks: tuple[Outlier, ...]
    nodes: tuple[NodeStats, ...]  # every host, the most communication per step first
    node_outliers: tuple[Outlier, ...]  # hosts by comm per step, the top TOP_K
    heatmap: tuple[HeatRow, ...]
    run_median_step_ms: float | None
    usual_step_count: int = 0  # the most common number of steps per rank
    short_ranks: tuple[tuple[int, int], ...] = ()  # (rank, steps) with fewer: stopped early?


def _spread(values: Sequence[float]) -> Spread | None:
    if not values:
        return None
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]

    return Spread(ordered[0], q(0.5), q(0.9), q(0.99), ordered[-1])


def _robust_z(value: float, median: float, mad: float) -> float | None:
    return (value - median) / (ROBUST_Z_SCALE * mad) if mad > 0 else None


def _outliers(
    values: dict[int, float], hosts: dict[int, str | None], top_k: int
) -> tuple[Outlier, ...]:
    """The top_k ranks by value above the median (highest first), with their robust z."""
    if not values:
        return ()
    median = statistics.median(values.values())
    mad = statistics.median(abs(v - median) for v in values.values())
    above = [(r, v) for r, v in values.items() if v > median]
    top = sorted(above, key=lambda kv: (-kv[1], kv[0]))[:top_k]
    return tuple(
        Outlier(f"rank {r}", r, hosts.get(r), v, median, _robust_z(v, median, mad)) for r, v in top
    )


def large_run_stats(report: Report, top_k: int = TOP_K) -> LargeRunStats:
    """Summarize a Report's ranks for a large run: distributions over ranks, the top_k slowest
    and most-exposed ranks, per-host aggregates (host from the trace's `host_name`), and the
    slowest step time per group of contiguous ranks and step. Memory and time: ranks x steps."""
    ranks = sorted(report.ranks, key=lambda r: r.rank)
    hosts = {r.rank: r.host for r in ranks}
    median_ms: dict[int, float] = {}
    exposed: dict[int, float] = {}
    comm: dict[int, float] = {}
    for r in ranks:
        if not r.steps:
            continue
        median_ms[r.rank] = statistics.median(s.duration_ms for s in r.steps)
        exposed[r.rank] = sum(s.exposed_comm_ms for s in r.steps) / len(r.steps)
        comm[r.rank] = sum(s.comm_ms for s in r.steps) / len(r.steps)
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        if r.rank in median_ms:
            by_host.setdefault(r.host or "unknown host", []).append(r.rank)
    nodes = [
        NodeStats(
            host=h,
            ranks=tuple(rs),
            median_step_ms=statistics.median(median_ms[r] for r in rs),
            comm_ms=sum(comm[r] for r in rs) / len(rs),
            exposed_comm_ms=sum(exposed[r] for r in rs) / len(rs),
        )
        for h, rs in by_host.items()
    ]
    nodes.sort(key=lambda n: (-n.comm_ms, n.host))
    node_outliers: tuple[Outlier, ...] = ()
    if len(nodes) > 1:
        comms = [n.comm_ms for n in nodes]
        med = statistics.median(comms)
        mad = statistics.median(abs(c - med) for c in comms)
        node_outliers = tuple(
            Outlier(n.host, None, n.host, n.comm_ms, med, _robust_z(n.comm_ms, med, mad))
            for n in nodes[:top_k]
        )
    steps = sorted({s.step for r in ranks for s in r.steps})
    shown_steps = steps[:MAX_HEATMAP_STEPS]
    col = {s: i for i, s in enumerate(shown_steps)}
    size = max(1, -(-len(ranks) // HEATMAP_GROUPS))
    heat = []
    for g in range(0, len(ranks), size):
        group = ranks[g : g + size]
        cells: list[float | None] = [None] * len(shown_steps)
        for r in group:
            for s in r.steps:
                i = col.get(s.step)
                if i is not None and (cells[i] is None or s.duration_ms > (cells[i] or 0.0)):
                    cells[i] = s.duration_ms
        heat.append(HeatRow(group[0].rank, group[-1].rank, tuple(cells)))
    all_steps = [s.duration_ms for r in ranks for s in r.steps]
    counts = Counter(len(r.steps) for r in ranks)
    usual = max(counts, key=lambda c: (counts[c], c)) if counts else 0
    short = tuple((r.rank, len(r.steps)) for r in ranks if len(r.steps) < usual)
    return LargeRunStats(
        rank_count=len(ranks),
        steps=tuple(shown_steps),
        step_ms=_spread(list(median_ms.values())),
        exposed_comm_ms=_spread(list(exposed.values())),
        slowest_ranks=_outliers(median_ms, hosts, top_k),
        most_exposed_ranks=_outliers(exposed, hosts, top_k),
        nodes=tuple(nodes),
        node_outliers=node_outliers,
        heatmap=tuple(heat),
        run_median_step_ms=statistics.median(all_steps) if all_steps else None,
        usual_step_count=usual,
        short_ranks=short,
    )
