"""Process-group members from the collective calls themselves (`Process Group Ranks`), for traces
whose header lists no `pg_config` members (issue 26)."""

from __future__ import annotations

import json
from pathlib import Path

from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.rank.declared_groups import ProcessGroupInfo, groups_from_calls
from zdiag.analyzers.rank.rank_analysis import rank_facts


def _kernel(ts: float, pg: str, ranks: str, desc: str) -> dict[str, object]:
    args = {
        "Collective name": "allreduce",
        "Process Group Name": pg,
        "Process Group Ranks": ranks,
        "Process Group Description": desc,
        "In msg nelems": 1024,
        "Out msg nelems": 1024,
        "dtype": "Float",
    }
    return {
        "ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)",
        "ts": ts, "dur": 50.0, "pid": 0, "tid": 7, "args": args,
    }  # fmt: skip


def test_calls_complete_the_header(tmp_path: Path) -> None:
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0.0, "dur": 10.0, "pid": 0, "tid": 7},
        _kernel(100.0, "1", "[0, 2]", "mesh_replicate"),
        _kernel(200.0, "3", "[0, 1]", "mesh_shard"),
        _kernel(300.0, "3", "[0, 1]", "mesh_shard"),
    ]
    header = {"backend": "nccl", "rank": 0, "world_size": 4}  # no pg_config (older torch)
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": header}))
    groups = {g.name: g for g in rank_facts(load_rank_trace(path)).process_groups}
    assert groups["1"].ranks == [0, 2] and groups["1"].description == "mesh_replicate"
    assert groups["3"].ranks == [0, 1] and groups["3"].size == 2


def test_the_header_wins_and_bad_lists_are_ignored() -> None:
    header = [ProcessGroupInfo(name="0", description="default_pg", size=4, ranks=[0, 1, 2, 3])]
    calls = [
        {"Process Group Name": "0", "Process Group Ranks": "[0, 1]"},  # the header knows better
        {"Process Group Name": "5", "Process Group Ranks": "[]"},
        {"Process Group Name": "6", "Process Group Ranks": "[0, x]"},
        {"Process Group Name": "7", "Process Group Ranks": "[" + "1, " * 400_000 + "2]"},
        {"Process Group Name": "8"},
    ]
    out = {g.name: g for g in groups_from_calls(header, calls)}
    assert out == {"0": header[0]}
