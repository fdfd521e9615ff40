"""Synthesize an N-rank job from one real trace, with known faults injected (issue 16.6).

Every rank is a copy of one real Kineto trace (by default the harness's own
`sample_traces/none/traces/rank-0.json.gz`), with `distributedInfo` saying rank r of N and
`host_name` saying its node (`node-<r // ranks_per_node>`). On top of that:

- **stragglers** (`--straggler R`, repeatable; default one rank, N // 3 + 1): each collective of
  the rank starts `--straggler-delay-us` later (at most 90% of the collective's duration; its end
  is kept, since a collective ends when every rank has arrived), so it arrives last and the other
  ranks wait for it;
- **jitter**: every rank's collectives start up to `--jitter-us` later (uniform, seeded), below
  the cross-rank noise threshold, so that ties among healthy ranks are realistic;
- **a slow link** (`--slow-node K`, default the last node): the collectives of node K's ranks
  last `--slow-factor` times longer (their end is later, their start unchanged);
- **a hung rank** (`--hung R`, default N - 2): the trace stops early: at `--hung-at` (a fraction
  of the trace's span) its next collective never completes (it lasts to the end of the span) and
  nothing after its start is written.

Collectives are `ph: X` events named `nccl:*` / `gloo:*` (host and GPU annotations) and NCCL
kernels. Other events are written unchanged, as bytes serialized once, so a 1024-rank job of
2.9 MB ranks takes about a second per 100 ranks here. `OUT/synth-job.txt` records what was
injected (not a `.json`, so `zdiag analyze OUT` does not take it for a trace).

    python bench/synth_job.py /tmp/job1024 --ranks 1024
    python bench/synth_job.py /tmp/job256 --ranks 256 --source tests/data/deepspeed_zero2/traces/rank-0.json.gz

Write outputs to /tmp (or another scratch disk), never into the repository.
"""

from __future__ import annotations

import argparse
import gzip
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO / "sample_traces" / "none" / "traces" / "rank-0.json.gz"
STRAGGLER_MAX_SHARE = 0.9
"""A straggler's collective starts at most this share of its duration later (its end is kept)."""


@dataclass
class Faults:
    """What to inject (see the module docstring); ranks are None for "the default one"."""

    stragglers: list[int] = field(default_factory=list)
    straggler_delay_us: float = 5000.0
    jitter_us: float = 20.0
    slow_node: int | None = None
    slow_factor: float = 3.0
    hung: int | None = None
    hung_at: float = 0.6
    ranks_per_node: int = 8
    seed: int = 0


def is_collective(ev: dict[str, Any]) -> bool:
    """A collective event: `nccl:*` / `gloo:*` annotations and NCCL kernels (complete events)."""
    if ev.get("ph") != "X" or not isinstance(ev.get("ts"), int | float):
        return False
    name = str(ev.get("name", ""))
    if name.startswith(("nccl:", "gloo:")):
        return True
    return ev.get("cat") == "kernel" and "nccl" in name.lower()


def load_source(path: Path) -> dict[str, Any]:
    """The source trace's top-level object."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    doc = orjson.loads(data)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Kineto trace (no 'traceEvents' list)")
    return doc


class Template:
    """The source trace cut into unchanged byte segments around its collectives."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.header = {k: v for k, v in doc.items() if k != "traceEvents"}
        events: list[dict[str, Any]] = doc["traceEvents"]
        self.events = events
        self.collectives: list[dict[str, Any]] = []
        self.segments: list[bytes] = []  # segments[i] precedes collectives[i]; one more at the end
        chunk: list[dict[str, Any]] = []
        for ev in events:
            if is_collective(ev):
                self.segments.append(_inner(chunk))
                self.collectives.append(ev)
                chunk = []
            else:
                chunk.append(ev)
        self.segments.append(_inner(chunk))
        if not self.collectives:
            raise ValueError(
                "the source trace holds no collectives (nccl:/gloo: ops, NCCL kernels)"
            )
        timed = [e for e in events if e.get("ph") != "M" and isinstance(e.get("ts"), int | float)]
        self.start_us = min(float(e["ts"]) for e in timed)
        self.end_us = max(float(e["ts"]) + float(e.get("dur") or 0) for e in timed)


def _inner(events: Sequence[dict[str, Any]]) -> bytes:
    """The events as the inside of a JSON array (no brackets), b"" when none."""
    return orjson.dumps(list(events))[1:-1]


def _header(tpl: Template, rank: int, world: int, faults: Faults) -> dict[str, Any]:
    header = dict(tpl.header)
    info = dict(header.get("distributedInfo") or {"backend": "nccl"})
    info.update(rank=rank, world_size=world)
    pgs = info.get("pg_config")
    if isinstance(pgs, list):
        info["pg_config"] = [
            dict(pg, pg_size=world, ranks=list(range(world))) if isinstance(pg, dict) else pg
            for pg in pgs
        ]
    header["distributedInfo"] = info
    header["host_name"] = f"node-{rank // faults.ranks_per_node}"
    return header


def rank_bytes(tpl: Template, rank: int, world: int, faults: Faults) -> bytes:
    """One rank's trace as JSON bytes."""
    rng = random.Random(faults.seed * 1_000_003 + rank)
    straggler = rank in faults.stragglers
    slow = faults.slow_node is not None and rank // faults.ranks_per_node == faults.slow_node
    header = _header(tpl, rank, world, faults)
    colls = []
    for ev in tpl.collectives:
        ev = dict(ev)
        dur = float(ev.get("dur") or 0.0)
        ts = float(ev["ts"])
        late = rng.uniform(0.0, faults.jitter_us)
        if straggler:
            late += faults.straggler_delay_us
        late = min(late, STRAGGLER_MAX_SHARE * dur)
        ts, dur = ts + late, dur - late
        if slow:
            dur *= faults.slow_factor
        ev["ts"], ev["dur"] = round(ts, 3), round(dur, 3)
        colls.append(ev)
    if rank == faults.hung:
        return _hung_bytes(tpl, header, colls, faults.hung_at)
    parts = [tpl.segments[0]]
    for ev, seg in zip(colls, tpl.segments[1:], strict=True):
        parts.append(orjson.dumps(ev))
        parts.append(seg)
    body = b",".join(p for p in parts if p)
    head = orjson.dumps(header)
    return head[:-1] + b',"traceEvents":[' + body + b"]}"


def _hung_bytes(
    tpl: Template, header: dict[str, Any], colls: list[dict[str, Any]], hung_at: float
) -> bytes:
    """The hung rank: events up to its first collective after `hung_at` of the span; that
    collective lasts to the end of the span (it never completes); nothing after it starts."""
    cutoff = tpl.start_us + hung_at * (tpl.end_us - tpl.start_us)
    stuck = next((c for c in colls if float(c["ts"]) >= cutoff), colls[-1])
    stop = float(stuck["ts"])
    stuck["dur"] = round(tpl.end_us - stop, 3)
    replaced = {id(orig): new for orig, new in zip(tpl.collectives, colls, strict=True)}
    events = []
    for ev in tpl.events:
        ev = replaced.get(id(ev), ev)
        ts = ev.get("ts")
        if ev is stuck or ev.get("ph") == "M" or not isinstance(ts, int | float) or ts < stop:
            events.append(ev)
    return orjson.dumps(dict(header, traceEvents=events))


def default_faults(world: int, faults: Faults) -> Faults:
    """Fill the default ranks: straggler N // 3 + 1, slow node the last, hung rank N - 2."""
    nodes = max(1, (world + faults.ranks_per_node - 1) // faults.ranks_per_node)
    if not faults.stragglers:
        faults.stragglers = [min(world - 1, world // 3 + 1)]
    if faults.slow_node is None and nodes > 1:
        faults.slow_node = nodes - 1
    if faults.hung is None and world > 2:
        faults.hung = world - 2
    for r in [*faults.stragglers, *([faults.hung] if faults.hung is not None else [])]:
        if not 0 <= r < world:
            raise ValueError(f"rank {r} is outside 0..{world - 1}")
    if faults.hung is not None and faults.hung in faults.stragglers:
        raise ValueError(f"rank {faults.hung} cannot be both the hung rank and a straggler")
    return faults


def write_job(
    out: Path,
    world: int,
    source: Path = DEFAULT_SOURCE,
    faults: Faults | None = None,
    *,
    compress: bool = False,
) -> Faults:
    """Write OUT/rank-<r>.json (or .json.gz) for r in 0..world-1 and OUT/synth-job.txt; returns
    the faults injected (defaults filled)."""
    if world < 2:
        raise ValueError("a job needs at least 2 ranks")
    faults = default_faults(world, faults or Faults())
    tpl = Template(load_source(source))
    out.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        data = rank_bytes(tpl, rank, world, faults)
        if compress:
            (out / f"rank-{rank}.json.gz").write_bytes(gzip.compress(data, compresslevel=1))
        else:
            (out / f"rank-{rank}.json").write_bytes(data)
    lines = [
        f"source: {source}",
        f"ranks: {world} ({faults.ranks_per_node} per node)",
        f"stragglers: {faults.stragglers} (+{faults.straggler_delay_us:g} us per collective)",
        f"jitter_us: {faults.jitter_us:g}",
        f"slow_node: {faults.slow_node} (collectives x{faults.slow_factor:g})",
        f"hung: {faults.hung} (stops at {faults.hung_at:g} of the span)",
        f"seed: {faults.seed}",
    ]
    (out / "synth-job.txt").write_text("\n".join(lines) + "\n")
    return faults


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path, help="output folder (created)")
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    p.add_argument("--gzip", action="store_true", help="write .json.gz (level 1)")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--straggler", type=int, action="append", default=[])
    p.add_argument("--straggler-delay-us", type=float, default=5000.0)
    p.add_argument("--jitter-us", type=float, default=20.0)
    p.add_argument("--slow-node", type=int)
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--hung", type=int)
    p.add_argument("--hung-at", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    faults = Faults(
        stragglers=a.straggler,
        straggler_delay_us=a.straggler_delay_us,
        jitter_us=a.jitter_us,
        slow_node=a.slow_node,
        slow_factor=a.slow_factor,
        hung=a.hung,
        hung_at=a.hung_at,
        ranks_per_node=a.ranks_per_node,
        seed=a.seed,
    )
    try:
        write_job(a.out, a.ranks, a.source, faults, compress=a.gzip)
    except (ValueError, OSError) as exc:
        print(f"synth_job: {exc}", file=sys.stderr)
        return 2
    print((a.out / "synth-job.txt").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
