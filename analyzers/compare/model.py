"""The diff of two runs (`zdiag diff A B`) as a versioned value: `RunDiff`, schema `zdiag.diff/1`.

A is the baseline, B the candidate; every delta is B - A. Times are ms per step (per rank where
a section says so), bytes are bytes. `change` words: "up" / "down" when a delta lies outside the
step-to-step spread, "no change" inside it, "undetermined" when a side has too few steps to tell.
"""

from __future__ import annotations

import msgspec

DIFF_SCHEMA = "zdiag.diff/1"


class Delta(msgspec.Struct, kw_only=True):
    """One metric in A and B (medians over steps), its change and the spread that judges it."""

    metric: str
    a: float
    b: float
    delta: float
    pct: float | None  # delta / a, in percent (None when a is 0)
    spread: float  # a delta within +-spread is "no change"
    change: str


class RankDelta(msgspec.Struct, kw_only=True):
    """One rank's step breakdown in A and B."""

    rank: int
    metrics: list[Delta] = msgspec.field(default_factory=list)


class Share(msgspec.Struct, kw_only=True):
    """One part of the mean step-time change: a breakdown component and its share of it."""

    component: str  # "compute", "exposed comm", "exposed comm (tp)", "idle", "memcpy"
    delta_ms: float
    share: float  # of the mean step-time delta (signed; the parts add to 1)


class UnitDelta(msgspec.Struct, kw_only=True):
    """One FSDP unit's collectives, per rank and step, in A and B."""

    unit: str
    gather_ms_a: float
    gather_ms_b: float
    reduce_ms_a: float
    reduce_ms_b: float
    exposed_wait_ms_a: float
    exposed_wait_ms_b: float
    gathered_bytes_a: float
    gathered_bytes_b: float
    only_in: str = ""  # "A" or "B" when the unit exists on one side only


class CollectiveDelta(msgspec.Struct, kw_only=True):
    """One collective kind, per rank and step, in A and B; bandwidth is bytes over time."""

    kind: str
    count_a: float
    count_b: float
    bytes_a: float
    bytes_b: float
    ms_a: float
    ms_b: float
    exposed_ms_a: float
    exposed_ms_b: float
    gbps_a: float | None
    gbps_b: float | None


class GroupDelta(msgspec.Struct, kw_only=True):
    """One process group instance (its description and members), per step, in A and B: its
    communication time and the arrival skew and wait across its members."""

    group: str  # the description ("default_pg", "dp_shard", ...) else the name
    ranks: list[int]
    comm_ms_a: float | None  # None: no such group on that side
    comm_ms_b: float | None
    median_skew_ms_a: float | None = None
    median_skew_ms_b: float | None = None
    wait_caused_ms_a: float | None = None
    wait_caused_ms_b: float | None = None


class MemoryDelta(msgspec.Struct, kw_only=True):
    """Peak memory of one category (or "total"), the largest over ranks, in A and B."""

    category: str
    a_bytes: int | None
    b_bytes: int | None


class FindingChange(msgspec.Struct, kw_only=True):
    """A finding raised on one side only."""

    id: str
    severity: str
    title: str
    change: str  # "appeared" (in B only) or "gone" (in A only)


class ConfigChange(msgspec.Struct, kw_only=True):
    """A configuration key whose value differs (None: not recorded on that side)."""

    key: str
    a: str | int | float | bool | None
    b: str | int | float | bool | None


class OperatorChange(msgspec.Struct, kw_only=True):
    """An operator or kernel whose calls or time per step changed (HTA's trace-diff classes:
    "added", "deleted", "increased", "decreased")."""

    name: str
    device: str  # "cpu" or "gpu"
    change: str
    count_a: float
    count_b: float
    ms_a: float
    ms_b: float


class RunDiff(msgspec.Struct, kw_only=True):
    """What `zdiag diff A B` found (see the module docstring)."""

    schema: str = DIFF_SCHEMA
    zdiag_version: str = ""
    baseline: str = ""
    candidate: str = ""
    headline: str = ""  # the attribution in one sentence
    comparable: bool = True
    warnings: list[str] = msgspec.field(default_factory=list)
    steps_a: int = 0  # steps per rank analyzed (the fewest over ranks)
    steps_b: int = 0
    ranks_a: list[int] = msgspec.field(default_factory=list)
    ranks_b: list[int] = msgspec.field(default_factory=list)
    step: list[Delta] = msgspec.field(default_factory=list)  # the run's breakdown, per step
    shares: list[Share] = msgspec.field(default_factory=list)
    # what the traces measured of the host's own waits, per step: kernel-launch calls, the
    # DataLoader's `next()`, host syncs (counts); medians over steps (launches) or ranks
    idle_causes: list[Delta] = msgspec.field(default_factory=list)
    ranks: list[RankDelta] = msgspec.field(default_factory=list)
    units: list[UnitDelta] = msgspec.field(default_factory=list)
    collectives: list[CollectiveDelta] = msgspec.field(default_factory=list)
    groups: list[GroupDelta] = msgspec.field(default_factory=list)  # 2+ ranks
    memory: list[MemoryDelta] = msgspec.field(default_factory=list)
    findings: list[FindingChange] = msgspec.field(default_factory=list)
    config: list[ConfigChange] = msgspec.field(default_factory=list)
    operators: list[OperatorChange] = msgspec.field(default_factory=list)
    operators_unchanged: int = 0
    operators_complete: bool = True  # False: a side's table was cut, absent names may be small

    def step_time(self) -> Delta | None:
        """The median step time's delta (the first `step` metric)."""
        return next((d for d in self.step if d.metric == "step time"), None)


def encode_diff(diff: RunDiff) -> bytes:
    """The diff as JSON bytes (`zdiag diff --json`)."""
    return msgspec.json.encode(diff)


def decode_diff(data: bytes | str) -> RunDiff:
    """A diff from `encode_diff`'s bytes; ValueError naming the problem otherwise."""
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from exc
    if not isinstance(raw, dict) or raw.get("schema") != DIFF_SCHEMA:
        raise ValueError(f"not a {DIFF_SCHEMA} diff")
    try:
        return msgspec.convert(raw, RunDiff)
    except msgspec.ValidationError as exc:
        raise ValueError(f"malformed diff ({exc})") from exc
