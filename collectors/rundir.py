"""The run directory layout: one place that names every file `zdiag run` writes.

```
RUN_DIR/manifest.json                    merged manifest (schema zdiag.manifest/1)
RUN_DIR/manifest.d/rank-<N>.json         each rank's own part (merged into manifest.json)
RUN_DIR/manifest.d/launcher-node-<K>.json each node launcher's part (command, times, exit code)
RUN_DIR/traces/rank-<N>.json.gz          Kineto trace as torch.profiler writes it
RUN_DIR/memory/rank-<N>.timeline.json.gz torch.profiler memory timeline (CPU or CUDA)
RUN_DIR/memory/rank-<N>.snapshot.pickle  CUDA memory snapshot with stacks
RUN_DIR/memory/rank-<N>.oom.json         what was known when the rank ran out of memory
RUN_DIR/steps/rank-<N>.jsonl             one JSON line per training step
```

Paths stored in the manifest are relative to RUN_DIR (POSIX separators). docs/run-dir.md is the
user-facing description of this contract.
"""

from __future__ import annotations

from pathlib import Path

MANIFEST_SCHEMA = "zdiag.manifest/1"
MANIFEST = "manifest.json"
PARTS_DIR = "manifest.d"


def trace_relpath(rank: int) -> str:
    """The rank's Kineto trace, relative to the run directory."""
    return f"traces/rank-{rank}.json.gz"


def memory_timeline_relpath(rank: int) -> str:
    """The rank's profiler memory timeline, relative to the run directory."""
    return f"memory/rank-{rank}.timeline.json.gz"


def memory_snapshot_relpath(rank: int) -> str:
    """The rank's CUDA memory snapshot (pickle), relative to the run directory."""
    return f"memory/rank-{rank}.snapshot.pickle"


def oom_relpath(rank: int) -> str:
    """The rank's out-of-memory record (JSON), relative to the run directory."""
    return f"memory/rank-{rank}.oom.json"


def step_log_relpath(rank: int) -> str:
    """The rank's step log (JSON lines), relative to the run directory."""
    return f"steps/rank-{rank}.jsonl"


def rank_part_path(run_dir: str | Path, rank: int) -> Path:
    """Where a rank writes its part of the manifest."""
    return Path(run_dir) / PARTS_DIR / f"rank-{rank}.json"


def launcher_part_path(run_dir: str | Path, node_rank: int) -> Path:
    """Where the launcher of node `node_rank` writes its part of the manifest."""
    return Path(run_dir) / PARTS_DIR / f"launcher-node-{node_rank}.json"


def make_run_dir(run_dir: str | Path) -> Path:
    """Create the run directory and its subfolders (existing ones are kept)."""
    root = Path(run_dir)
    for sub in ("traces", "memory", "steps", PARTS_DIR):
        (root / sub).mkdir(parents=True, exist_ok=True)
    return root


def model_description_relpath(rank: int) -> str:
    """The rank's model description (JSON, schema zdiag.model/1), relative to the run directory."""
    return f"model/rank-{rank}.json"
