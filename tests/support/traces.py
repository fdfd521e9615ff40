"""Small synthetic Kineto traces for tests: exact, hand-checkable event layouts.

Times are microseconds from the trace start. Example (one step, a 100 us kernel overlapped by a
60 us all-gather starting at 50 us):

    b = TraceBuilder(rank=0, world_size=2)
    b.step(1, 0, 200)
    b.kernel("sm90_gemm", 0, 100, launch_at=0)
    b.kernel("ncclDevKernel_AllGather_RING_LL", 50, 60, stream=20, launch_at=1)
    b.write(tmp_path / "rank-0.json")
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

BASE_US = 1_000_000.0
PID = 4242
MAIN_TID = 4242


class TraceBuilder:
    """Builds a Kineto-style trace dict event by event (see the module docstring)."""

    def __init__(
        self,
        rank: int | None = 0,
        world_size: int = 2,
        backend: str = "nccl",
        gpu_name: str | None = "NVIDIA H100 80GB HBM3",
    ) -> None:
        self.events: list[dict[str, Any]] = []
        self.doc: dict[str, Any] = {"schemaVersion": 1}
        if rank is not None:
            self.doc["distributedInfo"] = {
                "backend": backend,
                "rank": rank,
                "world_size": world_size,
            }
        self.doc["deviceProperties"] = [{"id": 0, "name": gpu_name}] if gpu_name else []
        self._corr = 1000
        self._ext = 1
        self._threads: set[int] = set()
        self._streams: set[int] = set()

    def _x(
        self,
        cat: str,
        name: str,
        start: float,
        dur: float,
        pid: int | str,
        tid: int | str,
        args: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        ev: dict[str, Any] = {
            "ph": "X",
            "cat": cat,
            "name": name,
            "pid": pid,
            "tid": tid,
            "ts": BASE_US + start,
            "dur": dur,
        }
        if args is not None:
            ev["args"] = args
        self.events.append(ev)
        return ev

    def step(self, number: int, start: float, dur: float, tid: int = MAIN_TID) -> None:
        """A `ProfilerStep#number` range on a CPU thread."""
        self._threads.add(tid)
        self._x("user_annotation", f"ProfilerStep#{number}", start, dur, PID, tid, {})

    def annotation(self, name: str, start: float, dur: float, tid: int = MAIN_TID) -> None:
        """A record_function range (user_annotation) on a CPU thread."""
        self._threads.add(tid)
        self._ext += 1
        self._x("user_annotation", name, start, dur, PID, tid, {"External id": self._ext})

    def cpu_op(
        self,
        name: str,
        start: float,
        dur: float,
        tid: int = MAIN_TID,
        args: dict[str, Any] | None = None,
    ) -> int:
        """A cpu_op; returns its External id."""
        self._threads.add(tid)
        self._ext += 1
        full = {"External id": self._ext, **(args or {})}
        self._x("cpu_op", name, start, dur, PID, tid, full)
        return self._ext

    def kernel(
        self,
        name: str,
        start: float,
        dur: float,
        stream: int = 7,
        launch_at: float | None = None,
        args: dict[str, Any] | None = None,
        external_id: int | None = None,
        cat: str = "kernel",
        launch_name: str = "cudaLaunchKernel",
    ) -> None:
        """A GPU kernel (or memcpy/memset with cat=...) on `stream`; with `launch_at`, also the
        cudaLaunchKernel call on the main thread that launched it (linked by correlation)."""
        self._streams.add(stream)
        self._corr += 1
        ext = external_id if external_id is not None else -1
        kargs = {
            "External id": ext,
            "device": 0,
            "stream": stream,
            "correlation": self._corr,
            **(args or {}),
        }
        self._x(cat, name, start, dur, 0, stream, kargs)
        if launch_at is not None:
            self._threads.add(MAIN_TID)
            self._x(
                "cuda_runtime",
                launch_name,
                launch_at,
                min(5.0, dur),
                PID,
                MAIN_TID,
                {"External id": ext, "correlation": self._corr, "cbid": 211},
            )

    def memcpy(self, start: float, dur: float, stream: int = 7) -> None:
        """A device memcpy."""
        self.kernel("Memcpy HtoD (Pinned -> Device)", start, dur, stream, cat="gpu_memcpy")

    def memset(self, start: float, dur: float, stream: int = 7) -> None:
        """A device memset."""
        self.kernel("Memset (Device)", start, dur, stream, cat="gpu_memset")

    def to_dict(self) -> dict[str, Any]:
        """The trace as a dict (metadata events for threads and streams included)."""
        meta: list[dict[str, Any]] = [
            {"name": "process_labels", "ph": "M", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}}
        ]
        for tid in sorted(self._threads):
            meta.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": PID,
                    "tid": tid,
                    "args": {"name": f"thread {tid} (python)"},
                }
            )
        for s in sorted(self._streams):
            meta.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": 0,
                    "tid": s,
                    "args": {"name": f"stream {s} "},
                }
            )
        return {**self.doc, "traceEvents": [*self.events, *meta]}

    def write(self, path: Path) -> Path:
        """Write as JSON (gzip when the name ends in .gz); returns the path."""
        data = json.dumps(self.to_dict()).encode()
        if path.name.endswith(".gz"):
            data = gzip.compress(data)
        path.write_bytes(data)
        return path


def small_job(folder: Path, ranks: int = 6, late: int | None = 4) -> Path:
    """A GPU job of `ranks` small traces (3 steps) where rank `late` (None: none) reaches each
    all-reduce 2.5 ms after the others, written to a new `folder`."""
    folder.mkdir()
    for r in range(ranks):
        b = TraceBuilder(rank=r, world_size=ranks)
        for step in range(3):
            t0 = step * 10_000.0
            b.step(step, t0, 9_000)
            b.kernel("sm90_gemm", t0 + 100, 4_000, launch_at=t0 + 50)
            delay = 2_500.0 if r == late else 0.0
            b.kernel(
                "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                t0 + 4_200 + delay,
                3_500 - delay,
                stream=20,
                launch_at=t0 + 4_150,
            )
        b.write(folder / f"rank-{r}.json")
    return folder
