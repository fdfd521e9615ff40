"""The live monitor's model: pure logic, no Textual, no sockets (the TUI and headless mode draw it).

`MonitorState.ingest(records, now)` folds step records (from `zdiag.live.receiver`, or
a fake source in tests) into bounded per-job, per-rank histories; `MonitorState.view(now, job)`
returns an immutable `MonitorView` of one job (the most recently active one unless named): the
header figures, one `RankRow` per rank with its status, and live `Finding`s
(`zdiag.live.findings`). `MonitorState.detail(rank, now, job)` is one rank's `RankDetail`.
Time is always passed in, so tests freeze it.

Findings look at the ranks still reporting and the ones that finished; once no rank of the job
reports any more (it ended, died or hangs), at every rank's history as it ended, so the
findings stay on screen after the job.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from zdiag.analyzers.report import Finding
from zdiag.live.anomalies import slow_steps, stalls, step_time_creep, with_persistence
from zdiag.live.findings import comm_bound, floor_growth_per_step, memory_creep, stragglers
from zdiag.live.history import (
    HISTORY_STEPS,
    LAST_FIELDS,
    NUMBER_LAST_FIELDS,
    TIMELINE_STEPS,
    JobHistory,
    RankState,
    StepSample,
    job_history,
)

__all__ = [
    "HISTORY_STEPS",
    "LAST_FIELDS",
    "TIMELINE_STEPS",
    "JobHistory",
    "MonitorState",
    "MonitorView",
    "RankDetail",
    "RankRow",
]

LAG_SAMPLES = 4096  # recent receive lags kept for percentiles
MAX_RANKS = 65_536  # ranks tracked (all jobs together); records of further ranks are ignored
MAX_RELAYS = 4096
MAX_JOBS = 8  # jobs tracked; a further job evicts the one that reported least recently

MAX_CAPTURE_ASKS = 8  # `zdiag capture` requests waiting for the capture controller
STALE_AFTER_S = 5.0  # no record for this long (or 3 recent step times, if longer): "stale"
STALE_STEPS = 3.0
GONE_AFTER_S = 30.0  # no record for this long (or 10 recent step times, if longer): "gone"
GONE_STEPS = 10.0
ENDED_STATUSES = ("finished", "failed")
"""What a rank's end-of-run record (``ended``) says: it returned cleanly, or it raised."""


class MonitorSource(Protocol):
    """Where the monitor's records come from (a `LiveReceiver`, or a fake in tests)."""

    def poll(self) -> list[dict[str, Any]]:
        """New records since the last call, each with ``recv_ts``; never blocks for long."""
        ...

    @property
    def rejected(self) -> int:
        """Messages refused so far (wrong token or malformed)."""
        ...

    def close(self) -> None:
        """Release the source."""
        ...


Clock = Callable[[], float]


@dataclass
class JobState:
    """The ranks of one job (records carry ``job``) and its slowest step time per step."""

    ranks: dict[int, RankState] = field(default_factory=dict)
    last_recv: float = 0.0
    slowest: OrderedDict[int, float] = field(default_factory=OrderedDict)


@dataclass(frozen=True)
class RankRow:
    """One rank as the table shows it."""

    rank: int
    host: str
    step: int
    step_time_ms: float | None
    exposed_comm_ms: float | None
    mem_allocated_bytes: float | None
    mem_peak_bytes: float | None
    status: str  # "ok", "straggler", "hung", "stale", "gone", "finished", "failed"
    age_s: float  # since the last record
    recent_step_ms: tuple[float, ...]
    dropped: int
    hung_in: str | None = None  # where the rank's hang watchdog found it stuck
    # the last step's [comm_ms, exposed_comm_ms] per mesh dimension (2+ dimensions only)
    comm_by_dim: dict[str, tuple[float, float]] | None = None


@dataclass(frozen=True)
class RankDetail:
    """One rank in full, for the detail view: its step history, split, memory, last collective."""

    rank: int
    host: str
    job: str
    pid: int | None
    status: str
    age_s: float
    restarts: int
    dropped: int
    history: tuple[tuple[int, float, float], ...]  # (step, ts, step_time_ms) of the kept steps
    step_time_ms: float | None  # medians over the last `WINDOW_STEPS` steps ...
    compute_ms: float | None
    comm_ms: float | None
    exposed_comm_ms: float | None
    idle_ms: float | None  # ... down to here; per step: the step beyond compute and exposed comm
    mem_allocated_bytes: float | None  # the last record's
    mem_reserved_bytes: float | None
    mem_peak_bytes: float | None
    mem_creep_bytes_per_step: float | None  # the memory-creep rule's rate, None when no creep
    mem_source: str | None  # "device", "reader", "process" (RSS: not judged), None: unknown
    last_collective: str | None
    hung_in: str | None
    comm_by_dim: dict[str, tuple[float, float]] | None = None  # the last step's, per dimension

    @property
    def overlapped_comm_ms(self) -> float | None:
        """Communication hidden behind compute: in flight, but not waited for."""
        if self.comm_ms is None or self.exposed_comm_ms is None:
            return None
        return max(0.0, self.comm_ms - self.exposed_comm_ms)


@dataclass(frozen=True)
class MonitorView:
    """An immutable snapshot of one job for renderers."""

    now: float
    job: str  # the job shown ("" when its records carry no job id)
    jobs: tuple[str, ...]  # every job seen, in the order they first reported
    rows: tuple[RankRow, ...]
    findings: tuple[Finding, ...]
    steps_per_s: float | None
    slowest_step_ms: tuple[float, ...]  # per step number, the slowest rank's step time
    records: int
    rejected: int
    rejections: dict[str, int]  # by reason (zero counts left out); "record": failed to fold in
    dropped: int  # by this job's publishers and all relays
    relays: int
    ignored_ranks: int
    lag_p50_ms: float | None
    lag_p99_ms: float | None
    lag_max_ms: float | None

    @property
    def status_counts(self) -> dict[str, int]:
        """How many ranks are in each status."""
        counts: dict[str, int] = {}
        for row in self.rows:
            counts[row.status] = counts.get(row.status, 0) + 1
        return counts


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class MonitorState:
    """Folds records into per-job, per-rank state; all memory is bounded."""

    def __init__(self) -> None:
        """An empty state."""
        self.jobs: OrderedDict[str, JobState] = OrderedDict()  # in the order they first reported
        self.relays: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.records = 0
        self.rejected = 0
        self.rejections: dict[str, int] = {}
        self.unusable_records = 0
        self.ignored_ranks = 0
        self._rank_count = 0  # over all jobs
        self._lags_ms: deque[float] = deque(maxlen=LAG_SAMPLES)
        self._lag_max_ms: float | None = None
        # captures asked with `zdiag capture` (job, reason), for the capture controller
        self.capture_asks: deque[tuple[str, str]] = deque(maxlen=MAX_CAPTURE_ASKS)

    @property
    def current_job(self) -> str | None:
        """The job whose last record arrived last (None before any record)."""
        if not self.jobs:
            return None
        return max(self.jobs, key=lambda j: self.jobs[j].last_recv)

    @property
    def ranks(self) -> dict[int, RankState]:
        """The ranks of the current job."""
        job = self.current_job
        return self.jobs[job].ranks if job is not None else {}

    def sync_rejections(self, source: MonitorSource) -> None:
        """Take the source's rejection counts (total, and by reason when it has them)."""
        self.rejected = source.rejected
        by_reason = getattr(source, "rejections", None)
        self.rejections = dict(by_reason) if isinstance(by_reason, dict) else {}

    def ingest(self, records: Iterable[dict[str, Any]], now: float) -> None:
        """Fold decoded records in (``recv_ts`` defaults to `now`).

        A record that cannot be folded in (a source that does not decode into
        `wire.decode`'s schema) is counted in `unusable_records` and skipped; the others of
        the batch are not affected.
        """
        for rec in records:
            try:
                self._ingest_one(rec, now)
            except (KeyError, TypeError, ValueError, OverflowError, AttributeError):
                self.unusable_records += 1

    def _ingest_one(self, rec: dict[str, Any], now: float) -> None:
        """Fold one record in; raises (before changing anything) when it is unusable."""
        if rec.get("kind") == "capture":
            self.capture_asks.append(
                (str(rec.get("job") or "")[:128], str(rec.get("reason") or ""))
            )
            return
        if rec.get("kind") == "relay":
            self._ingest_relay(rec)
            return
        rank = int(rec["rank"])
        sample = StepSample.of(rec)
        recv = float(rec.get("recv_ts", now))
        pid = rec.get("pid")
        last = {k: rec.get(k) for k in LAST_FIELDS}
        last["dropped"] = int(last["dropped"] or 0)
        numbers = (recv, *sample.numbers(), *(last[k] for k in NUMBER_LAST_FIELDS))
        if not all(v is None or math.isfinite(v) for v in numbers):
            raise ValueError("a non-finite number")
        ended = last["ended"]
        if ended is not None and ended not in ENDED_STATUSES:
            raise ValueError(f"ended is {ended!r}")
        self.records += 1
        lag_ms = max(0.0, (recv - sample.ts) * 1000.0)
        self._lags_ms.append(lag_ms)
        self._lag_max_ms = lag_ms if self._lag_max_ms is None else max(self._lag_max_ms, lag_ms)
        job = self._job(str(rec.get("job") or "")[:128], recv)
        state = job.ranks.get(rank)
        if state is None:
            if self._rank_count >= MAX_RANKS:
                self.ignored_ranks += 1
                return
            self._rank_count += 1
            state = job.ranks[rank] = RankState(rank=rank, first_seen=recv)
        if state.pid is not None and pid is not None and pid != state.pid:
            state.restarts += 1  # the rank was restarted: its history no longer applies
            state.steps.clear()
            state.times.clear()
            state.last = {}
        state.pid = pid if isinstance(pid, int) else state.pid
        state.host = str(rec.get("host", state.host))[:128]
        state.job = str(rec.get("job") or "")[:128]
        state.last_recv = max(state.last_recv, recv)
        if ended is not None and state.last:  # the end of the run: the last step's figures stay
            state.last = {**state.last, "ended": ended, "dropped": last["dropped"]}
            return
        state.last = last
        state.steps.append(sample)
        step_ms = sample.step_time_ms
        if step_ms is not None:
            state.times.append(sample.step, step_ms)
            if step_ms > job.slowest.get(sample.step, -1.0):
                job.slowest[sample.step] = float(step_ms)
            while len(job.slowest) > 4 * HISTORY_STEPS:
                job.slowest.pop(min(job.slowest))

    def _job(self, job_id: str, recv: float) -> JobState:
        """The state of `job_id` (made, evicting the least recently active job past MAX_JOBS)."""
        job = self.jobs.get(job_id)
        if job is None:
            while len(self.jobs) >= MAX_JOBS:
                oldest = min(self.jobs, key=lambda j: self.jobs[j].last_recv)
                self._rank_count -= len(self.jobs.pop(oldest).ranks)
            job = self.jobs[job_id] = JobState()
        job.last_recv = max(job.last_recv, recv)
        return job

    def _ingest_relay(self, rec: dict[str, Any]) -> None:
        host = str(rec.get("host", "?"))[:128]
        self.relays[host] = {"dropped": int(rec.get("dropped", 0) or 0)}
        self.relays.move_to_end(host)
        while len(self.relays) > MAX_RELAYS:
            self.relays.popitem(last=False)

    # -- view ----------------------------------------------------------------------------------

    def status(self, state: RankState, now: float) -> str:
        """ "finished" after a clean end-of-run record; "hung" when the last step record is the
        hang watchdog's (also once the hung rank is ended: where it hung says more than "failed");
        "failed" after a failed end-of-run record; else "gone", "stale" or "ok" from the time
        since the rank's last record."""
        ended = state.last.get("ended")
        if ended == "finished":
            return "finished"
        if state.last.get("hung_in"):
            return "hung"
        if ended:
            return str(ended)
        typical_s = (_median(state.recent("step_time_ms")) or 0.0) / 1000.0
        age = now - state.last_recv
        if age > max(GONE_AFTER_S, GONE_STEPS * typical_s):
            return "gone"
        if age > max(STALE_AFTER_S, STALE_STEPS * typical_s):
            return "stale"
        return "ok"

    def _selected(self, job: str | None) -> str | None:
        return job if job is not None and job in self.jobs else self.current_job

    def view(self, now: float, job: str | None = None) -> MonitorView:
        """The snapshot of `job` (default: the current job) at time `now`, rows in rank order."""
        selected = self._selected(job)
        ranks = self.jobs[selected].ranks if selected is not None else {}
        statuses = {r: self.status(s, now) for r, s in ranks.items()}
        if any(st == "ok" for st in statuses.values()):
            counted = {r: s for r, s in ranks.items() if statuses[r] in ("ok", "finished")}
        else:  # the job is over (or stuck): its histories as they ended
            counted = dict(ranks)
        findings: list[Finding] = []
        slow = stragglers(counted.values())
        if slow is not None:
            slow = with_persistence(slow, list(counted.values()))
        for found in (
            slow,
            slow_steps(counted.values()),
            step_time_creep(counted.values()),
            stalls(ranks.values(), statuses, now),
            memory_creep(counted.values()),
            comm_bound(counted.values()),
        ):
            if found:
                findings.append(found)
        straggler_ranks = set(slow.ranks) if slow else set()
        rows = []
        for rank in sorted(ranks):
            s = ranks[rank]
            status = statuses[rank]
            if status == "ok" and rank in straggler_ranks:
                status = "straggler"
            last = s.last
            rows.append(
                RankRow(
                    rank=rank,
                    host=s.host,
                    step=int(last.get("step") or 0),
                    step_time_ms=last.get("step_time_ms"),
                    exposed_comm_ms=last.get("exposed_comm_ms"),
                    mem_allocated_bytes=last.get("mem_allocated_bytes"),
                    mem_peak_bytes=last.get("mem_peak_bytes"),
                    status=status,
                    age_s=max(0.0, now - s.last_recv),
                    recent_step_ms=tuple(s.recent("step_time_ms", 16)),
                    dropped=int(last.get("dropped", 0) or 0),
                    hung_in=last.get("hung_in"),
                    comm_by_dim=last.get("comm_by_dim"),
                )
            )
        live = [s for r, s in ranks.items() if statuses[r] == "ok"]
        rates = [r for r in (_steps_per_s(s) for s in live) if r is not None]
        lags = list(self._lags_ms)
        dropped = sum(row.dropped for row in rows) + sum(
            int(r.get("dropped", 0) or 0) for r in self.relays.values()
        )
        slowest = self.jobs[selected].slowest if selected is not None else {}
        steps = sorted(slowest)[-HISTORY_STEPS:]
        return MonitorView(
            now=now,
            job=selected or "",
            jobs=tuple(self.jobs),
            rows=tuple(rows),
            findings=tuple(findings),
            steps_per_s=_median(rates),
            slowest_step_ms=tuple(slowest[k] for k in steps),
            records=self.records,
            rejected=self.rejected + self.unusable_records,
            rejections={
                k: v for k, v in {**self.rejections, "record": self.unusable_records}.items() if v
            },
            dropped=dropped,
            relays=len(self.relays),
            ignored_ranks=self.ignored_ranks,
            lag_p50_ms=_percentile(lags, 0.5),
            lag_p99_ms=_percentile(lags, 0.99),
            lag_max_ms=self._lag_max_ms,
        )

    def history(self, job: str | None = None, steps: int = TIMELINE_STEPS) -> JobHistory:
        """`job`'s (default: the current job's) step times over its last `steps` steps, per
        rank, with the median and slowest rank per step (`history.job_history`; computed on
        each call, for the history view and the headless JSON)."""
        selected = self._selected(job)
        ranks = self.jobs[selected].ranks.values() if selected is not None else ()
        return job_history(ranks, selected or "", steps)

    def detail(self, rank: int, now: float, job: str | None = None) -> RankDetail | None:
        """Rank `rank` of `job` (default: the current job) in full; None when it is unknown."""
        selected = self._selected(job)
        s = self.jobs[selected].ranks.get(rank) if selected is not None else None
        if s is None:
            return None
        last = s.last
        return RankDetail(
            rank=rank,
            host=s.host,
            job=s.job,
            pid=s.pid,
            status=self.status(s, now),
            age_s=max(0.0, now - s.last_recv),
            restarts=s.restarts,
            dropped=int(last.get("dropped", 0) or 0),
            history=tuple(
                (st.step, st.ts, float(st.step_time_ms))
                for st in s.steps
                if st.step_time_ms is not None
            ),
            step_time_ms=_median(s.recent("step_time_ms")),
            compute_ms=_median(s.recent("compute_ms")),
            comm_ms=_median(s.recent("comm_ms")),
            exposed_comm_ms=_median(s.recent("exposed_comm_ms")),
            idle_ms=_median(_idle_ms(s)),
            mem_allocated_bytes=last.get("mem_allocated_bytes"),
            mem_reserved_bytes=last.get("mem_reserved_bytes"),
            mem_peak_bytes=last.get("mem_peak_bytes"),
            mem_creep_bytes_per_step=floor_growth_per_step(s),
            mem_source=last.get("mem_source"),
            last_collective=last.get("last_collective"),
            hung_in=last.get("hung_in"),
            comm_by_dim=last.get("comm_by_dim"),
        )


def _idle_ms(state: RankState) -> list[float]:
    """Per recent step with the whole split: its time beyond compute and exposed comm (>= 0)."""
    out = []
    for st in state.tail():
        step, compute, exposed = st.step_time_ms, st.compute_ms, st.exposed_comm_ms
        if step is not None and compute is not None and exposed is not None:
            out.append(max(0.0, float(step) - float(compute) - float(exposed)))
    return out


def _steps_per_s(state: RankState) -> float | None:
    recent = state.tail()
    if len(recent) < 2:
        return None
    dt = recent[-1].ts - recent[0].ts
    dsteps = recent[-1].step - recent[0].step
    return dsteps / dt if dt > 0 and dsteps > 0 else None
