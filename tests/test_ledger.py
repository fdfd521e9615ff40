"""The FSDP unit ledger on synthetic traces shaped like what FSDP2/FSDP1 record (docs/fsdp-patterns.md).

`fsdp2_cpu_trace` builds a Kineto trace the way torch 2.x records FSDP2 on CPU/gloo: FSDP labels and
`c10d::` ops on the main thread, `gloo:*` ops on a worker thread, no ids linking them.
`fsdp2_cuda_trace` does the same with NCCL kernels linked to their launches by correlation.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from zdiag.analyzers.fsdp_ledger import RankLedger, build_rank_ledger
from zdiag.analyzers.loader import load_rank_trace

MAIN, GLOO = 100, 200


class TraceBuilder:
    """Appends complete events; `t` is the main thread's clock in microseconds."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.t = 1000.0
        self.ext = 1

    def x(
        self, name: str, ts: float, dur: float, tid: int = MAIN, cat: str = "cpu_op", **args: Any
    ) -> None:
        args.setdefault("External id", self.ext)
        self.ext += 1
        self.events.append(
            {
                "ph": "X",
                "cat": cat,
                "name": name,
                "pid": 1,
                "tid": tid,
                "ts": ts,
                "dur": dur,
                "args": args,
            }
        )

    def doc(self, device_events: bool = False) -> dict[str, Any]:
        meta = [
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": MAIN, "args": {"name": "python3"}},
            {
                "ph": "M",
                "name": "thread_name",
                "pid": 1,
                "tid": GLOO,
                "args": {"name": "pt_gloo_runloop"},
            },
        ]
        return {
            "schemaVersion": 1,
            "distributedInfo": {
                "backend": "nccl" if device_events else "gloo",
                "rank": 0,
                "world_size": 2,
            },
            "traceEvents": meta + self.events,
        }


def _label(fqn: str) -> str:
    return f" ({fqn})" if fqn else ""


def fsdp2_cpu_trace(
    units: list[tuple[str, int]],
    *,
    steps: int = 2,
    prefetch: bool = False,
    compute_us: float = 300.0,
    gather_us: float = 100.0,
    dtype: str = "float",
    bytes_per_us: float | None = None,
) -> dict[str, Any]:
    """FSDP2 on gloo: per step a forward over `units` (root first), a backward in reverse with a
    reduce-scatter per unit. `prefetch`: each gather after the first is issued at the start of the
    previous unit's compute and runs on the gloo thread during it. With `bytes_per_us`, a gather
    takes gather_us + its bytes / bytes_per_us (a latency-bandwidth cost)."""
    b = TraceBuilder()
    base_us = gather_us

    def cost(numel: int) -> float:
        return base_us + (numel * 4 / bytes_per_us if bytes_per_us else 0.0)

    for step in range(steps):
        start = b.t
        for phase, order in (("forward", units), ("backward", list(reversed(units)))):
            hook = "pre_forward" if phase == "forward" else "pre_backward"
            gathered_early: set[str] = set()
            for k, (fqn, numel) in enumerate(order):
                gather_us = cost(numel)
                t = b.t
                pre_start = t
                if fqn not in gathered_early:
                    # issued inside the unit's own hook: needed before issued
                    b.x(
                        f"FSDP::all_gather{_label(fqn)}",
                        t + 5,
                        gather_us + 30,
                        cat="user_annotation",
                    )
                    b.x(
                        "c10d::_allgather_base_",
                        t + 10,
                        10,
                        **{"Input Dims": [[numel], [numel // 2]], "Input type": [dtype, dtype]},
                    )
                    b.x(
                        "gloo:all_gather",
                        t + 15,
                        gather_us,
                        tid=GLOO,
                        cat="user_annotation",
                        **{"Input Dims": [[numel // 2]], "Input type": [dtype]},
                    )
                    t += gather_us + 40
                b.x(f"FSDP::all_gather_copy_out{_label(fqn)}", t, 5, cat="user_annotation")
                t += 10
                b.events.append(
                    {
                        "ph": "X",
                        "cat": "user_annotation",
                        "name": f"FSDP::{hook}{_label(fqn)}",
                        "pid": 1,
                        "tid": MAIN,
                        "ts": pre_start,
                        "dur": t - pre_start,
                        "args": {},
                    }
                )
                if prefetch and k + 1 < len(order):
                    nxt, nnumel = order[k + 1]
                    kind = "forward_prefetch" if phase == "forward" else "backward_prefetch"
                    b.x(f"FSDP::{kind} for {nxt}", t, 20, cat="user_annotation")
                    b.x(f"FSDP::all_gather{_label(nxt)}", t + 1, 18, cat="user_annotation")
                    b.x(
                        "c10d::_allgather_base_",
                        t + 2,
                        10,
                        **{"Input Dims": [[nnumel], [nnumel // 2]], "Input type": [dtype, dtype]},
                    )
                    b.x(
                        "gloo:all_gather",
                        t + 20,
                        cost(nnumel),
                        tid=GLOO,
                        cat="user_annotation",
                        **{"Input Dims": [[nnumel // 2]], "Input type": [dtype]},
                    )
                    gathered_early.add(nxt)
                    t += 20
                b.x("aten::mm", t, compute_us)
                t += compute_us
                if phase == "backward":
                    b.x(f"FSDP::post_backward_reduce{_label(fqn)}", t, 60, cat="user_annotation")
                    b.x(
                        "c10d::_reduce_scatter_base_",
                        t + 5,
                        10,
                        **{"Input Dims": [[numel // 2], [numel]], "Input type": [dtype, dtype]},
                    )
                    b.x(
                        "gloo:all_reduce",
                        t + 16,
                        40,
                        tid=GLOO,
                        cat="user_annotation",
                        **{"Input Dims": [[numel]], "Input type": [dtype]},
                    )
                    t += 60
                b.t = t + 5
        b.events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{step + 1}",
                "pid": 1,
                "tid": MAIN,
                "ts": start - 1,
                "dur": b.t - start + 2,
                "args": {},
            }
        )
        b.t += 10
    return b.doc()


ENGINE = "autograd::engine::evaluate_function: "


def zero3_cpu_trace(
    modules: list[int],
    *,
    steps: int = 2,
    profiler_steps: bool = True,
    refetch: bool = True,
    persistent: int = 64,
    shapes: bool = True,
) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 on gloo as 0.19 records it (docs/fsdp-patterns.md): no DeepSpeed range,
    its per-module autograd Functions as cpu_ops. Per step: the `persistent` (> 0) parameters
    re-gathered first, before any ZeRO-3 op of the step (after the previous step's backward
    nodes); a forward over `modules` (element counts), each fetched before its
    `PostBackwardFunctionModule`; a backward in reverse, where (with `refetch`) each module's
    `PreBackwardFunctionForModuleBackward` node fetches it again and an `AccumulateGrad` node
    reduces its gradient bucket; then a scalar all-reduce (overflow check). `profiler_steps`:
    one ProfilerStep range per step; `shapes`: `Input Dims` / `Input type` (`record_shapes`).
    """
    b = TraceBuilder()

    def shaped(dims: list[Any], types: list[str]) -> dict[str, Any]:
        return {"Input Dims": dims, "Input type": types} if shapes else {}

    def gather(t: float, numel: int) -> None:
        b.x("c10d::_allgather_base_", t, 10, **shaped([[numel], [numel // 2]], ["float"] * 2))
        b.x("gloo:all_gather", t + 2, 50, tid=GLOO, cat="user_annotation",
            **shaped([[numel // 2]], ["float"]))  # fmt: skip

    for step in range(steps):
        start = b.t
        t = start
        if persistent:
            gather(t, persistent)
            t += 60
        for numel in modules:
            gather(t, numel)
            b.x("PostBackwardFunctionModule", t + 60, 5)
            b.x("LinearFunctionForZeroStage3", t + 70, 100)
            b.x("aten::mm", t + 75, 90)
            b.x("PreBackwardFunctionForModule", t + 175, 5)
            t += 200
        for numel in reversed(modules):
            b.x(ENGINE + "PreBackwardFunctionForModuleBackward", t, 80)
            b.x("PreBackwardFunctionForModuleBackward", t + 1, 78)
            if refetch:
                gather(t + 5, numel)
            b.x(ENGINE + "LinearFunctionForZeroStage3Backward", t + 100, 100)
            b.x("aten::mm", t + 105, 90)
            b.x(ENGINE + "torch::autograd::AccumulateGrad", t + 210, 80)
            b.x("torch::autograd::AccumulateGrad", t + 211, 78)
            b.x("c10d::_reduce_scatter_base_", t + 215, 10,
                **shaped([[numel // 2], [numel]], ["float"] * 2))  # fmt: skip
            b.x("gloo:all_reduce", t + 217, 50, tid=GLOO, cat="user_annotation",
                **shaped([[numel]], ["float"]))  # fmt: skip
            t += 300
        b.x("c10d::allreduce_", t, 10, **shaped([[[]]], ["TensorList"]))
        b.x("gloo:all_reduce", t + 2, 5, tid=GLOO, cat="user_annotation",
            **shaped([[]], ["double"]))  # fmt: skip
        b.x("Optimizer.step#AdamW.step", t + 20, 100, cat="user_annotation")
        b.t = t + 130
        if profiler_steps:
            b.x(f"ProfilerStep#{step + 1}", start - 1, b.t - start + 2, cat="user_annotation")
        b.t += 10
    return b.doc()


def write(tmp_path: Path, doc: dict[str, Any], name: str = "rank-0.json.gz") -> Path:
    """The trace as a .json.gz file."""
    path = tmp_path / name
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


BLOCKS = [("", 1000), ("layers.0", 4000), ("layers.1", 4000), ("layers.2", 4000)]


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
    from zdiag.analyzers.fsdp_ledger import manifest_unit_bytes

    doc = fsdp2_cpu_trace(BLOCKS, steps=1)
    for ev in doc["traceEvents"]:
        ev.get("args", {}).pop("Input Dims", None)
    trace = load_rank_trace(write(tmp_path, doc))
    from zdiag.collectors.rundir import Manifest

    manifest = Manifest.from_json(
        {"fsdp_units": [{"name": n, "param_count": k, "param_bytes": 4 * k} for n, k in BLOCKS]}
    )
    ledger = build_rank_ledger(trace, unit_param_bytes=manifest_unit_bytes(manifest))
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
