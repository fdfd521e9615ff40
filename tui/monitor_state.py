"""The live monitor's model: pure logic, no Textual, no sockets (the TUI and headless mode share it).

`MonitorState.ingest(records, now)` folds step records (from `zdiag.collectors.live_receive`, or
a fake source in tests) into bounded per-rank histories; `MonitorState.view(now)` returns an
immutable `MonitorView`: the header figures, one `RankRow` per rank with its status, and live
`Finding`s under the ids `zdiag analyze` uses (``straggler``, ``memory-creep``, ``comm-bound``).
Time is always passed in, so tests freeze it.

Thresholds are the named constants below; each finding reports the one it used in its evidence.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from zdiag.analyzers.report import Finding

HISTORY_STEPS = 60  # step records kept per rank
WINDOW_STEPS = 10  # recent steps the statuses and findings look at
LAG_SAMPLES = 4096  # recent receive lags kept for percentiles
MAX_RANKS = 65_536  # ranks tracked; records of further ranks are counted and ignored
MAX_RELAYS = 4096

STALE_AFTER_S = 5.0  # no record for this long (or 3 recent step times, if longer): "stale"
STALE_STEPS = 3.0
GONE_AFTER_S = 30.0  # no record for this long (or 10 recent step times, if longer): "gone"
GONE_STEPS = 10.0

STRAGGLER_RATIO = 1.25  # rank's recent median compute (else step) time vs. the job's median
STRAGGLER_MIN_EXCESS_MS = 2.0  # ... and at least this much slower in absolute terms
STRAGGLER_MIN_STEPS = 3
COMM_BOUND_RATIO = 1.0  # median comm_ms >= this x median compute_ms: overlap cannot hide it
MEMORY_CREEP_MIN_STEPS = 8
MEMORY_CREEP_MIN_BYTES = 16 * 1024 * 1024  # growth over the window
MEMORY_CREEP_MIN_FRACTION = 0.02  # ... and relative to the window's first value
MEMORY_CREEP_RISING_SHARE = 0.7  # share of step-to-step changes that must be increases


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

LAST_FIELDS = (
    "step",
    "step_time_ms",
    "exposed_comm_ms",
    "mem_allocated_bytes",
    "mem_peak_bytes",
    "dropped",
    "hung_in",
)
"""What the monitor keeps of each rank's last record (the table's cells); nothing else."""


class StepSample(NamedTuple):
    """The figures of one step the model keeps (compact: the full record is not retained)."""

    step: int
    ts: float
    step_time_ms: float | None
    compute_ms: float | None
    comm_ms: float | None
    exposed_comm_ms: float | None
    mem_allocated_bytes: float | None

    @classmethod
    def of(cls, rec: dict[str, Any]) -> StepSample:
        """The sample of a decoded record."""
        return cls(
            int(rec["step"]),
            float(rec["ts"]),
            *(rec.get(k) for k in cls._fields[2:]),
        )


_SAMPLE_INDEX = {name: i for i, name in enumerate(StepSample._fields)}


@dataclass
class RankState:
    """What the monitor knows about one rank (bounded histories)."""

    rank: int
    host: str = "?"
    job: str = ""
    pid: int | None = None
    last: dict[str, Any] = field(default_factory=dict)  # the `LAST_FIELDS` of the last record
    first_seen: float = 0.0
    last_recv: float = 0.0
    restarts: int = 0
    steps: deque[StepSample] = field(default_factory=lambda: deque(maxlen=HISTORY_STEPS))

    def recent(self, key: str, n: int = WINDOW_STEPS) -> list[float]:
        """The non-missing values of `key` (a `StepSample` field) in the last `n` samples, oldest
        first. Walks the history from its newest end (the view calls this for every rank)."""
        i = _SAMPLE_INDEX[key]
        return [float(v) for s in self.tail(n) if (v := s[i]) is not None]

    def tail(self, n: int = WINDOW_STEPS) -> list[StepSample]:
        """The last `n` samples, oldest first."""
        newest_first = list(itertools.islice(reversed(self.steps), n))
        newest_first.reverse()
        return newest_first


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
    status: str  # "ok", "straggler", "hung", "stale", "gone"
    age_s: float  # since the last record
    recent_step_ms: tuple[float, ...]
    dropped: int
    hung_in: str | None = None  # where the rank's hang watchdog found it stuck


@dataclass(frozen=True)
class MonitorView:
    """An immutable snapshot for renderers."""

    now: float
    jobs: tuple[str, ...]
    rows: tuple[RankRow, ...]
    findings: tuple[Finding, ...]
    steps_per_s: float | None
    slowest_step_ms: tuple[float, ...]  # per step number, the slowest rank's step time
    records: int
    rejected: int
    rejections: dict[str, int]  # by reason (zero counts left out); "record": failed to fold in
    dropped: int  # by publishers and relays
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
    """Folds records into per-rank state; all memory is bounded."""

    def __init__(self) -> None:
        """An empty state."""
        self.ranks: dict[int, RankState] = {}
        self.relays: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.records = 0
        self.rejected = 0
        self.rejections: dict[str, int] = {}
        self.unusable_records = 0
        self.ignored_ranks = 0
        self._jobs: OrderedDict[str, None] = OrderedDict()
        self._lags_ms: deque[float] = deque(maxlen=LAG_SAMPLES)
        self._lag_max_ms: float | None = None
        self._slowest: OrderedDict[int, float] = OrderedDict()

    def sync_rejections(self, source: MonitorSource) -> None:
        """Take the source's rejection counts (total, and by reason when it has them)."""
        self.rejected = source.rejected
        by_reason = getattr(source, "rejections", None)
        self.rejections = dict(by_reason) if isinstance(by_reason, dict) else {}

    def ingest(self, records: Iterable[dict[str, Any]], now: float) -> None:
        """Fold decoded records in (``recv_ts`` defaults to `now`).

        A record that cannot be folded in (a source that does not decode into
        `live_wire.decode`'s schema) is counted in `unusable_records` and skipped; the others of
        the batch are not affected.
        """
        for rec in records:
            try:
                self._ingest_one(rec, now)
            except (KeyError, TypeError, ValueError, OverflowError, AttributeError):
                self.unusable_records += 1

    def _ingest_one(self, rec: dict[str, Any], now: float) -> None:
        """Fold one record in; raises (before changing anything) when it is unusable."""
        if rec.get("kind") == "relay":
            self._ingest_relay(rec)
            return
        rank = int(rec["rank"])
        sample = StepSample.of(rec)
        recv = float(rec.get("recv_ts", now))
        pid = rec.get("pid")
        last = {k: rec.get(k) for k in LAST_FIELDS}
        last["dropped"] = int(last["dropped"] or 0)
        step_ms = sample.step_time_ms
        numbers = (recv, *sample[1:], *(last[k] for k in LAST_FIELDS[1:5]))
        if not all(v is None or math.isfinite(v) for v in numbers):
            raise ValueError("a non-finite number")
        self.records += 1
        lag_ms = max(0.0, (recv - sample.ts) * 1000.0)
        self._lags_ms.append(lag_ms)
        self._lag_max_ms = lag_ms if self._lag_max_ms is None else max(self._lag_max_ms, lag_ms)
        state = self.ranks.get(rank)
        if state is None:
            if len(self.ranks) >= MAX_RANKS:
                self.ignored_ranks += 1
                return
            state = self.ranks[rank] = RankState(rank=rank, first_seen=recv)
        if state.pid is not None and pid is not None and pid != state.pid:
            state.restarts += 1  # the rank was restarted: its history no longer applies
            state.steps.clear()
        state.pid = pid if isinstance(pid, int) else state.pid
        state.host = str(rec.get("host", state.host))[:128]
        state.job = str(rec.get("job", state.job))[:128]
        state.last = last
        state.last_recv = max(state.last_recv, recv)
        state.steps.append(sample)
        if state.job:
            self._jobs[state.job] = None
            self._jobs.move_to_end(state.job)
            while len(self._jobs) > 8:
                self._jobs.popitem(last=False)
        if step_ms is not None:
            if step_ms > self._slowest.get(sample.step, -1.0):
                self._slowest[sample.step] = float(step_ms)
            while len(self._slowest) > 4 * HISTORY_STEPS:
                self._slowest.pop(min(self._slowest))

    def _ingest_relay(self, rec: dict[str, Any]) -> None:
        host = str(rec.get("host", "?"))[:128]
        self.relays[host] = {"dropped": int(rec.get("dropped", 0) or 0)}
        self.relays.move_to_end(host)
        while len(self.relays) > MAX_RELAYS:
            self.relays.popitem(last=False)

    # -- view ----------------------------------------------------------------------------------

    def status(self, state: RankState, now: float) -> str:
        """ "hung" when the rank's last record is its hang watchdog's, else "gone", "stale" or
        "ok" from the time since the rank's last record."""
        if state.last.get("hung_in"):
            return "hung"
        typical_s = (_median(state.recent("step_time_ms")) or 0.0) / 1000.0
        age = now - state.last_recv
        if age > max(GONE_AFTER_S, GONE_STEPS * typical_s):
            return "gone"
        if age > max(STALE_AFTER_S, STALE_STEPS * typical_s):
            return "stale"
        return "ok"

    def view(self, now: float) -> MonitorView:
        """The snapshot at time `now` (rows in rank order)."""
        statuses = {r: self.status(s, now) for r, s in self.ranks.items()}
        # findings only look at ranks still reporting
        live = {r: s for r, s in self.ranks.items() if statuses[r] == "ok"}
        findings: list[Finding] = []
        stragglers = _stragglers(live.values())
        if stragglers:
            findings.append(stragglers)
        creep = _memory_creep(live.values())
        if creep:
            findings.append(creep)
        comm = _comm_bound(live.values())
        if comm:
            findings.append(comm)
        straggler_ranks = set(stragglers.ranks) if stragglers else set()
        rows = []
        for rank in sorted(self.ranks):
            s = self.ranks[rank]
            status = statuses[rank]
            if status == "ok" and rank in straggler_ranks:
                status = "straggler"
            last = s.last
            rows.append(
                RankRow(
                    rank=rank,
                    host=s.host,
                    step=int(last.get("step", 0)),
                    step_time_ms=last.get("step_time_ms"),
                    exposed_comm_ms=last.get("exposed_comm_ms"),
                    mem_allocated_bytes=last.get("mem_allocated_bytes"),
                    mem_peak_bytes=last.get("mem_peak_bytes"),
                    status=status,
                    age_s=max(0.0, now - s.last_recv),
                    recent_step_ms=tuple(s.recent("step_time_ms", 16)),
                    dropped=int(last.get("dropped", 0) or 0),
                    hung_in=last.get("hung_in"),
                )
            )
        rates = [r for r in (_steps_per_s(s) for s in live.values()) if r is not None]
        lags = list(self._lags_ms)
        dropped = sum(row.dropped for row in rows) + sum(
            int(r.get("dropped", 0) or 0) for r in self.relays.values()
        )
        steps = sorted(self._slowest)[-HISTORY_STEPS:]
        return MonitorView(
            now=now,
            jobs=tuple(self._jobs),
            rows=tuple(rows),
            findings=tuple(findings),
            steps_per_s=_median(rates),
            slowest_step_ms=tuple(self._slowest[k] for k in steps),
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


def _steps_per_s(state: RankState) -> float | None:
    recent = state.tail()
    if len(recent) < 2:
        return None
    dt = recent[-1].ts - recent[0].ts
    dsteps = recent[-1].step - recent[0].step
    return dsteps / dt if dt > 0 and dsteps > 0 else None


def _stragglers(states: Iterable[RankState]) -> Finding | None:
    """Ranks whose recent compute time (step time when no split is sent) is well above the job's.

    In synchronous data parallel every rank's step time converges to the slowest one's (the others
    wait inside collectives), so the compute split is the better signal when the collectors have it.
    """
    states = list(states)
    key = "compute_ms" if all(s.recent("compute_ms") for s in states) else "step_time_ms"
    recents = {s.rank: s.recent(key) for s in states}
    medians = {r: statistics.median(v) for r, v in recents.items() if len(v) >= STRAGGLER_MIN_STEPS}
    if len(medians) < 2:
        return None
    job_median = statistics.median(medians.values())
    slow = sorted(
        (r for r, m in medians.items() if m > STRAGGLER_RATIO * job_median)
        if job_median > 0
        else [],
        key=lambda r: -medians[r],
    )
    slow = [r for r in slow if medians[r] - job_median >= STRAGGLER_MIN_EXCESS_MS]
    if not slow:
        return None
    worst = slow[0]
    ratio = medians[worst] / job_median
    hosts = sorted({s.host for s in states if s.rank in slow})
    return Finding(
        id="straggler",
        severity="critical" if ratio >= 2 else "warning",
        title=f"{len(slow)} straggler rank(s): rank {worst} is {ratio:.2f}x the job's median {key}",
        ranks=slow,
        evidence={
            "metric": key,
            "job_median_ms": round(job_median, 3),
            "rank_median_ms": {str(r): round(medians[r], 3) for r in slow[:16]},
            "hosts": hosts[:16],
            "threshold_ratio": STRAGGLER_RATIO,
            "window_steps": WINDOW_STEPS,
        },
        recommendation=(
            "Every collective waits for the slowest rank: check the straggler's host "
            "(throttling, other processes, a slower link) and its input (uneven batch or "
            "sequence lengths); profile a window with `zdiag run` and compare ranks with "
            "`zdiag analyze`."
        ),
        expected_gain_ms=round(medians[worst] - job_median, 3),
        gain_method="the straggler's median minus the job's median, per step",
    )


def _memory_creep(states: Iterable[RankState]) -> Finding | None:
    """Ranks whose allocated memory rises step after step over the recent window."""
    creeping: dict[int, float] = {}
    for s in states:
        mem = s.recent("mem_allocated_bytes", HISTORY_STEPS)[-4 * WINDOW_STEPS :]
        if len(mem) < MEMORY_CREEP_MIN_STEPS:
            continue
        growth = mem[-1] - mem[0]
        if not math.isfinite(growth):  # absurd (finite) values: no meaningful growth rate
            continue
        deltas = [b - a for a, b in itertools.pairwise(mem) if b != a]
        rising = sum(1 for d in deltas if d > 0) / len(deltas) if deltas else 0.0
        if (
            growth >= MEMORY_CREEP_MIN_BYTES
            and growth >= MEMORY_CREEP_MIN_FRACTION * max(mem[0], 1.0)
            and rising >= MEMORY_CREEP_RISING_SHARE
        ):
            creeping[s.rank] = growth / (len(mem) - 1)
    if not creeping:
        return None
    ranks = sorted(creeping, key=lambda r: -creeping[r])
    worst = creeping[ranks[0]]
    return Finding(
        id="memory-creep",
        severity="warning",
        title=f"allocated memory grows every step on {len(ranks)} rank(s) "
        f"(up to {worst / 2**20:.1f} MiB/step)",
        ranks=ranks,
        evidence={
            "bytes_per_step": {str(r): round(creeping[r]) for r in ranks[:16]},
            "min_growth_bytes": MEMORY_CREEP_MIN_BYTES,
            "rising_share": MEMORY_CREEP_RISING_SHARE,
        },
        recommendation=(
            "Something keeps tensors alive across steps: a loss or metric kept with its graph "
            "(store `loss.item()` or `loss.detach()`), a growing cache or list of outputs; take a "
            "memory snapshot with `zdiag run` before it runs out of memory."
        ),
        gain_method="",
    )


def _comm_bound(states: Iterable[RankState]) -> Finding | None:
    """Ranks whose communication takes at least as long as their compute (overlap cannot hide it)."""
    bound: dict[int, tuple[float, float, float]] = {}
    for s in states:
        pairs = [
            (float(st.comm_ms), float(st.compute_ms))
            for st in s.tail()
            if st.comm_ms is not None and st.compute_ms is not None
        ]
        if len(pairs) < STRAGGLER_MIN_STEPS:
            continue
        comm = statistics.median(p[0] for p in pairs)
        compute = statistics.median(p[1] for p in pairs)
        exposed = _median(s.recent("exposed_comm_ms"))
        if comm > 0 and comm >= COMM_BOUND_RATIO * compute:
            bound[s.rank] = (comm, compute, exposed or 0.0)
    if not bound:
        return None
    ranks = sorted(bound)
    comm, compute, exposed = (statistics.median(v[i] for v in bound.values()) for i in range(3))
    return Finding(
        id="comm-bound",
        severity="warning",
        title=f"communication ({comm:.1f} ms) outlasts compute ({compute:.1f} ms) on "
        f"{len(ranks)} rank(s): overlap cannot hide it",
        ranks=ranks,
        evidence={
            "median_comm_ms": round(comm, 3),
            "median_compute_ms": round(compute, 3),
            "median_exposed_comm_ms": round(exposed, 3),
            "threshold_ratio": COMM_BOUND_RATIO,
            "window_steps": WINDOW_STEPS,
        },
        recommendation=(
            "Move fewer bytes per step: a larger per-rank batch (or gradient accumulation), "
            "hybrid sharding (`fully_shard(..., mesh=2-D mesh)` / ZeRO++ hpZ) so all-gathers stay "
            "inside a node, or bf16 communication (`MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
            "reduce_dtype=torch.bfloat16)`)."
        ),
        expected_gain_ms=round(max(0.0, exposed), 3) or None,
        gain_method="upper bound: the median exposed communication per step",
    )
