"""How busy each host's cores were (analyzers/run/core_use.py): the step logs' cpu_ms against the
cores in the ranks' affinities, and the findings that state it."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from support.ledger_traces import BLOCKS, fsdp2_cpu_trace, write
from support.trace_contexts import trace_context
from zdiag.analyzers.detectors import missing_overlap
from zdiag.analyzers.report import StepBreakdown
from zdiag.analyzers.run import core_use
from zdiag.analyzers.run.core_use import HostCores, busy_cores, host_cores, parse_cpu_set
from zdiag.collectors.rank_part import cpu_set_text
from zdiag.collectors.run_records import Manifest


def _log(
    path: Path, steps: list[tuple[float, float]], extra: str = "", children: float | None = None
) -> Path:
    """A step log of (duration_ms, cpu_ms) steps, numbered from 0; `children`: each step's
    children_cpu_ms (None: the key absent, as in logs from before zdiag recorded it)."""
    kids = {} if children is None else {"children_cpu_ms": children}
    lines = [
        json.dumps({"step": i, "time_unix": 1.0 + i, "duration_ms": d, "cpu_ms": c, **kids})
        for i, (d, c) in enumerate(steps)
    ]
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def test_cpu_sets_round_trip_and_bad_ones_are_refused() -> None:
    assert parse_cpu_set("0-3,8,10-11") == frozenset({0, 1, 2, 3, 8, 10, 11})
    for bad in (None, "", "a-b", "3-1", "-1", "0-99999999"):
        assert parse_cpu_set(bad) is None
    if hasattr(os, "sched_getaffinity"):
        assert parse_cpu_set(cpu_set_text()) == frozenset(os.sched_getaffinity(0))


def test_a_step_logs_busy_share_leaves_out_step_0_and_damaged_lines(tmp_path: Path) -> None:
    # step 0 (imports, model build) at 10 cores' worth would move the median if counted
    log = _log(
        tmp_path / "rank-0.jsonl",
        [(1000.0, 10_000.0), (100.0, 150.0), (100.0, 170.0), (100.0, 160.0)],
        extra='{"step": 4, "duration_ms": "x", "cpu_ms": 1}\nnot json\n{"step": 5}\n',
    )
    share, n, children = busy_cores(log) or (0.0, 0, True)
    assert n == 3 and share == pytest.approx(1.6) and not children
    # DataLoader workers' CPU (children_cpu_ms) counts: 0.4 cores more
    kids = _log(tmp_path / "kids.jsonl", [(100.0, 150.0)] * 4, children=40.0)
    assert busy_cores(kids) == (pytest.approx(1.9), 3, True)
    old = _log(tmp_path / "old.jsonl", [(100.0, 1.0)])  # step 0 only
    assert busy_cores(old) is None
    assert busy_cores(tmp_path / "absent.jsonl") is None


def test_a_step_log_is_read_up_to_its_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _log(
        tmp_path / "rank-0.jsonl", [(100.0, 50.0)] + [(100.0, 100.0)] * 3 + [(100.0, 200.0)] * 9
    )
    full = busy_cores(log)
    assert full is not None and full[1] == 12
    four_lines = sum(len(line) for line in log.read_bytes().splitlines(keepends=True)[:4])
    monkeypatch.setattr(core_use, "MAX_STEP_LOG_BYTES", four_lines + 10)  # and a cut fifth
    capped = busy_cores(log)
    assert capped is not None and capped[1] == 3 and capped[0] == pytest.approx(1.0)


def _manifest(cpu_sets: list[str | None], nodes: list[int]) -> Manifest:
    ranks = [
        {"rank": r, "host": f"h{n}", "node_rank": n, **({"cpu_set": c} if c else {})}
        for r, (c, n) in enumerate(zip(cpu_sets, nodes, strict=True))
    ]
    return Manifest.from_json({"world_size": len(ranks), "ranks": ranks})


def test_hosts_sum_their_ranks_busy_cores_over_the_union_of_their_affinities(
    tmp_path: Path,
) -> None:
    logs = {
        r: _log(tmp_path / f"rank-{r}.jsonl", [(1.0, 1.0)] + [(100.0, busy)] * 3)
        for r, busy in enumerate((95.0, 90.0, 40.0, 30.0))
    }
    # node 0: two ranks sharing cores 0-1, 1.85 busy: full; node 1: pinned 2 + 2 cores, 0.7 busy
    hosts = host_cores(_manifest(["0-1", "0-1", "0-1", "2-3"], [0, 0, 1, 1]), logs)
    assert [(h.host, h.ranks, h.cores) for h in hosts] == [("h0", (0, 1), 2), ("h1", (2, 3), 4)]
    assert hosts[0].busy == pytest.approx(1.85) and hosts[0].full
    assert hosts[1].busy == pytest.approx(0.7) and not hosts[1].full
    assert core_use.busiest(hosts) is hosts[0]
    assert hosts[0].sentence() == (
        "the 2 ranks on h0 kept 1.9 of its 2 cores busy per step (the step logs' cpu_ms; child "
        "processes such as DataLoader workers not recorded, over 3 steps)"
    )
    assert not hosts[0].children
    # a rank without an affinity or a log leaves its host unmeasured
    assert [
        h.host for h in host_cores(_manifest(["0-1", None, "0-1", "2-3"], [0, 0, 1, 1]), logs)
    ] == ["h1"]
    del logs[3]
    assert [h.host for h in host_cores(_manifest(["0-1"] * 4, [0, 0, 1, 1]), logs)] == ["h0"]
    assert host_cores(None, logs) == ()
    # two launchers on one machine: node ranks 0 and 1, one host name, its cores shared
    one_machine = Manifest.from_json(
        {"world_size": 3, "ranks": [{"rank": r, "host": "vm", "node_rank": r // 2,
                                     "cpu_set": "0-1"} for r in range(3)]}
    )  # fmt: skip
    (vm,) = host_cores(one_machine, logs)
    assert vm.ranks == (0, 1, 2) and vm.cores == 2 and vm.busy == pytest.approx(2.25)


@pytest.mark.parametrize(
    "busy, says",
    [
        (1.9, "the cores are full, the gain an upper bound"),
        (1.2, "(the step logs' cpu_ms and children_cpu_ms, over 30 steps): not full"),
    ],
)
def test_a_core_sharing_gain_states_the_measured_cores(
    tmp_path: Path, busy: float, says: str
) -> None:
    """missing-overlap on a CPU FSDP2 run replays the unshard async op: gloo's worker thread
    then runs beside compute, and the gain says whether the cores were full."""
    ctx = trace_context(write(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=2)))
    cpu_step = StepBreakdown(
        step=1, duration_ms=10.0, compute_ms=5.0, comm_ms=5.0, overlapped_ms=0.0,
        exposed_comm_ms=5.0, idle_ms=0.0, verdict="comm-bound",
    )  # fmt: skip
    plain = dataclasses.replace(ctx, breakdowns={0: [cpu_step]})
    (f,) = missing_overlap.detect(plain)
    assert "an upper bound where the ranks fill them" in f.gain_method
    measured = dataclasses.replace(plain, host_cores=(HostCores("vm", (0, 1), 2, busy, 30),))
    (g,) = missing_overlap.detect(measured)
    assert f"the 2 ranks on vm kept {busy:.1f} of its 2 cores busy per step" in g.gain_method
    assert g.gain_method.count(says) == 1 and "where the ranks fill them" not in g.gain_method


def test_host_bound_on_a_host_whose_cores_are_full_says_so_and_adds_no_workers() -> None:
    """A host-bound run whose host kept every core busy: the finding states the measured cores
    and, for data loading, does not propose more DataLoader workers."""
    from zdiag.analyzers.detectors.context import DetectorContext
    from zdiag.analyzers.detectors.step_verdicts import detect_host_bound
    from zdiag.analyzers.rank.rank_analysis import RankFacts

    bds = [
        StepBreakdown(step=i, duration_ms=100.0, compute_ms=40.0, comm_ms=0.0, overlapped_ms=0.0,
                      exposed_comm_ms=0.0, idle_ms=60.0, verdict="host-bound")
        for i in range(3)
    ]  # fmt: skip
    loader = RankFacts(data_loading_ms=150.0)  # 50 ms per step: the largest part

    def finding(busy: float) -> str:
        ctx = DetectorContext(
            ledgers={}, facts={0: loader}, breakdowns={0: bds},
            host_cores=(HostCores("vm", (0,), 2, busy, 20),),
        )  # fmt: skip
        (f,) = detect_host_bound(ctx)
        return " ".join(f.recommendation.split())

    full, room = finding(1.9), finding(1.0)
    assert "The host's CPU cores are full (the 1 rank on vm kept 1.9 of its 2 cores" in full
    assert "more DataLoader workers would compete with the ranks" in full
    assert "the ranks, their threads and their worker processes compete" in full
    assert "num_workers" not in full
    assert "cores are full" not in room and "more DataLoader workers (num_workers)" in room
