"""Process-group instances on a 2-D mesh (a 4-rank HSDP job): each group is its members, never
its name alone, in the matching, Report.process_groups and the straggler ranking."""

from __future__ import annotations

import zlib
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np

from support.mesh_traces import hsdp_job
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.rank.collective_columns import RankColumns
from zdiag.analyzers.rank.declared_groups import ProcessGroupInfo, group_members
from zdiag.analyzers.rank.rank_analysis import analyze_rank
from zdiag.analyzers.rank.summary import decode_summary, summarize
from zdiag.analyzers.run.crossrank_match import match_collectives


def test_groups_are_named_with_their_true_members(tmp_path: Path) -> None:
    report = analyze_paths([hsdp_job(tmp_path / "run")])
    groups = {(g.name, tuple(g.ranks)): g for g in report.process_groups}
    assert set(groups) == {
        ("1", (0, 2)),
        ("1", (1, 3)),
        ("2", (0, 1)),
        ("2", (2, 3)),
        ("0", (0, 1, 2, 3)),  # declared, carried no call
    }
    shard = groups["2", (0, 1)]
    assert (shard.description, shard.declared_size, shard.kinds) == (
        "mesh_shard",
        2,
        ["all_gather"],
    )
    assert shard.matched_collectives == 9 and shard.calls_per_rank == 9.0
    assert groups["1", (1, 3)].kinds == ["all_reduce"]
    assert groups["0", (0, 1, 2, 3)].calls_per_rank == 0.0


def test_groups_of_one_name_are_never_matched_against_each_other(tmp_path: Path) -> None:
    """The shard group {2,3} gathers 1.5 ms after {0,1}: matched by name, that would be 1.5 ms of
    skew and a straggler on a healthy run."""
    report = analyze_paths([hsdp_job(tmp_path / "run")])
    assert not [f for f in report.findings if f.id == "straggler"]
    for g in report.process_groups:
        assert g.max_skew_ms in (None, 0.0) and g.wait_caused_ms == 0.0, g
    assert all(s.wait_caused_ms == 0.0 for s in report.stragglers)


def test_a_slow_rank_in_one_shard_group_is_named_once_with_the_groups_it_delays(
    tmp_path: Path,
) -> None:
    report = analyze_paths([hsdp_job(tmp_path / "run", slow_rank=1)])
    (finding,) = [f for f in report.findings if f.id == "straggler"]
    assert finding.ranks == [1]
    assert "1 (delaying 1 [1, 3]; 2 [0, 1])" in finding.title
    per_rank = finding.evidence["per_rank"]
    assert isinstance(per_rank, dict) and list(per_rank) == ["1"]
    assert per_rank["1"]["compared_with"] == [0, 3]  # never rank 2: they share no group
    assert per_rank["1"]["delays_groups"] == ["1 [1, 3]", "2 [0, 1]"]
    groups = {(g.name, tuple(g.ranks)): g for g in report.process_groups}
    assert groups["2", (0, 1)].top_waiter == 1 and groups["1", (1, 3)].top_waiter == 1
    assert groups["2", (2, 3)].wait_caused_ms == groups["1", (0, 2)].wait_caused_ms == 0.0


def test_unnamed_calls_are_unattributed_only_among_groups_of_different_members() -> None:
    world = ProcessGroupInfo(name="0", ranks=[0, 1, 2, 3])
    shard = ProcessGroupInfo(name="3", ranks=[0, 1])
    assert group_members([world], ["", "0"]) == ([(0, 1, 2, 3), (0, 1, 2, 3)], set())
    assert group_members([world, shard], ["", "3", "9"]) == ([None, (0, 1), None], {0})
    assert group_members([ProcessGroupInfo(name="0")], [""]) == ([None], set())  # old summary


def _host_rank(rank: int, shift_us: float) -> RankColumns:
    """A host-collective rank (ends do not align, so matched by sequence) of the HSDP mesh: six
    all-gathers on its shard group, named "2" on every rank, `shift_us` into the step."""
    starts = np.asarray([shift_us + i * 2_000.0 for i in range(6)])
    shard = (0, 1) if rank < 2 else (2, 3)
    return RankColumns(
        rank=rank,
        start_us=starts,
        end_us=starts + 1_000.0 + 300.0 * rank,  # host threads finish apart
        kind=np.zeros(6, dtype=np.int64),
        kinds=["all_gather"],
        group=np.zeros(6, dtype=np.int64),
        groups=["2"],
        step=np.zeros(6, dtype=np.int64),
        ends_align=False,
        group_members=[shard],
    )


def test_host_collectives_are_matched_within_their_group_instance() -> None:
    """Sequence matching (host collectives) by name alone would pair the shard group {2,3}'s
    gathers, 1.5 ms later, with {0,1}'s: 1.5 ms of skew on every one."""
    result = match_collectives(_host_rank(r, 0.0 if r < 2 else 1_500.0) for r in range(4))
    t = result.table
    assert len(t) == 12 and set(t.n_ranks.tolist()) == {2}
    assert float(t.skew_us.max()) == 0.0
    assert sorted({m.members for m in result.matched}) == [(0, 1), (2, 3)]
    assert {tuple(m.ranks) for m in result.matched} == {(0, 1), (2, 3)}


def test_calls_of_no_known_group_are_left_out_with_a_warning() -> None:
    ranks = [_host_rank(r, 0.0) for r in range(2)]
    ranks = [replace(c, unattributed=frozenset({0})) for c in ranks]
    result = match_collectives(ranks)
    assert not len(result.table)
    assert any("name no process group" in w for w in result.warnings)


def test_summaries_written_before_members_were_kept_still_load(tmp_path: Path) -> None:
    """A summary's process groups without `ranks` (older summaries) decode with members None,
    and their calls keep matching by name."""
    trace = load_rank_trace(hsdp_job(tmp_path / "run") / "rank-0.json")
    summary = summarize(analyze_rank(trace))
    assert [g.ranks for g in summary.facts.process_groups] == [[0, 1, 2, 3], [0, 2], [0, 1]]
    assert list(summary.collective_columns().group_members) == [(0, 2), (0, 1)]
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(summary))
    for g in raw["facts"]["process_groups"]:
        del g["ranks"]
    old = decode_summary(zlib.compress(msgspec.msgpack.encode(raw)))
    assert [g.ranks for g in old.facts.process_groups] == [None, None, None]
    cols = old.collective_columns()
    assert list(cols.group_members) == [None, None] and not cols.unattributed
