"""The FSDP unit ledger on synthetic traces shaped like what FSDP2/FSDP1 record (docs/fsdp-patterns.md).

`fsdp2_cpu_trace` builds a Kineto trace the way torch 2.x records FSDP2 on CPU/gloo: FSDP labels and
`c10d::` ops on the main thread, `gloo:*` ops on a worker thread, no ids linking them.
`fsdp2_cuda_trace` does the same with NCCL kernels linked to their launches by correlation.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.ledger_traces import (
    BLOCKS,
    GLOO,
    TraceBuilder,
    fsdp2_cpu_trace,
    write,
    zero3_cpu_trace,
)
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.rank.fsdp_ledger import RankLedger, build_rank_ledger


def test_units_bytes_and_counts_per_block(tmp_path: Path) -> None:
    trace = load_rank_trace(write(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=2)))
    units = {u.name: u for u in build_rank_ledger(trace).units()}
    assert set(units) == {"", "layers.0", "layers.1", "layers.2"}
    u = units["layers.1"]
    assert u.framework == "fsdp2"
    # gathered (unsharded) fp32 bytes from the c10d op's Input Dims, not gloo's shard-sized dims
    assert u.param_bytes == 4000 * 4
    assert u.all_gather_count == 4  # forward + backward, 2 steps
    assert u.reduce_count == 2
    assert u.reduce_bytes == 2 * 4000 * 4
    assert u.all_gather_ms == pytest.approx(4 * 0.1)


def test_serialized_gathers_are_issued_when_needed_and_fully_exposed(tmp_path: Path) -> None:
    trace = load_rank_trace(write(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=1)))
    ledger = build_rank_ledger(trace)
    gathers = ledger.gathers
    assert len(gathers) == 8
    assert all(g.lead_us is not None and g.lead_us <= 0 for g in gathers)
    assert all(g.exposed_us == pytest.approx(g.dur_us) for g in gathers)
    assert [g.phase for g in gathers] == ["forward"] * 4 + ["backward"] * 4


def test_prefetched_gathers_lead_and_overlap_compute(tmp_path: Path) -> None:
    doc = fsdp2_cpu_trace(BLOCKS, steps=1, prefetch=True, compute_us=300, gather_us=100)
    ledger = build_rank_ledger(load_rank_trace(write(tmp_path, doc)))
    fwd = [g for g in ledger.gathers if g.phase == "forward"]
    assert [g.unit for g in fwd] == ["", "layers.0", "layers.1", "layers.2"]
    assert fwd[0].lead_us is not None and fwd[0].lead_us <= 0  # the first cannot be prefetched
    assert all(g.lead_us is not None and g.lead_us > 0 and g.prefetched for g in fwd[1:])
    # the gather ran entirely under the previous unit's 300 us matmul
    assert all(g.exposed_us == pytest.approx(0.0) for g in fwd[1:])


def test_step_windows_limit_the_ledger(tmp_path: Path) -> None:
    trace = load_rank_trace(write(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=2)))
    first = build_rank_ledger(trace)
    end_of_first = min(g.issued_us for g in first.gathers if g.step == -1) + 1
    step_one_end = sorted({g.issued_us for g in first.gathers})[8] - 1
    ledger = build_rank_ledger(trace, [1], [end_of_first - 100], [step_one_end])
    assert ledger.steps == [1]
    assert {g.step for g in ledger.records} == {1}
    assert len(ledger.gathers) == 8


def test_no_fsdp_labels_no_units(tmp_path: Path) -> None:
    b = TraceBuilder()
    b.x("c10d::allreduce_", 100, 10)
    b.x(
        "gloo:all_reduce",
        105,
        50,
        tid=GLOO,
        cat="user_annotation",
        **{"Input Dims": [[10]], "Input type": ["float"]},
    )
    b.x("aten::mm", 200, 100)
    trace = load_rank_trace(write(tmp_path, b.doc()))
    assert build_rank_ledger(trace).units() == []


def test_fsdp1_units_are_numbered_in_issue_order(tmp_path: Path) -> None:
    b = TraceBuilder()
    t = 100.0
    for _ in range(3):
        b.x("FullyShardedDataParallel._pre_forward", t, 200, cat="user_annotation")
        b.x(
            "c10d::_allgather_base_",
            t + 10,
            10,
            **{"Input Dims": [[800], [400]], "Input type": ["BFloat16", "BFloat16"]},
        )
        b.x("gloo:all_gather", t + 12, 100, tid=GLOO, cat="user_annotation")
        b.x("aten::mm", t + 120, 50)
        t += 250
    ledger = build_rank_ledger(load_rank_trace(write(tmp_path, b.doc())))
    assert ledger.framework == "fsdp1"
    assert ledger.unit_order == ["fsdp1-unit-0", "fsdp1-unit-1", "fsdp1-unit-2"]
    assert all(r.bytes == 1600 and r.phase == "forward" for r in ledger.records)


def test_cuda_kernels_pair_by_correlation_and_overlap_compute_kernels(tmp_path: Path) -> None:
    b = TraceBuilder()
    b.x("FSDP::pre_forward (layers.0)", 100, 100, cat="user_annotation")
    b.x("FSDP::all_gather (layers.0)", 105, 50, cat="user_annotation")
    b.x(
        "c10d::_allgather_base_",
        110,
        40,
        **{"Input Dims": [[1000], [500]], "Input type": ["BFloat16", "BFloat16"]},
    )
    b.x("cudaLaunchKernel", 120, 5, cat="cuda_runtime", correlation=7)
    b.x("cudaLaunchKernel", 160, 5, cat="cuda_runtime", correlation=8)
    b.events.append(
        {
            "ph": "X",
            "cat": "kernel",
            "name": "ncclDevKernel_AllGather_RING_LL",
            "pid": 0,
            "tid": 20,
            "ts": 200,
            "dur": 100,
            "args": {"correlation": 7},
        }
    )
    b.events.append(
        {
            "ph": "X",
            "cat": "kernel",
            "name": "ampere_sgemm_128x64",
            "pid": 0,
            "tid": 7,
            "ts": 180,
            "dur": 60,
            "args": {"correlation": 8},
        }
    )
    ledger = build_rank_ledger(load_rank_trace(write(tmp_path, b.doc(device_events=True))))
    (g,) = ledger.gathers
    assert (g.unit, g.start_us, g.end_us) == ("layers.0", 200, 300)
    assert g.bytes == 2000
    assert g.exposed_us == pytest.approx(60.0)  # 200-240 under the gemm, 240-300 exposed


def test_ledger_is_a_value_that_keeps_no_trace_alive(tmp_path: Path) -> None:
    import gc
    import weakref

    import msgspec

    trace = load_rank_trace(write(tmp_path, fsdp2_cpu_trace(BLOCKS)))
    ledger = build_rank_ledger(trace)
    assert ledger.records
    ref = weakref.ref(trace)
    del trace
    gc.collect()
    assert ref() is None
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(ledger), type=RankLedger)
    assert again == ledger
    assert again.units() == ledger.units()


def test_unit_bytes_from_the_manifest_when_the_trace_has_no_shapes(tmp_path: Path) -> None:

    doc = fsdp2_cpu_trace(BLOCKS, steps=1)
    for ev in doc["traceEvents"]:
        ev.get("args", {}).pop("Input Dims", None)
    trace = load_rank_trace(write(tmp_path, doc))
    from zdiag.collectors.run_records import Manifest

    manifest = Manifest.from_json(
        {"fsdp_units": [{"name": n, "param_count": k, "param_bytes": 4 * k} for n, k in BLOCKS]}
    )
    ledger = build_rank_ledger(trace, unit_param_bytes=manifest.unit_param_bytes())
    units = {u.name: u for u in ledger.units()}
    assert units["layers.2"].param_bytes == 16000
    assert units[""].all_gather_bytes == 2 * 4000


def test_fsdp1_backward_collectives_match_forward_units_in_reverse(tmp_path: Path) -> None:
    b = TraceBuilder()
    t = 100.0

    def collective(label: str, op: str, numel: int, gloo: str) -> None:
        nonlocal t
        b.x(label, t, 200, cat="user_annotation")
        # FSDP1's list-form all-gather records only the shard (a TensorList): x group size 2
        dims = [[], [[numel // 2]]] if op == "c10d::allgather_" else [[numel // 2], [numel]]
        b.x(
            op,
            t + 10,
            10,
            **{
                "Input Dims": dims,
                "Input type": ["", "TensorList" if op == "c10d::allgather_" else "float", "float"],
            },
        )
        b.x(gloo, t + 12, 100, tid=GLOO, cat="user_annotation")
        b.x("aten::mm", t + 120, 50)
        t += 250

    for numel in (100, 800, 800):
        collective(
            "FullyShardedDataParallel._pre_forward", "c10d::allgather_", numel, "gloo:all_gather"
        )
    for numel in (800, 800):
        collective(
            "FullyShardedDataParallel._pre_backward_hook",
            "c10d::allgather_",
            numel,
            "gloo:all_gather",
        )
        collective(
            "FullyShardedDataParallel._post_backward_hook",
            "c10d::_reduce_scatter_base_",
            numel,
            "gloo:all_reduce",
        )
    collective(
        "FullyShardedDataParallel._post_backward_hook",
        "c10d::_reduce_scatter_base_",
        100,
        "gloo:all_reduce",
    )
    ledger = build_rank_ledger(load_rank_trace(write(tmp_path, b.doc())))
    got = [(r.family, r.phase, r.unit, r.bytes) for r in ledger.records]
    assert got == [
        ("all_gather", "forward", "fsdp1-unit-0", 400),
        ("all_gather", "forward", "fsdp1-unit-1", 3200),
        ("all_gather", "forward", "fsdp1-unit-2", 3200),
        ("all_gather", "backward", "fsdp1-unit-2", 3200),
        ("reduce", "backward", "fsdp1-unit-2", 3200),
        ("all_gather", "backward", "fsdp1-unit-1", 3200),
        ("reduce", "backward", "fsdp1-unit-1", 3200),
        ("reduce", "backward", "fsdp1-unit-0", 400),
    ]


def _zero3_phases(ledger: RankLedger) -> list[tuple[int, str, str]]:
    return [(r.step, r.family, r.phase) for r in ledger.records]


ZERO3_STEP = (
    [("all_gather", "forward")] * 3  # persistent re-gather, then 2 module fetches
    + [("all_gather", "backward"), ("reduce", "backward")] * 2  # refetch, bucket per module
)


def test_zero3_ledger_phases_from_the_autograd_engine_with_and_without_step_windows(
    tmp_path: Path,
) -> None:
    """A ZeRO-3 gather is backward when the autograd engine issued it (inside a node op), with
    or without ProfilerStep windows: the persistent re-gather and the forward fetches of the
    second step follow the first step's backward nodes and are still forward."""
    bare = load_rank_trace(write(tmp_path, zero3_cpu_trace([4000, 8000], profiler_steps=False)))
    ledger = build_rank_ledger(bare)
    assert ledger.framework == "deepspeed"
    assert [(f, p) for _, f, p in _zero3_phases(ledger)] == ZERO3_STEP * 2
    assert {r.step for r in ledger.records} == {-1}
    # the scalar all-reduce (a 0-dim tensor in a TensorList) is left out
    assert all(r.bytes > 8 for r in ledger.records)

    doc = zero3_cpu_trace([4000, 8000])
    windowed = load_rank_trace(write(tmp_path, doc, "windowed-rank0.json.gz"))
    steps = [e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep")]
    ledger = build_rank_ledger(
        windowed,
        [1, 2],
        [e["ts"] for e in steps],
        [e["ts"] + e["dur"] for e in steps],
    )
    assert _zero3_phases(ledger) == [(s, f, p) for s in (1, 2) for f, p in ZERO3_STEP]


def test_zero3_scalar_all_reduce_without_shapes_on_gloo_is_not_known(tmp_path: Path) -> None:
    """gloo without `record_shapes` records no size: the scalar all-reduce stays, of unknown
    size, after the buckets (docs/fsdp-patterns.md)."""
    doc = zero3_cpu_trace([4000, 8000], steps=1, shapes=False)
    ledger = build_rank_ledger(load_rank_trace(write(tmp_path, doc)))
    assert [(f, p) for _, f, p in _zero3_phases(ledger)] == [*ZERO3_STEP, ("reduce", "backward")]
    assert all(r.bytes == -1 for r in ledger.records)


def test_a_gathers_window_is_the_gap_before_it_less_other_collectives() -> None:
    """What a prefetch one unit ahead could hide a gather under: the gap since the previous
    gather of the same pass, compute and idle alike (a host-bound unit's idle time counts), less
    the collectives in it (a reduce-scatter holds the communicator)."""
    from zdiag.analyzers.rank.fsdp_ledger import CollectiveRecord, _attach_windows

    def rec(family: str, start: float, end: float) -> CollectiveRecord:
        return CollectiveRecord(
            unit="u", framework="fsdp2", family=family, kind=family, phase="backward", step=1,
            issued_us=start, issue_end_us=start, start_us=start, end_us=end, bytes=-1, dtype="",
        )  # fmt: skip

    first, second = rec("all_gather", 0, 100), rec("all_gather", 1000, 1100)
    reduce = rec("reduce", 300, 500)
    _attach_windows([first, reduce, second])
    assert first.window_before_us is None  # first of its pass: nothing before it to hide under
    assert second.window_before_us == pytest.approx(900 - 200)
