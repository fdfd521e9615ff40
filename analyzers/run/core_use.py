"""How busy each host's CPU cores were: the step logs' `cpu_ms` against the cores the ranks had.

Each rank's step log (RUN_DIR/steps/rank-N.jsonl) gives, per step, its process's CPU time
(`cpu_ms`, every thread), its live child processes' (`children_cpu_ms`: DataLoader workers;
absent in logs written before zdiag recorded it, and where /proc does not say) and the step's
wall time (`duration_ms`); its manifest entry gives the cores it could run on (`cpu_set`, its
affinity). On a host, the ranks' median `cpu_ms / duration_ms`, plus their children's CPU over
the same steps' time, summed is how many cores they kept busy per step (other jobs on the host
are not counted); the union of their affinities is how many they had. Where the two meet
(CORES_FULL_SHARE) the cores are full: a change that runs more work at once (gloo's worker
thread beside compute, a pipeline split that keeps more stages busy) cannot run it for free,
which no replay models (docs/whatif.md, limits).

Step 0 is left out (it holds the imports and the model build). A host is measured only when
every one of its ranks has both a `cpu_set` and steps with `cpu_ms`; each step log is read up to
MAX_STEP_LOG_BYTES, and a line that does not parse is skipped.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...collectors.run_records import Manifest, RankEntry

MAX_STEP_LOG_BYTES = 32 * 1024 * 1024
"""At most this much of a step log is read (100 000 lines of about 200 bytes fit)."""

CORES_FULL_SHARE = 0.9
"""The cores are full when the ranks kept at least this share of them busy per step: the rest
is the scheduler's slack and the steps' own spread."""


@dataclass(frozen=True)
class HostCores:
    """One host's cores and how many of them its ranks kept busy per step."""

    host: str
    ranks: tuple[int, ...]
    cores: int  # the union of the ranks' affinities
    busy: float  # cores kept busy per step by the ranks and their children, summed
    steps: int  # the fewest steps a rank's log gave
    children: bool = True  # every rank's step log recorded its child processes' CPU too

    @property
    def full(self) -> bool:
        """Whether the ranks kept (nearly) every core busy."""
        return self.busy >= CORES_FULL_SHARE * self.cores

    def sentence(self) -> str:
        """The measurement in words, e.g. "the 4 ranks on vm kept 1.9 of its 2 cores busy per
        step (the step logs' cpu_ms and children_cpu_ms, over 30 steps)"."""
        n = len(self.ranks)
        counted = (
            "cpu_ms and children_cpu_ms"
            if self.children
            else "cpu_ms; child processes such as DataLoader workers not recorded"
        )
        return (
            f"the {n} rank{'s' if n > 1 else ''} on {self.host} kept {self.busy:.1f} of its "
            f"{self.cores} core{'s' if self.cores > 1 else ''} busy per step (the step logs' "
            f"{counted}, over {self.steps} steps)"
        )

    def as_json(self) -> dict[str, object]:
        """The measurement as the report's and `zdiag whatif`'s JSON give it."""
        return {
            "host": self.host,
            "ranks": list(self.ranks),
            "cores": self.cores,
            "busy": round(self.busy, 3),
            "full": self.full,
            "children_counted": self.children,
            "sentence": self.sentence(),
        }


def parse_cpu_set(text: str | None) -> frozenset[int] | None:
    """The cores of a `cpu_set` ("0-3,8"); None when absent or not of that form."""
    if not text:
        return None
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            a, b = int(lo), int(hi or lo)
            if a < 0 or b < a or b - a > 1 << 16:
                return None
            cores.update(range(a, b + 1))
    except ValueError:
        return None
    return frozenset(cores)


def busy_cores(path: Path) -> tuple[float, int, bool] | None:
    """(cores busy: the median cpu_ms / duration_ms over the logged steps after step 0, plus
    their children_cpu_ms summed over their duration summed (the children are read at most
    every 0.1 s, a reading holding the steps since the last); how many steps; whether any line
    recorded the children) from one step log; None when it has no such step or cannot be
    read."""
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_STEP_LOG_BYTES)
    except OSError:
        return None
    shares = []
    kids_ms = wall_ms = 0.0
    children = False
    for line in data.splitlines():
        try:
            rec = json.loads(line)
            step, cpu, wall = rec["step"], rec["cpu_ms"], rec["duration_ms"]
            kids = rec.get("children_cpu_ms")
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        ok = all(isinstance(v, int | float) for v in (step, cpu, wall))
        if ok and step > 0 and wall > 0 and cpu >= 0:
            shares.append(cpu / wall)
            wall_ms += wall
            if isinstance(kids, int | float) and kids >= 0:  # read at most every 0.1 s
                kids_ms += kids
                children = True
    if not shares:
        return None
    return statistics.median(shares) + kids_ms / wall_ms, len(shares), children


def host_cores(manifest: Manifest | None, step_logs: Mapping[int, Path]) -> tuple[HostCores, ...]:
    """Each host whose every rank has a `cpu_set` and a step log with `cpu_ms`: its cores and
    how many its ranks kept busy (module docstring). Hosts are told apart by host name (two
    launchers on one machine share its cores), else by node rank."""
    if manifest is None:
        return ()
    by_host: dict[str, list[RankEntry]] = {}
    for e in manifest.ranks:
        if e.missing:
            continue
        key = e.host or (f"node {e.node_rank}" if e.node_rank is not None else "")
        by_host.setdefault(key, []).append(e)
    out = []
    for key, entries in sorted(by_host.items()):
        measured = _measured(entries, step_logs)
        if measured is None:
            continue
        cores, busy, steps, children = measured
        host = entries[0].host or key
        ranks = tuple(e.rank for e in entries)
        out.append(HostCores(host, ranks, len(cores), busy, steps, children))
    return tuple(out)


def _measured(
    entries: Sequence[RankEntry], step_logs: Mapping[int, Path]
) -> tuple[frozenset[int], float, int, bool] | None:
    """(the union of the ranks' cores, cores busy, fewest steps, children counted everywhere)
    or None when a rank lacks one."""
    cores: set[int] = set()
    busy, steps, children = 0.0, None, True
    for e in entries:
        mine = parse_cpu_set(e.cpu_set)
        log = step_logs.get(e.rank)
        share = busy_cores(log) if log is not None else None
        if mine is None or share is None:
            return None
        cores |= mine
        busy += share[0]
        steps = share[1] if steps is None else min(steps, share[1])
        children = children and share[2]
    return (frozenset(cores), busy, steps or 0, children) if cores else None


def busiest(hosts: Sequence[HostCores], ranks: Iterable[int] | None = None) -> HostCores | None:
    """The host whose ranks kept the largest share of its cores busy, among the hosts of
    `ranks` when given (None: none measured)."""
    if ranks is not None:
        wanted = set(ranks)
        hosts = [h for h in hosts if wanted & set(h.ranks)]
    return max(hosts, key=lambda h: h.busy / h.cores) if hosts else None
