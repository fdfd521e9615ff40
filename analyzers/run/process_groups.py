"""Process groups across a run: who is in each, how much it communicates, who makes it wait.

Two sources, both already in the rank summaries:

- the trace header's `distributedInfo.pg_config` (torch >= 2.2 writes one entry per process
  group: `pg_name`, `pg_desc` such as "default_pg" or a user's group name, `pg_size`, `ranks`),
  kept per rank as `RankFacts.process_groups` (name, description, declared size, members);
- the per-call collective columns (their process-group name), which say which ranks used a
  group, how often and for how long; and the cross-rank matching's table, which says per group
  how far apart its ranks arrived and which rank made the others wait.

A group is an *instance*, its name and members (`RankColumns.group_members`): on a (2, 2) HSDP
mesh the shard groups {0,1} and {2,3} are two entries, each with its own ranks, calls, skew and
waiter, even where both carry one name.

`declared_groups(info)` is the map's part; `process_group_stats(summaries, table)` the reduce's
(one pass over the summaries' columns, O(ranks x groups) Python work), giving
`Report.process_groups` for the large-run views.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..rank.collective_columns import RankColumns
from ..rank.declared_groups import Members, ProcessGroupInfo
from ..report import ProcessGroupStats
from .crossrank import SKEW_NOISE_US, MatchTable


@dataclass
class _Group:
    ranks: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    comm_ms_per_step: list[float] = field(default_factory=list)
    kinds: set[str] = field(default_factory=set)


def process_group_stats(
    ranks: Iterable[tuple[RankColumns, int, list[ProcessGroupInfo]]], table: MatchTable
) -> list[ProcessGroupStats]:
    """Per process group (see the module docstring), from each rank's collective columns, its
    step count and declared groups, and the matching's table; the groups that communicate most
    per step first."""
    groups: dict[tuple[str, Members | None], _Group] = {}
    declared: dict[str, ProcessGroupInfo] = {}
    instances: dict[tuple[str, Members | None], ProcessGroupInfo] = {}
    analyzed: set[int] = set()
    for cols, n_steps, infos in ranks:
        analyzed.add(cols.rank)
        for info in infos:
            declared.setdefault(info.name, info)
            instances.setdefault((info.name, _members(info)), info)
        if not len(cols):
            continue
        code = np.asarray(cols.group, dtype=np.int64)
        n_groups = len(cols.groups)
        counts = np.bincount(code, minlength=n_groups)
        comm_us = np.bincount(code, weights=cols.end_us - cols.start_us, minlength=n_groups)
        pairs = np.unique(code * len(cols.kinds) + np.asarray(cols.kind, dtype=np.int64))
        for g, name in enumerate(cols.groups):
            if not counts[g]:
                continue
            acc = groups.setdefault((name, cols.members_of(g)), _Group())
            acc.ranks.append(cols.rank)
            acc.calls.append(int(counts[g]))
            acc.comm_ms_per_step.append(float(comm_us[g]) / 1000.0 / max(n_steps, 1))
        for p in pairs.tolist():
            g = p // len(cols.kinds)
            groups[cols.groups[g], cols.members_of(g)].kinds.add(cols.kinds[p % len(cols.kinds)])
    only = next(iter(declared.values())) if len(declared) == 1 else None
    keys = table_instances(table)
    out = [
        # unnamed calls of ranks that declare one group only (gloo ops carry no group name) are on it
        _stats(
            key,
            acc,
            instances.get(key) or declared.get(key[0]) or (only if key[0] == "" else None),
            table,
            keys,
        )
        for key, acc in groups.items()
    ]
    out += _declared_only(instances, set(groups), analyzed)
    out.sort(key=lambda s: (-s.comm_ms_per_step, s.name, s.ranks))
    return out


def _declared_only(
    instances: dict[tuple[str, Members | None], ProcessGroupInfo],
    used: set[tuple[str, Members | None]],
    analyzed: set[int],
) -> list[ProcessGroupStats]:
    """On a run with subgroups (a declared group not spanning every analyzed rank: a 2-D or 3-D
    mesh), the declared group instances no attributed call used (on gloo, whose calls name no
    group, all of them), each with its members, so that the report names every group the run
    has. Empty on single-group runs, whose reports stay as they were."""
    known = {k: info for k, info in instances.items() if k[1] is not None}
    if not any(not analyzed <= set(k[1] or ()) for k in known):
        return []
    return [
        ProcessGroupStats(
            name=name,
            description=info.description,
            declared_size=info.size,
            ranks=list(members or ()),
        )
        for (name, members), info in sorted(
            known.items(), key=lambda kv: (kv[0][0], kv[0][1] or ())
        )
        if (name, members) not in used
    ]


def _members(info: ProcessGroupInfo) -> Members | None:
    return tuple(info.ranks) if info.ranks is not None else None


def table_instances(table: MatchTable) -> list[tuple[str, Members | None]]:
    """The matching table's group instances (name, members), by group code."""
    return [(name, table.members_of(g)) for g, name in enumerate(table.groups)]


def _stats(
    key: tuple[str, Members | None],
    acc: _Group,
    info: ProcessGroupInfo | None,
    table: MatchTable,
    keys: list[tuple[str, Members | None]],
) -> ProcessGroupStats:
    name = key[0]
    codes = [g for g, k in enumerate(keys) if k == key]
    mine = np.flatnonzero(np.isin(table.group, codes))
    skew = table.skew_us[mine]
    noisy = mine[skew >= SKEW_NOISE_US]  # as Report.stragglers counts waiting
    waiter, waiter_ms = None, 0.0
    if len(noisy):
        uniq, inverse = np.unique(table.last_rank[noisy], return_inverse=True)
        wait = np.bincount(inverse.reshape(-1), weights=table.wait_caused_us[noisy])
        top = int(np.argmax(wait))
        waiter, waiter_ms = int(uniq[top]), round(float(wait[top]) / 1000.0, 3)
    return ProcessGroupStats(
        name=name,
        description=info.description if info else "",
        declared_size=info.size if info else None,
        ranks=sorted(acc.ranks),
        kinds=sorted(acc.kinds),
        calls_per_rank=round(float(statistics.median(acc.calls)), 1),
        comm_ms_per_step=round(statistics.fmean(acc.comm_ms_per_step), 3),
        matched_collectives=len(mine),
        median_skew_ms=round(float(np.median(skew)) / 1000.0, 4) if len(mine) else None,
        max_skew_ms=round(float(skew.max()) / 1000.0, 4) if len(mine) else None,
        wait_caused_ms=round(float(table.wait_caused_us[noisy].sum()) / 1000.0, 3),
        top_waiter=waiter,
        top_waiter_ms=waiter_ms,
    )
