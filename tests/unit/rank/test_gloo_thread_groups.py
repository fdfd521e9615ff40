"""gloo calls name no process group: on a rank of several groups they take the group of the
thread they ran on, from the threads the collectors recorded per group (`group_threads` in the
rank's manifest part)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.traces import TraceBuilder
from zdiag.analyzers.engine.summary_map import RunContexts
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.engine.summary_store import EMPTY_CONTEXT_KEY, apply_context, context_key
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.rank.collective_table import build_collectives
from zdiag.analyzers.rank.rank_analysis import RankContext, analyze_rank
from zdiag.analyzers.rank.summary import summarize
from zdiag.collectors.run_records import Manifest, RankEntry

SHARD = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
REPLICATE = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
STEP_US = 12_000.0


def _tids(rank: int) -> dict[str, int]:
    """Rank `rank`'s gloo thread per group: world "0", replicate "1"/"2", shard "3"/"4"."""
    return {
        "0": 1000 + rank * 100,
        "12"[rank % 2]: 1010 + rank * 100,  # replicate {0,2} is "1", {1,3} is "2"
        "34"[rank // 2]: 1020 + rank * 100,  # shard {0,1} is "3", {2,3} is "4"
    }


def _pg_config(rank: int) -> list[dict[str, object]]:
    return [
        {"pg_name": "0", "pg_desc": "default_pg", "pg_size": 4, "ranks": [0, 1, 2, 3]},
        {
            "pg_name": "12"[rank % 2],
            "pg_desc": "mesh_replicate",
            "pg_size": 2,
            "ranks": list(REPLICATE[rank]),
        },
        {
            "pg_name": "34"[rank // 2],
            "pg_desc": "mesh_shard",
            "pg_size": 2,
            "ranks": list(SHARD[rank]),
        },
    ]


def gloo_hsdp_job(folder: Path, slow_rank: int | None = None, thread_groups: bool = True) -> Path:
    """A 4-rank HSDP job on gloo as zdiag run records it: per step three all-gathers on the
    shard group's thread ({2,3} 1.5 ms after {0,1}), then an all-reduce on the replicate group's;
    no call names its group. `slow_rank` reaches each call 1.5 ms after its peer. The manifest
    says which thread is which group's (`thread_groups=False`: an older run's manifest)."""
    (folder / "traces").mkdir(parents=True)
    entries = []
    for r in range(4):
        b = TraceBuilder(rank=r, world_size=4, backend="gloo", gpu_name=None)
        b.doc["distributedInfo"]["pg_config"] = _pg_config(r)
        tid = _tids(r)
        shard_tid, repl_tid = tid["34"[r // 2]], tid["12"[r % 2]]
        late = 1_500.0 if r == slow_rank else 0.0
        for step in range(3):
            t0 = step * STEP_US
            b.step(step, t0, STEP_US - 500)
            b.cpu_op("aten::mm", t0 + 100, 2_500 + late)
            shift = 0.0 if SHARD[r] == (0, 1) else 1_500.0
            for i in range(3):
                start = t0 + 3_000 + shift + i * 2_000
                b.annotation("gloo:all_gather", start + late, 1_800 - late, tid=shard_tid)
            b.annotation("gloo:all_reduce", t0 + 9_500 + late, 1_500 - late, tid=repl_tid)
        b.write(folder / "traces" / f"rank-{r}.json")
        entry: dict[str, object] = {"rank": r, "trace": f"traces/rank-{r}.json"}
        if thread_groups:
            entry["group_threads"] = {name: [t, t + 1] for name, t in tid.items()}
        entries.append(entry)
    manifest = {"schema": "zdiag.manifest/1", "world_size": 4, "ranks": entries}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_a_gloo_call_takes_the_group_of_its_thread(tmp_path: Path) -> None:
    trace = load_rank_trace(gloo_hsdp_job(tmp_path / "run") / "traces" / "rank-2.json")
    assert set(build_collectives(trace).process_group) == {""}
    table = build_collectives(trace, {1220: "4", 1210: "1", 1200: "0", 99: "9"})
    assert table.process_group == ["4", "4", "4", "1"] * 3
    # a thread of a group the trace does not declare on this rank names none
    table = build_collectives(trace, {1220: "9", 1210: "1"})
    assert table.process_group == ["", "", "", "1"] * 3


def test_threads_name_no_group_on_a_rank_of_one_group_or_one_the_trace_does_not_declare(
    tmp_path: Path,
) -> None:
    trace = load_rank_trace(gloo_hsdp_job(tmp_path / "run") / "traces" / "rank-0.json")
    assert set(build_collectives(trace, {1020: "7", 1010: "8"}).process_group) == {""}
    assert trace.distributed_info is not None
    trace.distributed_info["pg_config"] = _pg_config(0)[:1]  # the world group only
    assert set(build_collectives(trace, {1020: "3", 1010: "1"}).process_group) == {""}


def test_the_manifest_gives_each_rank_its_threads_and_the_context_key_changes(
    tmp_path: Path,
) -> None:
    run = gloo_hsdp_job(tmp_path / "run")
    manifest = Manifest.from_json(json.loads((run / "manifest.json").read_text()))
    contexts = RunContexts.of(manifest)
    assert contexts.for_rank(3).thread_groups == {
        1300: "0",
        1301: "0",
        1310: "2",
        1311: "2",
        1320: "4",
        1321: "4",
    }
    assert contexts.key(3, 3) != RunContexts.of(None).key(3, 3)
    assert context_key(RankContext()) == EMPTY_CONTEXT_KEY


def test_gloo_calls_are_matched_within_their_true_group(tmp_path: Path) -> None:
    report = analyze_paths([gloo_hsdp_job(tmp_path / "run")])
    assert not [w for w in report.warnings if "name no process group" in w]
    groups = {(g.name, tuple(g.ranks)): g for g in report.process_groups}
    assert set(groups) == {
        ("0", (0, 1, 2, 3)),
        ("1", (0, 2)),
        ("2", (1, 3)),
        ("3", (0, 1)),
        ("4", (2, 3)),
    }
    assert groups["3", (0, 1)].matched_collectives == 9
    assert groups["4", (2, 3)].kinds == ["all_gather"]
    assert groups["2", (1, 3)].matched_collectives == 3
    for g in report.process_groups:
        assert g.max_skew_ms in (None, 0.0) and g.wait_caused_ms == 0.0, g
    assert not [f for f in report.findings if f.id == "straggler"]


def test_a_slow_gloo_rank_is_named_with_the_groups_it_delays(tmp_path: Path) -> None:
    report = analyze_paths([gloo_hsdp_job(tmp_path / "run", slow_rank=1)])
    (finding,) = [f for f in report.findings if f.id == "straggler"]
    assert finding.ranks == [1]
    assert "1 (delaying 2 [1, 3]; 3 [0, 1])" in finding.title
    groups = {(g.name, tuple(g.ranks)): g for g in report.process_groups}
    assert groups["3", (0, 1)].top_waiter == 1 and groups["2", (1, 3)].top_waiter == 1
    assert groups["4", (2, 3)].wait_caused_ms == 0.0


def test_without_recorded_threads_the_calls_stay_unattributed(tmp_path: Path) -> None:
    report = analyze_paths([gloo_hsdp_job(tmp_path / "run", thread_groups=False)])
    assert any("name no process group" in w for w in report.warnings)
    assert all(g.matched_collectives == 0 for g in report.process_groups)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, {}),
        ({"1": [5, 6], "2": [7]}, {5: "1", 6: "1", 7: "2"}),
        ({"1": [5, "x", -3, True, 2**70], "2": "nope"}, {5: "1"}),
        ({"1": [5], "2": [5, 6]}, {6: "2"}),  # a thread two groups claim names neither
    ],
)
def test_thread_groups_read_tolerantly(raw: object, expected: dict[int, str]) -> None:
    data: dict[str, object] = {"rank": 0}
    if raw is not None:
        data["group_threads"] = raw
    warnings: list[str] = []
    entry = RankEntry.from_json(data, "part", warnings)
    assert entry.thread_groups() == expected and not warnings
    assert ("group_threads" in entry.to_json()) == (raw is not None)


def test_a_part_whose_threads_are_not_an_object_loads_with_a_warning() -> None:
    warnings: list[str] = []
    entry = RankEntry.from_json({"rank": 0, "group_threads": [1, 2]}, "part", warnings)
    assert entry.group_threads is None and entry.thread_groups() == {}
    assert warnings and "group_threads" in warnings[0]


def test_a_stored_summary_is_reused_unless_its_gloo_calls_need_their_threads(
    tmp_path: Path,
) -> None:
    trace = load_rank_trace(gloo_hsdp_job(tmp_path / "run") / "traces" / "rank-0.json")
    threads = RankContext(thread_groups={1020: "3", 1010: "1"})
    summary = summarize(analyze_rank(trace))
    assert summary.rank_source == "distributedInfo"
    assert apply_context(summary, threads) is None  # groups of different members: re-map
    for g in summary.facts.process_groups:
        g.ranks = [0, 1, 2, 3]  # a rank whose groups all span the same ranks
    assert apply_context(summary, threads) is summary
