"""Synthetic Kineto traces shaped like what FSDP2/FSDP1/DeepSpeed ZeRO-3 record on CPU/gloo
(docs/fsdp-patterns.md), for the ledger, detector and summary tests.

`fsdp2_cpu_trace` builds a trace the way torch 2.x records FSDP2 on CPU/gloo: FSDP labels and
`c10d::` ops on the main thread, `gloo:*` ops on a worker thread, no ids linking them.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

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
LEAVES = [("", 64)] + [
    (f"layers.{i}.{m}", n)
    for i in range(3)
    for m, n in (("attention_norm", 64), ("wq", 4096), ("wk", 4096), ("w1", 8192))
]
"""A leaf wrap: each of three blocks split into four units of three sizes (`tiny-layer-wrap`)."""
