"""Cross-rank matching, arrival skew and the straggler finding.

Synthetic runs are written as real Kineto JSON (one file per rank) and go through the whole
pipeline (`load_run` / `analyze_run`), so the loader's collectives table feeds the matching as it
does for users; the pure core (`match_collectives`) is also driven directly with columns.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import numpy as np
import pytest

from support.stages import Analysis, analyze_run, load_run
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.rank.collective_columns import RankCollectives
from zdiag.analyzers.report import Finding, StepBreakdown
from zdiag.analyzers.run import crossrank
from zdiag.analyzers.run.crossrank_match import match_collectives
from zdiag.analyzers.run.stragglers import chance_of_last, find_stragglers, straggler_stats

STEP_US = 40_000.0  # synthetic step length (room for the longest delays used below)
LAYERS = 4  # collectives per step
COMPUTE_US = 3_000.0  # compute before each collective
TRANSFER_US = 400.0  # the collective's own transfer time


def write_run(
    folder: Path,
    n_ranks: int,
    *,
    steps: int = 5,
    delay_us: dict[int, float] | None = None,
    clock_offset_us: dict[int, float] | None = None,
    jitter_us: float = 0.0,
    groups: list[list[int]] | None = None,
    drop: dict[int, set[int]] | None = None,
    seed: int = 0,
) -> list[Path]:
    """Write rank-N.json traces of a synthetic data-parallel run.

    Per step, LAYERS times: a compute kernel, then an all-reduce kernel. Rank r reaches each
    collective `delay_us[r]` late (plus uniform jitter); every rank of the group leaves it
    TRANSFER_US after the last one arrived (as a blocking collective does). `clock_offset_us`
    shifts a rank's whole clock; `groups` splits the ranks into process groups; `drop[r]`
    removes those collective indices (in trace order) from rank r, like a sampled trace.
    """
    delay_us = delay_us or {}
    clock_offset_us = clock_offset_us or {}
    groups = groups or [list(range(n_ranks))]
    drop = drop or {}
    rng = random.Random(seed)
    events: dict[int, list[dict[str, object]]] = {r: [] for r in range(n_ranks)}
    ids = dict.fromkeys(range(n_ranks), 0)
    t0 = 1_700_000_000_000_000.0
    coll_index = dict.fromkeys(range(n_ranks), 0)
    for step in range(steps):
        step_start = t0 + step * STEP_US
        for r in range(n_ranks):
            off = clock_offset_us.get(r, 0.0)
            events[r].append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": f"ProfilerStep#{step + 10}",
                    "pid": 100,
                    "tid": 100,
                    "ts": step_start + off,
                    "dur": STEP_US - 10,
                }
            )
        cursor = {r: step_start + 100.0 for r in range(n_ranks)}
        for _layer in range(LAYERS):
            for gi, members in enumerate(groups):
                arrive = {}
                for r in members:
                    start = cursor[r]
                    end = start + COMPUTE_US + delay_us.get(r, 0.0)
                    end += rng.uniform(0, jitter_us) if jitter_us else 0.0
                    ids[r] += 1
                    events[r].append(
                        {
                            "ph": "X",
                            "cat": "kernel",
                            "name": "ampere_sgemm_128x64_nn",
                            "pid": 0,
                            "tid": 7,
                            "ts": start + clock_offset_us.get(r, 0.0),
                            "dur": end - start,
                            "args": {"stream": 7, "correlation": ids[r], "External id": ids[r]},
                        }
                    )
                    arrive[r] = end
                leave = max(arrive.values()) + TRANSFER_US
                for r in members:
                    ids[r] += 1
                    idx = coll_index[r]
                    coll_index[r] += 1
                    cursor[r] = leave + 50.0
                    if idx in drop.get(r, set()):
                        continue
                    events[r].append(
                        {
                            "ph": "X",
                            "cat": "kernel",
                            "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                            "pid": 0,
                            "tid": 20,
                            "ts": arrive[r] + clock_offset_us.get(r, 0.0),
                            "dur": leave - arrive[r] + rng.uniform(0, 5),
                            "args": {
                                "stream": 20,
                                "correlation": ids[r],
                                "External id": ids[r],
                                "Collective name": "allreduce",
                                "In msg nelems": 1 << 20,
                                "Out msg nelems": 1 << 20,
                                "dtype": "Float",
                                "Group size": len(members),
                                "Process Group Name": str(gi),
                            },
                        }
                    )
    paths = []
    for r in range(n_ranks):
        p = folder / f"rank-{r}.json"
        p.write_text(
            json.dumps(
                {
                    "distributedInfo": {"backend": "nccl", "rank": r, "world_size": n_ranks},
                    "traceEvents": events[r],
                }
            )
        )
        paths.append(p)
    return paths


def _columns(rank: int, starts: list[float], ends: list[float], pg: str = "0") -> RankCollectives:
    n = len(starts)
    return RankCollectives(
        rank=rank,
        start_us=np.asarray(starts, dtype=np.float64),
        end_us=np.asarray(ends, dtype=np.float64),
        kind=["all_reduce"] * n,
        process_group=[pg] * n,
        step=np.full(n, -1, dtype=np.int64),
    )


# --- the pure core ---------------------------------------------------------------------------


def test_sequence_matching_measures_skew_and_last_arrival() -> None:
    # three collectives; rank 1 arrives 500 us late at each, all end together
    r0 = _columns(0, [0, 10_000, 20_000], [1_000, 11_000, 21_000])
    r1 = _columns(1, [500, 10_500, 20_500], [1_000, 11_000, 21_000])
    result = match_collectives([r1, r0])
    assert [m.method for m in result.matched] == ["sequence"] * 3
    assert all(m.ranks == [0, 1] for m in result.matched)
    assert [m.skew_us for m in result.matched] == [500, 500, 500]
    assert {m.last_rank for m in result.matched} == {1}
    stats = {s.rank: s for s in straggler_stats(result)}
    assert stats[1].last_arrivals == 3 and stats[0].last_arrivals == 0
    assert stats[1].wait_caused_ms == pytest.approx(1.5)
    assert stats[1].mean_skew_ms == pytest.approx(0.5)


def test_ties_below_the_noise_name_nobody() -> None:
    r0 = _columns(0, [0, 10_000], [1_000, 11_000])
    r1 = _columns(1, [10, 10_020], [1_000, 11_000])  # 10-20 us apart: launch jitter
    stats = straggler_stats(match_collectives([r0, r1]))
    assert all(s.last_arrivals == 0 for s in stats)


def test_clock_offset_is_removed_using_end_times() -> None:
    # rank 1's clock runs 5 ms ahead; it is not late at all
    r0 = _columns(0, [0, 10_000, 20_000], [1_000, 11_000, 21_000])
    r1 = _columns(1, [5_000, 15_000, 25_000], [6_000, 16_000, 26_000])
    result = match_collectives([r0, r1])
    assert result.clock_offset_us[1] == pytest.approx(-5_000)
    assert all(m.skew_us == pytest.approx(0) for m in result.matched)


def test_dropped_events_fall_back_to_end_time_matching() -> None:
    # rank 1 lost its 2nd collective (sampled trace): sequence numbers would pair wrongly
    r0 = _columns(0, [0, 10_000, 20_000, 30_000], [1_000, 11_000, 21_000, 31_000])
    r1 = _columns(1, [300, 20_300, 30_300], [1_000, 21_000, 31_000])
    result = match_collectives([r0, r1])
    assert len(result.matched) == 3
    assert all(m.method == "end-time" for m in result.matched)
    assert [m.end_us[0] for m in result.matched] == [1_000, 21_000, 31_000]
    assert all(m.last_rank == 1 and m.skew_us == pytest.approx(300) for m in result.matched)
    assert result.matched_per_rank == {0: 3, 1: 3}


def test_single_rank_has_nothing_to_compare() -> None:
    result = match_collectives([_columns(0, [0], [1_000])])
    assert result.matched == [] and find_stragglers(result) == []


# --- synthetic runs through the pipeline -----------------------------------------------------


def _stragglers(analysis: Analysis) -> list[Finding]:
    """The pipeline's straggler findings (the detector's output in the Report): the judgement
    of `find_stragglers` on the reduce's matching, with the gain the what-if replay gives."""
    found = find_stragglers(analysis.crossrank, analysis.breakdowns)
    reported = [f for f in analysis.report.findings if f.id == "straggler"]

    def judged(f: Finding) -> tuple[object, ...]:
        return (f.id, f.severity, f.ranks, f.steps, f.evidence, f.recommendation)

    assert [judged(f) for f in found] == [judged(f) for f in reported]
    assert all("--without-straggler" in f.gain_method for f in reported)
    return reported


def test_delayed_rank_is_named_with_its_cost(tmp_path: Path) -> None:
    write_run(tmp_path, 4, delay_us={2: 1_500.0}, jitter_us=20.0)
    run = load_run([tmp_path])
    analysis = analyze_run(run)
    stats = analysis.report.stragglers
    assert stats and stats[0].rank == 2  # worst first
    s2 = stats[0]
    assert s2.matched_collectives == 5 * LAYERS
    assert s2.last_arrivals == 5 * LAYERS
    # each of the 3 others waits ~1.5 ms at each of the 20 collectives
    assert s2.wait_caused_ms == pytest.approx(3 * 1.5 * 20, rel=0.05)
    findings = _stragglers(analysis)
    assert [f.id for f in findings] == ["straggler"]
    f = findings[0]
    assert f.ranks == [2]
    assert f.steps == [10, 11, 12, 13, 14]
    # gain: its lead over the next arrival, 1.5 ms (minus jitter) x 4 collectives per step
    assert f.expected_gain_ms == pytest.approx(1.5 * LAYERS, rel=0.05)
    assert f.evidence["per_rank"]["2"]["last_arrival_share"] == 1.0
    assert f.severity == "critical"  # 6 ms of a 40 ms step (>= 10%)
    for word in ("data loading", "jitter", "thermal", "uneven work"):
        assert word in f.recommendation
    # its compute is 50% longer than the others': the diagnosis says so
    assert "computes" in f.recommendation


def test_balanced_ranks_with_jitter_have_no_straggler(tmp_path: Path) -> None:
    write_run(tmp_path, 4, jitter_us=800.0, seed=3)
    run = load_run([tmp_path])
    analysis = analyze_run(run)
    assert len(analysis.report.stragglers) == 4
    assert max(s.last_arrivals for s in analysis.report.stragglers) < 0.5 * 5 * LAYERS
    assert _stragglers(analysis) == []


def test_small_delay_is_below_the_gain_threshold(tmp_path: Path) -> None:
    # 60 us late every time: consistently last, but 0.24 ms of a 40 ms step (< 2%)
    write_run(tmp_path, 2, delay_us={1: 60.0})
    run = load_run([tmp_path])
    analysis = analyze_run(run)
    assert analysis.report.stragglers[0].rank == 1
    assert analysis.report.stragglers[0].last_arrivals == 5 * LAYERS
    assert _stragglers(analysis) == []


def test_clock_offset_between_hosts_is_not_a_straggler(tmp_path: Path) -> None:
    write_run(tmp_path, 3, clock_offset_us={1: 7_000.0, 2: -3_000.0}, jitter_us=10.0)
    run = load_run([tmp_path])
    analysis = analyze_run(run)
    result = analysis.crossrank
    assert result.clock_offset_us[1] == pytest.approx(-7_000, abs=50)
    assert result.clock_offset_us[2] == pytest.approx(3_000, abs=50)
    assert _stragglers(analysis) == []


def test_straggler_found_despite_clock_offset_and_dropped_events(tmp_path: Path) -> None:
    write_run(
        tmp_path,
        2,
        delay_us={0: 2_000.0},
        clock_offset_us={1: 4_000.0},
        drop={1: {1, 6, 7}},
    )
    run = load_run([tmp_path])
    analysis = analyze_run(run)
    result = analysis.crossrank
    assert len(result.matched) == 5 * LAYERS - 3
    assert all(m.last_rank == 0 for m in result.matched)
    findings = find_stragglers(result, analysis.breakdowns)
    assert findings and findings[0].ranks == [0]


def test_process_groups_are_matched_separately(tmp_path: Path) -> None:
    # two groups {0,1} and {2,3}; rank 3 is late in its own group only
    write_run(tmp_path, 4, groups=[[0, 1], [2, 3]], delay_us={3: 1_500.0})
    run = load_run([tmp_path])
    analysis = analyze_run(run)
    result = analysis.crossrank
    assert {tuple(m.ranks) for m in result.matched} == {(0, 1), (2, 3)}
    assert {m.process_group for m in result.matched if m.ranks == [2, 3]} == {"1"}
    stats = {s.rank: s for s in analysis.report.stragglers}
    assert stats[3].last_arrivals == 5 * LAYERS
    assert stats[3].matched_collectives == 5 * LAYERS
    assert stats[2].last_arrivals == 0
    findings = find_stragglers(result, analysis.breakdowns)
    assert findings and findings[0].ranks == [3]


def test_two_stragglers_are_both_named(tmp_path: Path) -> None:
    write_run(tmp_path, 4, delay_us={1: 1_000.0, 3: 2_500.0}, seed=1)
    run = load_run([tmp_path])
    analysis = analyze_run(run)
    # rank 3 is last everywhere; rank 1 is never last, so only rank 3 is named
    findings = _stragglers(analysis)
    assert findings[0].ranks == [3]
    # lead over the next arrival (rank 1), not over the first
    assert findings[0].expected_gain_ms == pytest.approx(1.5 * LAYERS, rel=0.02)


def test_pipeline_fills_report_stragglers(tmp_path: Path) -> None:
    write_run(tmp_path, 2, delay_us={1: 1_000.0})
    report = analyze_paths([tmp_path])
    assert [s.rank for s in report.stragglers] == [1, 0]
    assert "straggler_skew_noise_us" in report.thresholds


# --- the real two-rank pair -------------------------------------------------------------------


def test_sampled_128_pair(real_traces: Path) -> None:
    """Two ranks of a 128-rank job with sampled events: counts match but sequence pairs do not
    end together, so matching must fall back to end times; every matched pair must then really
    end together, and its skew is what the stats report."""
    run = load_run([real_traces / "hta" / "sampled_128"])
    analysis = analyze_run(run)
    result = analysis.crossrank
    assert result.ranks == [0, 1]
    assert result.matched, result.warnings
    for m in result.matched:
        assert m.ranks == [0, 1]
        assert abs(m.end_us[0] - m.end_us[1]) <= max(
            crossrank.END_MATCH_MIN_TOL_US,
            crossrank.END_MATCH_REL_TOL
            * min(e - s for s, e in zip(m.start_us, m.end_us, strict=True)),
        )
    # this host pair shares a clock: the estimated offset is within the end tolerance
    assert abs(result.clock_offset_us[1]) <= crossrank.END_MATCH_MIN_TOL_US
    stats = {s.rank: s for s in analysis.report.stragglers}
    assert stats[0].matched_collectives == stats[1].matched_collectives == len(result.matched)
    assert stats[0].last_arrivals + stats[1].last_arrivals <= len(result.matched)
    # in these traces rank 1 starts every matched send/recv after rank 0 (by 0.08-22 ms)
    assert stats[1].last_arrivals >= stats[0].last_arrivals
    for f in find_stragglers(result, analysis.breakdowns):
        assert f.id == "straggler" and f.ranks == [1]
        assert f.expected_gain_ms is not None and f.expected_gain_ms > 0


def test_ranks_without_common_step_numbers_are_matched_over_the_whole_trace() -> None:
    r0 = _columns(0, [0, 10_000], [1_000, 11_000])
    r1 = _columns(1, [400, 10_400], [1_000, 11_000])
    r0.step[:] = [5, 6]  # rank 0 has ProfilerSteps, rank 1 none
    result = match_collectives([r0, r1])
    assert len(result.matched) == 2 and all(m.last_rank == 1 for m in result.matched)
    assert any("do not overlap" in w for w in result.warnings)


def test_loose_ends_keep_sequence_matching_and_synchronized_clocks() -> None:
    # CPU/gloo-like: ranks finish each collective milliseconds apart, so ends never line up;
    # the sequence numbers are the evidence and no clock offset is invented
    rng = random.Random(7)
    starts0 = [i * 100_000.0 for i in range(12)]
    ends0 = [s + 20_000 + rng.uniform(0, 8_000) for s in starts0]
    starts1 = [s + 3_000 for s in starts0]
    ends1 = [e + rng.uniform(-8_000, 8_000) for e in ends0]
    result = match_collectives([_columns(0, starts0, ends0), _columns(1, starts1, ends1)])
    assert result.clock_offset_us == {0: 0.0, 1: 0.0}
    assert len(result.matched) == 12 and {m.method for m in result.matched} == {"sequence"}
    assert all(m.last_rank == 1 and m.skew_us == pytest.approx(3_000) for m in result.matched)
    assert any("do not line up" in w for w in result.warnings)


def test_too_few_collectives_are_not_evidence() -> None:
    # 2 ranks, rank 1 last at 4 of 5 collectives by 5 ms: p = 0.19 under chance, no finding
    starts0 = [i * 100_000.0 for i in range(5)]
    ends0 = [s + 10_000 for s in starts0]
    starts1 = [s + (5_000 if i < 4 else -5_000) for i, s in enumerate(starts0)]
    result = match_collectives([_columns(0, starts0, ends0), _columns(1, starts1, ends0)])
    stats = {s.rank: s for s in straggler_stats(result)}
    assert stats[1].last_arrivals == 4
    assert chance_of_last(4, 5, 2) == pytest.approx(6 / 32)
    assert find_stragglers(result) == []
    # the same lateness at all of 8 collectives is (p = 1/256)
    starts0 = [i * 100_000.0 for i in range(8)]
    ends0 = [s + 10_000 for s in starts0]
    result = match_collectives(
        [_columns(0, starts0, ends0), _columns(1, [s + 5_000 for s in starts0], ends0)]
    )
    assert [f.ranks for f in find_stragglers(result)] == [[1]]


def _host_side(rc: RankCollectives) -> RankCollectives:
    rc.ends_align = False
    return rc


def test_host_collectives_chance_end_agreement_does_not_invent_a_clock_offset() -> None:
    # gloo-like ranks finish collectives milliseconds apart; a quarter of the ends agreeing on
    # one offset by chance must not turn on end-time matching (it paired 10 of 28 on a real run)
    rng = random.Random(3)
    starts0 = [i * 50_000.0 for i in range(28)]
    ends0 = [s + 10_000 for s in starts0]
    starts1 = [s + 2_000 for s in starts0]
    ends1 = [e + (600.0 if i % 4 == 0 else rng.uniform(-8_000, 8_000)) for i, e in enumerate(ends0)]
    device = match_collectives([_columns(0, starts0, ends0), _columns(1, starts1, ends1)])
    assert (
        device.clock_offset_us[1] != 0.0
    )  # the premise: on device ranks this looks like an offset
    host = match_collectives(
        [_host_side(_columns(0, starts0, ends0)), _host_side(_columns(1, starts1, ends1))]
    )
    assert host.clock_offset_us == {0: 0.0, 1: 0.0}
    assert len(host.matched) == 28 and {m.method for m in host.matched} == {"sequence"}
    assert all(m.last_rank == 1 and m.skew_us == pytest.approx(2_000) for m in host.matched)
    assert not any("differ" in w or "do not line up" in w for w in host.warnings)


def _steps(exposed_comm_ms: float) -> list[StepBreakdown]:
    return [
        StepBreakdown(
            step=s,
            duration_ms=100.0,
            compute_ms=80.0,
            comm_ms=20.0,
            overlapped_ms=20.0 - exposed_comm_ms,
            exposed_comm_ms=exposed_comm_ms,
            idle_ms=20.0 - exposed_comm_ms,
            verdict="compute-bound",
        )
        for s in range(3)
    ]


def test_straggler_gain_is_capped_by_the_waiting_ranks_exposed_communication() -> None:
    # rank 1 arrives 3 ms late at 12 collectives: 36 ms of lead, but rank 0 only has 5 ms of
    # exposed communication per step; the rest of its wait was hidden behind its compute
    starts0 = [i * 100_000.0 for i in range(12)]
    ends0 = [s + 20_000 for s in starts0]
    starts1 = [s + 3_000 for s in starts0]
    result = match_collectives([_columns(0, starts0, ends0), _columns(1, starts1, ends0)])
    uncapped = find_stragglers(result)
    assert uncapped and uncapped[0].expected_gain_ms == pytest.approx(36.0)
    (capped,) = find_stragglers(result, {0: _steps(5.0), 1: _steps(5.0)})
    assert capped.expected_gain_ms == pytest.approx(5.0)
    assert capped.evidence["per_rank"]["1"]["lead_over_next_ms_per_step"] == pytest.approx(36.0)
    # fully hidden waits (1 ms exposed, under 2% of the 100 ms step) cost nothing worth a finding
    assert find_stragglers(result, {0: _steps(1.0), 1: _steps(1.0)}) == []


def _step_collectives(
    slow_rank: int | None, n_steps: int = 4, per_step: int = 12
) -> crossrank.CrossRankResult:
    """Two ranks, `per_step` collectives per step; jitter alternates who is last by 0.2 ms; when
    `slow_rank` is set, it arrives 400 ms late at the first collective of each step only."""
    rng = random.Random(7)
    matched = []
    t = 0.0
    for step in range(n_steps):
        for i in range(per_step):
            late = [0.0, 0.0]
            late[rng.randrange(2)] = 200.0
            if slow_rank is not None and i == 0:
                late[slow_rank] += 400_000.0
            starts = [t + late[0], t + late[1]]
            ends = [max(starts) + 1000.0] * 2
            matched.append(
                crossrank.MatchedCollective("pg0", "all_gather", step, i, [0, 1], starts, ends)
            )
            t = ends[0] + 5000.0
        t += 10_000.0
    return crossrank.CrossRankResult.from_matched([0, 1], matched)


def _even_steps(ms: float, n_steps: int = 4) -> dict[int, list[StepBreakdown]]:
    return {
        r: [
            StepBreakdown(
                step=s,
                duration_ms=ms,
                compute_ms=ms / 2,
                comm_ms=ms / 2,
                overlapped_ms=0.0,
                exposed_comm_ms=ms / 2,
                idle_ms=0.0,
                verdict="comm-bound",
            )
            for s in range(n_steps)
        ]
        for r in (0, 1)
    }


def test_rank_late_once_per_step_is_a_straggler_by_the_wait_it_causes() -> None:
    """One late arrival per step (1 of 12 collectives: far under the share rule) that makes the
    other rank wait 400 ms in every step is named, with the wait as the gain; no GPU advice when
    the run trained on CPUs."""
    found = find_stragglers(_step_collectives(slow_rank=1), _even_steps(500.0), gpu=False)
    assert [f.ranks for f in found] == [[1]]
    f = found[0]
    assert f.expected_gain_ms == pytest.approx(250.0, rel=0.01)  # capped by exposed comm
    assert f.evidence["per_rank"]["1"]["steps_causing_wait"] == 4
    assert "nvidia-smi" not in f.recommendation and "GPU" not in f.recommendation


def test_jitter_alone_makes_no_straggler() -> None:
    """Random 0.2 ms lateness spread over both ranks: no rank dominates the wait it causes."""
    assert find_stragglers(_step_collectives(slow_rank=None), _even_steps(500.0)) == []


def test_ranks_sharing_one_cpu_host_get_at_most_a_warning() -> None:
    """On one host's CPUs a late rank may be contention from other processes: the finding
    stays when the rank shows its own cause (here it idles 400 ms more per step, as a rank that
    sleeps), at most a warning, and says to confirm on a quiet host."""
    result = _step_collectives(slow_rank=1)
    steps = _even_steps(500.0)
    steps[1] = [msgspec.structs.replace(b, idle_ms=400.0) for b in steps[1]]
    (crit,) = find_stragglers(result, steps, gpu=False)
    assert crit.severity == "critical"
    (warn,) = find_stragglers(result, steps, gpu=False, shared_cpu_host=True)
    assert warn.severity == "warning" and "quiet host" in warn.recommendation


def test_late_rank_without_its_own_cause_on_a_shared_cpu_host_is_contention() -> None:
    """A rank as late, computing and idling exactly as much as the other (the time went in its
    collectives, to the shared cores): named on separate hosts, not on one shared CPU host."""
    result = _step_collectives(slow_rank=1)
    assert find_stragglers(result, _even_steps(500.0), gpu=False)
    assert find_stragglers(result, _even_steps(500.0), gpu=False, shared_cpu_host=True) == []


def test_straggler_words_match_its_evidence_and_the_device() -> None:
    """Issue 30: a rank named by the wait it causes is last at few collectives (42% here),
    under the share bar its evidence shows: the title says which rule named it. On a CPU-only
    run its diagnosis speaks of its host thread, never of a device."""
    result = _step_collectives(slow_rank=1)
    steps = _even_steps(500.0)
    steps[1] = [msgspec.structs.replace(b, idle_ms=400.0) for b in steps[1]]
    (cpu,) = find_stragglers(result, steps, gpu=False)
    assert cpu.evidence["min_last_share"] == 0.75
    named = "(last at 42% of collectives, under the 75% bar: named by the wait it causes in most"
    assert named in cpu.title
    assert "Its host thread idles 400.00 ms per step" in cpu.recommendation
    assert "device" not in cpu.recommendation
    (gpu,) = find_stragglers(result, steps, gpu=True)
    assert "Its device idles 400.00 ms per step" in gpu.recommendation
