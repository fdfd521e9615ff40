"""Synthetic Kineto traces of a 4-rank HSDP job on a (2, 2) mesh ("replicate", "shard").

Shard groups {0,1}, {2,3} (both named "2", as `split_group` names a mesh dimension's groups),
replicate groups {0,2}, {1,3} (both named "1"), the world "0"; every rank's header lists its own
groups with their members (`distributedInfo.pg_config`). Per step: compute, three all-gathers
on the rank's shard group (the shard group {2,3} runs them 1.5 ms after {0,1}: the two groups
never wait for each other), then an all-reduce on its replicate group (all ranks together).
"""

from __future__ import annotations

from pathlib import Path

from .traces import TraceBuilder

SHARD = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
REPLICATE = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
STEP_US = 12_000.0


def _pg_config(rank: int) -> list[dict[str, object]]:
    return [
        {"pg_name": "0", "pg_desc": "default_pg", "pg_size": 4, "ranks": [0, 1, 2, 3]},
        {"pg_name": "1", "pg_desc": "mesh_replicate", "pg_size": 2, "ranks": list(REPLICATE[rank])},
        {"pg_name": "2", "pg_desc": "mesh_shard", "pg_size": 2, "ranks": list(SHARD[rank])},
    ]


def _collective(
    b: TraceBuilder, name: str, pg: str, start: float, end: float, late_us: float
) -> None:
    kernel = "AllGather_RING_LL" if name == "allgather" else "AllReduce_Sum_f32_RING_LL"
    b.kernel(
        f"ncclDevKernel_{kernel}",
        start + late_us,
        end - start - late_us,
        stream=20,
        launch_at=start + late_us - 20,
        args={
            "Collective name": name,
            "Process Group Name": pg,
            "Group size": 2,
            "dtype": "Float",
            "In msg nelems": 1 << 20,
            "Out msg nelems": 1 << 21,
        },
    )


def hsdp_job(folder: Path, slow_rank: int | None = None, late_us: float = 1_500.0) -> Path:
    """Write the 4 ranks' traces (3 steps) to a new `folder`; `slow_rank` reaches each of its
    collectives `late_us` after its group's other rank (a straggler inside one shard group)."""
    folder.mkdir()
    for r in range(4):
        b = TraceBuilder(rank=r, world_size=4)
        b.doc["distributedInfo"]["pg_config"] = _pg_config(r)
        late = late_us if r == slow_rank else 0.0
        for step in range(3):
            t0 = step * STEP_US
            b.step(step, t0, STEP_US - 500)
            b.kernel("sm90_gemm", t0 + 100, 2_500, launch_at=t0 + 50)
            shift = 0.0 if SHARD[r] == (0, 1) else 1_500.0
            for i in range(3):
                start = t0 + 3_000 + shift + i * 2_000
                _collective(b, "allgather", "2", start, start + 1_800, late)
            _collective(b, "allreduce", "1", t0 + 9_500, t0 + 11_000, late)
        b.write(folder / f"rank-{r}.json")
    return folder
