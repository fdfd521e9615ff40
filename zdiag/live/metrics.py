"""`zdiag monitor --metrics-port`: the monitor's state as Prometheus / OpenMetrics metrics.

`serve_metrics(state, host, port)` starts prometheus_client's HTTP server (its own daemon
thread) with a `MonitorCollector`: on each scrape it takes `SharedMonitorState.lock`, reads the
views of every job the state holds (`MonitorState.view`, so the statuses are the TUI's), lets
the lock go, and only then builds the metric families. Nothing is updated per record, and the
receive loop waits at most one scrape's views for the lock.

Metrics (gauges unless `_total`; names and labels in docs/monitor.md, "Metrics"): per rank,
labels ``job`` (the records' job id, else ``unknown``), ``node`` (the host the rank sends) and
``rank``; per mesh dimension also ``dim``; per job ``job`` alone.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterable
from typing import Any, NamedTuple
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from zdiag.live.state import Clock, MonitorState

__all__ = ["MetricsServer", "MonitorCollector", "SharedMonitorState", "serve_metrics"]

UNKNOWN_JOB = "unknown"
"""The ``job`` label of ranks whose records carry no job id."""
RANK_LABELS = ("job", "node", "rank")
STALE_STATUSES = ("stale", "gone")
"""Statuses `zdiag_ranks_stale` counts: no record for a while (`state.STALE_AFTER_S`)."""


class SharedMonitorState(MonitorState):
    """A `MonitorState` a scrape thread may read: `ingest` holds `lock`, and counts the records
    it folded in per (job, rank) in `received` (bounded: the ranks the state holds)."""

    def __init__(self) -> None:
        """An empty state and its lock."""
        super().__init__()
        self.lock = threading.Lock()
        self.received: dict[tuple[str, int], int] = {}

    def ingest(self, records: Iterable[dict[str, Any]], now: float) -> None:
        """`MonitorState.ingest` under `lock`, counting each record folded into a rank."""
        with self.lock:
            for rec in records:
                records_before, ignored_before = self.records, self.ignored_ranks
                super().ingest((rec,), now)
                if self.records > records_before and self.ignored_ranks == ignored_before:
                    key = (str(rec.get("job") or "")[:128], int(rec["rank"]))
                    self.received[key] = self.received.get(key, 0) + 1
            if len(self.received) > sum(len(j.ranks) for j in self.jobs.values()):
                self.received = {  # a job was evicted: forget its ranks' counts
                    (j, r): n
                    for (j, r), n in self.received.items()
                    if j in self.jobs and r in self.jobs[j].ranks
                }


class RankFigures(NamedTuple):
    """One rank's figures at a scrape (seconds and bytes; None: not sent)."""

    labels: tuple[str, str, str]  # job, node, rank
    status: str
    step: int
    step_s: float | None
    median_step_s: float | None
    comm_s: float | None
    exposed_comm_s: float | None
    mem_allocated_bytes: float | None
    mem_peak_bytes: float | None
    comm_by_dim: dict[str, tuple[float, float]]  # dim -> (comm_s, exposed_comm_s)
    received: int
    dropped: int


RANK_GAUGES = (
    ("zdiag_step", "step", "The last step number the rank reported"),
    ("zdiag_step_time_seconds", "step_s", "The rank's last step time"),
    (
        "zdiag_step_time_median_seconds",
        "median_step_s",
        "The rank's median step time over the monitor's window (the last 10 steps)",
    ),
    ("zdiag_comm_seconds", "comm_s", "Communication in flight during the rank's last step"),
    (
        "zdiag_exposed_comm_seconds",
        "exposed_comm_s",
        "Communication the rank's last step waited for (not overlapped with compute)",
    ),
    ("zdiag_memory_allocated_bytes", "mem_allocated_bytes", "Memory allocated at the last step"),
    ("zdiag_memory_peak_bytes", "mem_peak_bytes", "Peak memory allocated, as the rank reports"),
)
"""(metric name, `RankFigures` field, help) of the per-rank gauges."""


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else float(ms) / 1000.0


def snapshot(state: SharedMonitorState, now: float) -> tuple[dict[str, int], list[RankFigures]]:
    """Every job's rank figures at `now` (each job's ranks seen, then every rank's figures);
    holds `state.lock` while it reads the state."""
    jobs: dict[str, int] = {}
    ranks: list[RankFigures] = []
    with state.lock:
        for job_id, job in list(state.jobs.items()):
            view = state.view(now, job_id)
            label = job_id or UNKNOWN_JOB
            jobs[label] = len(view.rows)
            for row in view.rows:
                rank = job.ranks[row.rank]
                last_step = rank.steps[-1] if rank.steps else None
                by_dim = row.comm_by_dim or {}
                recent = rank.recent("step_time_ms")
                ranks.append(
                    RankFigures(
                        labels=(label, row.host, str(row.rank)),
                        status=row.status,
                        step=row.step,
                        step_s=_seconds(row.step_time_ms),
                        median_step_s=_seconds(statistics.median(recent) if recent else None),
                        comm_s=_seconds(last_step.comm_ms if last_step else None),
                        exposed_comm_s=_seconds(row.exposed_comm_ms),
                        mem_allocated_bytes=row.mem_allocated_bytes,
                        mem_peak_bytes=row.mem_peak_bytes,
                        comm_by_dim={d: (c / 1000.0, e / 1000.0) for d, (c, e) in by_dim.items()},
                        received=state.received.get((job_id, row.rank), 0),
                        dropped=row.dropped,
                    )
                )
    return jobs, ranks


DIM_LABELS = (*RANK_LABELS, "dim")
_G, _C = GaugeMetricFamily, CounterMetricFamily
OTHER_FAMILIES = (
    (_G, "zdiag_dim_comm_seconds", DIM_LABELS,
     "Communication in flight during the rank's last step, per mesh dimension"),
    (_G, "zdiag_dim_exposed_comm_seconds", DIM_LABELS,
     "Communication the rank's last step waited for, per mesh dimension"),
    (_G, "zdiag_rank_status", (*RANK_LABELS, "status"),
     "1 for the rank's status (ok, straggler, stale, gone, hung, finished, failed)"),
    (_C, "zdiag_records_received", RANK_LABELS, "Step records the monitor received from the rank"),
    (_C, "zdiag_records_dropped", RANK_LABELS,
     "Step records the rank's publisher dropped (its own counter: restarts with the rank)"),
    (_G, "zdiag_ranks_seen", ("job",), "Ranks of the job the monitor holds"),
    (_G, "zdiag_ranks_stale", ("job",), "Ranks of the job with no record for a while (stale, gone)"),
)  # fmt: skip
"""(family type, name, labels, help) of the other families."""


def families() -> dict[str, Metric]:
    """Every family the collector exposes, empty, by name (without a counter's ``_total``)."""
    out: dict[str, Metric] = {
        name: GaugeMetricFamily(name, help_text, labels=RANK_LABELS)
        for name, _, help_text in RANK_GAUGES
    }
    for kind, name, labels, help_text in OTHER_FAMILIES:
        out[name] = kind(name, help_text, labels=labels)
    return out


class MonitorCollector(Collector):
    """A prometheus_client collector reading a `SharedMonitorState` on each scrape."""

    def __init__(self, state: SharedMonitorState, clock: Clock = time.time) -> None:
        """Collect `state`'s figures at `clock()` (statuses depend on the time)."""
        self.state = state
        self.clock = clock

    def describe(self) -> Iterable[Metric]:
        """The families, empty (the registry learns the names without reading the state)."""
        return families().values()

    def collect(self) -> Iterable[Metric]:
        """The families of one scrape, filled (a figure a rank did not send is left out)."""
        jobs, ranks = snapshot(self.state, self.clock())
        fam: dict[str, Any] = families()
        for fig in ranks:
            for name, field, _ in RANK_GAUGES:
                value = getattr(fig, field)
                if value is not None:
                    fam[name].add_metric(fig.labels, float(value))
            for dim, (comm_s, exposed_s) in sorted(fig.comm_by_dim.items()):
                fam["zdiag_dim_comm_seconds"].add_metric((*fig.labels, dim), comm_s)
                fam["zdiag_dim_exposed_comm_seconds"].add_metric((*fig.labels, dim), exposed_s)
            fam["zdiag_rank_status"].add_metric((*fig.labels, fig.status), 1.0)
            fam["zdiag_records_received"].add_metric(fig.labels, fig.received)
            fam["zdiag_records_dropped"].add_metric(fig.labels, fig.dropped)
        for job, seen in jobs.items():
            stale = sum(f.status in STALE_STATUSES for f in ranks if f.labels[0] == job)
            fam["zdiag_ranks_seen"].add_metric((job,), seen)
            fam["zdiag_ranks_stale"].add_metric((job,), stale)
        return fam.values()


class MetricsServer:
    """A running metrics endpoint (`serve_metrics`); `close()` stops it."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        """Wrap prometheus_client's server and its thread."""
        self.server = server
        self.thread = thread

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self.server.server_address[1])

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving (waits for the serving thread, at most `timeout_s`); idempotent."""
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout_s)


def serve_metrics(
    state: SharedMonitorState, host: str, port: int, *, clock: Clock = time.time
) -> MetricsServer:
    """Serve `state`'s metrics on ``http://host:port/metrics`` (text format 0.0.4, or OpenMetrics
    when the scraper asks for it) from a daemon thread; raises OSError when it cannot listen."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MonitorCollector(state, clock))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)
