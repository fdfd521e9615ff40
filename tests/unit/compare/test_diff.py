"""`diff_reports` on hand-made Reports: deltas against the spread, the attribution sentence,
comparability, units per rank holding them, operators in HTA's classes, configuration keys."""

from __future__ import annotations

import pytest

from zdiag.analyzers.compare.diff import NotComparable, diff_reports
from zdiag.analyzers.compare.model import decode_diff, encode_diff
from zdiag.analyzers.compare.spread import delta
from zdiag.analyzers.report import (
    Finding,
    FsdpUnit,
    MemoryTimeline,
    OperatorRow,
    OperatorTable,
    RankReport,
    Report,
    StepBreakdown,
)


def _step(i: int, compute: float, exposed: float, idle: float = 5.0) -> StepBreakdown:
    return StepBreakdown(
        step=i,
        duration_ms=compute + exposed + idle,
        compute_ms=compute,
        comm_ms=exposed + 10.0,
        overlapped_ms=10.0,
        exposed_comm_ms=exposed,
        idle_ms=idle,
        verdict="compute-bound",
    )


def _report(
    *,
    exposed: float = 10.0,
    ranks: int = 2,
    steps: int = 6,
    device: str = "cuda",
    jitter: float = 1.0,
    config: dict[str, object] | None = None,
    recorded: bool = True,
    **extra: object,
) -> Report:
    rank_reports = [
        RankReport(
            rank=r,
            device=device,
            steps=[
                _step(i, 100.0 + jitter * ((i * 7 + r) % 3), exposed + jitter * (i % 2))
                for i in range(steps)
            ],
        )
        for r in range(ranks)
    ]
    run: dict[str, object] = {"world_size": ranks, "config": config or {}}
    if recorded:  # what `zdiag run` recorded (a manifest), not bare traces
        run["schema"] = "zdiag.manifest/1"
    return Report(ranks=rank_reports, run=run, **extra)  # type: ignore[arg-type]


def test_a_run_against_itself_is_no_change() -> None:
    a = _report()
    d = diff_reports(a, a)
    assert d.headline.startswith("no change")
    assert all(x.change == "no change" for x in d.step)
    assert not d.findings and not d.config and not d.operators


def test_a_change_inside_the_spread_is_no_change_and_outside_it_is_named() -> None:
    assert delta("x", [10.0, 10.5, 11.0, 10.2], [10.4, 10.9, 10.6, 10.3]).change == "no change"
    moved = delta("x", [10.0, 10.5, 11.0, 10.2], [20.0, 20.5, 21.0, 20.2])
    assert moved.change == "up" and moved.delta == pytest.approx(10.0)
    assert delta("x", [10.0, 10.2], [20.0, 20.1]).change == "undetermined"


def test_exposed_comm_growth_is_attributed_to_the_unit_that_waited() -> None:
    units_a = [
        FsdpUnit(name="layers.0", rank=r, exposed_wait_ms=6.0 * 2, all_gather_ms=12.0)
        for r in range(2)
    ]
    units_b = [
        FsdpUnit(name="layers.0", rank=r, exposed_wait_ms=6.0 * 32, all_gather_ms=12.0)
        for r in range(2)
    ]
    a = _report(exposed=10.0, fsdp_units=units_a)
    b = _report(exposed=40.0, fsdp_units=units_b)
    d = diff_reports(a, b)
    head = d.headline
    assert head.startswith("+30.0 ms/step"), head
    assert "100% of it exposed comm" in head
    assert "unit `layers.0`" in head
    (unit,) = d.units
    assert unit.exposed_wait_ms_a == pytest.approx(2.0) and unit.exposed_wait_ms_b == 32.0
    assert sum(s.delta_ms for s in d.shares) == pytest.approx(30.0, abs=1e-3)


def test_a_unit_only_some_ranks_run_is_not_diluted() -> None:
    a = _report(fsdp_units=[FsdpUnit(name="stage1.0", rank=1, all_gather_ms=60.0)])
    d = diff_reports(a, a)
    assert d.units[0].gather_ms_a == pytest.approx(10.0)  # 60 ms over rank 1's 6 steps


def test_new_findings_and_changed_prefetch_are_named_as_causes() -> None:
    missing = Finding(id="missing-overlap", severity="warning", title="gathers late")
    a = _report(config={"fsdp2 forward prefetch": "set on 4 of 5 units"})
    b = _report(
        exposed=40.0,
        findings=[missing],
        config={"fsdp2 forward prefetch": "none set"},
    )
    d = diff_reports(a, b)
    assert "missing-overlap" in d.headline and "prefetch off in B" in d.headline
    assert [f.change for f in d.findings] == ["appeared"]
    assert [c.key for c in d.config] == ["fsdp2 forward prefetch"]


@pytest.mark.parametrize(
    ("a_kw", "b_kw", "words"),
    [
        ({"device": "cpu"}, {"device": "cuda"}, "different kinds of device"),
        ({"ranks": 2}, {"ranks": 4}, "different world sizes"),
        ({"config": {"model class": "GPT"}}, {"config": {"model class": "ResNet"}}, "models"),
    ],
)
def test_runs_that_do_not_compare_are_refused_in_one_sentence(
    a_kw: dict[str, object], b_kw: dict[str, object], words: str
) -> None:
    a, b = _report(**a_kw), _report(**b_kw)  # type: ignore[arg-type]
    with pytest.raises(NotComparable, match=words):
        diff_reports(a, b)
    forced = diff_reports(a, b, allow_incomparable=True)
    assert not forced.comparable and words in forced.warnings[0]


def test_bare_traces_of_different_world_sizes_compare_with_a_warning() -> None:
    d = diff_reports(_report(ranks=2, recorded=False), _report(ranks=4, recorded=False))
    assert d.comparable and "different world sizes in the traces' headers" in d.warnings[0]
    assert [r.rank for r in d.ranks] == [0, 1]


def test_a_run_without_steps_is_refused() -> None:
    with pytest.raises(NotComparable, match="no analyzed step"):
        diff_reports(_report(), _report(steps=0))


def test_too_few_steps_are_a_warning_and_undetermined() -> None:
    d = diff_reports(_report(steps=2), _report(steps=2, exposed=50.0))
    assert "too few steps" in d.warnings[0]
    assert d.headline.startswith("undetermined")


def _ops(*rows: tuple[str, float, float]) -> OperatorTable:
    return OperatorTable(
        steps=6, rows=[OperatorRow(name, "cpu", count, ms) for name, count, ms in rows]
    )


def test_operators_fall_in_hta_classes() -> None:
    a = _report(
        operators=_ops(("same", 4, 1.0), ("gone", 1, 2.0), ("more", 2, 1.0), ("slow", 3, 1.0))
    )
    b = _report(
        operators=_ops(("same", 4, 1.0), ("new", 1, 0.5), ("more", 3, 1.5), ("slow", 3, 3.0))
    )
    d = diff_reports(a, b)
    classes = {o.name: o.change for o in d.operators}
    assert classes == {"gone": "deleted", "new": "added", "more": "increased", "slow": "slower"}
    assert d.operators_unchanged == 1
    assert d.operators[-1].name == "slow"  # count changes (HTA's classes) come first


def test_memory_deltas_take_the_largest_peak_over_ranks() -> None:
    def mem(peak: int) -> list[MemoryTimeline]:
        return [
            MemoryTimeline(rank=r, source="snapshot", peak_bytes=peak * (r + 1)) for r in range(2)
        ]

    d = diff_reports(_report(memory=mem(100)), _report(memory=mem(150)))
    (total,) = d.memory
    assert (total.category, total.a_bytes, total.b_bytes) == ("total", 200, 300)


def test_the_diff_round_trips_through_json() -> None:
    d = diff_reports(_report(), _report(exposed=30.0))
    again = decode_diff(encode_diff(d))
    assert again == d and again.schema == "zdiag.diff/1"
    with pytest.raises(ValueError, match=r"not a zdiag\.diff/1"):
        decode_diff(b'{"schema": "zdiag.report/1"}')


def test_different_gpus_compare_with_a_warning_and_a_configuration_line() -> None:
    a, b = _report(), _report(exposed=30.0)
    for r in a.ranks:
        r.device_name = "NVIDIA A100-SXM4-80GB"
    for r in b.ranks:
        r.device_name = "Tesla V100-SXM2-16GB"
    d = diff_reports(a, b)
    assert d.comparable and "different GPUs" in d.warnings[0]
    assert [(c.key, c.b) for c in d.config] == [("gpu", "Tesla V100-SXM2-16GB")]


def test_a_2d_run_splits_exposed_comm_by_dimension_and_names_no_fsdp_unit_for_tp() -> None:
    from zdiag.analyzers.report import DimensionComm

    def mesh_report(tp_exposed: float) -> Report:
        r = _report(
            exposed=10.0 + tp_exposed,
            fsdp_units=[FsdpUnit(name="layers.0", rank=0, exposed_wait_ms=6.0 * tp_exposed)],
        )
        for rank in r.ranks:
            for s in rank.steps:
                s.comm_by_dimension = [
                    DimensionComm(
                        dimension="dp", comm_ms=10.0, exposed_comm_ms=s.exposed_comm_ms - tp_exposed
                    ),
                    DimensionComm(dimension="tp", comm_ms=tp_exposed, exposed_comm_ms=tp_exposed),
                ]
        return r

    d = diff_reports(mesh_report(2.0), mesh_report(22.0))
    assert [x.metric for x in d.step][-2:] == ["exposed comm (dp)", "exposed comm (tp)"]
    assert "of it exposed comm (tp)" in d.headline and "unit" not in d.headline
    tp = next(s for s in d.shares if s.component == "exposed comm (tp)")
    assert tp.delta_ms == pytest.approx(20.0) and tp.share == pytest.approx(1.0)


def test_process_groups_match_by_description_and_members() -> None:
    from zdiag.analyzers.report import ProcessGroupStats

    def groups(ms: float) -> list[ProcessGroupStats]:
        return [
            ProcessGroupStats(name="1", description="dp_shard", ranks=[0, 1], comm_ms_per_step=ms),
            ProcessGroupStats(name="2", description="dp_shard", ranks=[2, 3], comm_ms_per_step=5.0),
        ]

    d = diff_reports(_report(process_groups=groups(5.0)), _report(process_groups=groups(25.0)))
    top = d.groups[0]
    assert (top.group, top.ranks, top.comm_ms_a, top.comm_ms_b) == ("dp_shard", [0, 1], 5.0, 25.0)
    assert d.groups[1].comm_ms_a == d.groups[1].comm_ms_b == 5.0


def test_idle_causes_compare_host_syncs_and_data_loading_per_step() -> None:
    a, b = _report(ranks=4), _report(ranks=4)
    for r in a.ranks:
        r.host_syncs, r.data_loading_ms = 12, 6.0  # 2 syncs and 1 ms per step over 6 steps
    for r in b.ranks:
        r.host_syncs, r.data_loading_ms = 36, 6.0
    causes = {d.metric: d for d in diff_reports(a, b).idle_causes}
    assert (causes["host syncs"].a, causes["host syncs"].b) == (2.0, 6.0)
    assert causes["host syncs"].change == "up"
    assert causes["data loading ms"].change == "no change"
    assert "host launch ms" not in causes  # neither run measured any
