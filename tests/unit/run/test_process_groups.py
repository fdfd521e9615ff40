"""Process groups across a run (analyzers/run/process_groups.py): members, communication, waiting."""

from __future__ import annotations

import numpy as np

from zdiag.analyzers.rank.collective_columns import RankColumns
from zdiag.analyzers.rank.declared_groups import ProcessGroupInfo, declared_groups
from zdiag.analyzers.run.crossrank_match import match_collectives
from zdiag.analyzers.run.process_groups import process_group_stats


def _rank(rank: int, calls: list[tuple[str, float, float]]) -> RankColumns:
    """A GPU rank's all-reduces: (group, start, end) each, in start order, one step (7)."""
    groups = sorted({g for g, _, _ in calls})
    return RankColumns(
        rank=rank,
        start_us=np.asarray([s for _, s, _ in calls]),
        end_us=np.asarray([e for _, _, e in calls]),
        kind=np.zeros(len(calls), dtype=np.int64),
        kinds=["all_reduce"],
        group=np.asarray([groups.index(g) for g, _, _ in calls], dtype=np.int64),
        groups=groups,
        step=np.full(len(calls), 7, dtype=np.int64),
    )


def _run() -> list[RankColumns]:
    """World group "0" on ranks 0-3 (on time), group "1" on ranks 2-3 where rank 3 arrives 2 ms
    late each of 4 times."""
    out = []
    for r in range(4):
        calls = []
        for i in range(4):
            t = i * 100_000.0
            calls.append(("0", t, t + 1_000.0))
            if r >= 2:
                late = 2_000.0 if r == 3 else 0.0
                calls.append(("1", t + 50_000.0 + late, t + 53_000.0))
        out.append(_rank(r, calls))
    return out


def test_groups_name_their_members_communication_and_the_rank_they_wait_for() -> None:
    ranks = _run()
    table = match_collectives(ranks).table
    declared = [ProcessGroupInfo(name="0", description="default_pg", size=4)]
    stats = process_group_stats(((c, 1, declared) for c in ranks), table)
    by_name = {g.name: g for g in stats}
    assert [g.name for g in stats] == ["1", "0"]  # 3-1 ms calls vs 1 ms: group 1 first
    one, world = by_name["1"], by_name["0"]
    assert one.ranks == [2, 3] and world.ranks == [0, 1, 2, 3]
    assert (world.description, world.declared_size) == ("default_pg", 4)
    assert (one.description, one.declared_size) == ("", None)
    assert world.calls_per_rank == one.calls_per_rank == 4.0
    assert world.comm_ms_per_step == 4.0  # 4 calls of 1 ms
    assert one.comm_ms_per_step == (4 * 3.0 + 4 * 1.0) / 2  # rank 2 waits 3 ms, rank 3 1 ms
    assert world.matched_collectives == one.matched_collectives == 4
    assert world.top_waiter is None and world.wait_caused_ms == 0.0
    assert (one.top_waiter, one.top_waiter_ms, one.wait_caused_ms) == (3, 8.0, 8.0)
    assert one.median_skew_ms == one.max_skew_ms == 2.0


def test_declared_groups_are_read_tolerantly() -> None:
    info = {
        "pg_config": [
            {"pg_name": "0", "pg_desc": "default_pg", "pg_size": 8, "ranks": list(range(8))},
            {"pg_name": 3, "pg_size": "8"},
            {"pg_name": "4", "ranks": [3, 1, 1]},
            {"pg_name": "5", "ranks": [0, "1"]},
            {"pg_name": "6", "ranks": [True, -1]},
            "not a group",
            {"pg_desc": "no name"},
        ]
    }
    assert declared_groups(info) == [
        ProcessGroupInfo(name="0", description="default_pg", size=8, ranks=list(range(8))),
        ProcessGroupInfo(name="3", description="", size=None),
        ProcessGroupInfo(name="4", ranks=[1, 3]),
        ProcessGroupInfo(name="5"),
        ProcessGroupInfo(name="6"),
    ]
    assert declared_groups(None) == declared_groups({"pg_config": "x"}) == []


def test_unnamed_calls_take_the_only_declared_group() -> None:
    """gloo ops carry no group name; a run that declares one group can only have used it."""
    ranks = [_rank(r, [("", 0.0, 1_000.0), ("", 10_000.0 + 500 * r, 11_000.0)]) for r in range(2)]
    declared = [ProcessGroupInfo(name="0", description="default_pg", size=2)]
    (g,) = process_group_stats(((c, 1, declared) for c in ranks), match_collectives(ranks).table)
    assert (g.name, g.description, g.declared_size) == ("", "default_pg", 2)
    two = [*declared, ProcessGroupInfo(name="1", description="tp", size=2)]
    (g,) = process_group_stats(((c, 1, two) for c in ranks), match_collectives(ranks).table)
    assert (g.description, g.declared_size) == ("", None)  # which one: unknown
