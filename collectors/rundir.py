"""The run directory's layout: every path inside it is spelled here once.

```
RUN_DIR/manifest.json                    merged manifest (schema zdiag.manifest/1): `Manifest`
RUN_DIR/manifest.d/rank-<N>.json         each rank's own part (merged into manifest.json): `RankPart`
RUN_DIR/manifest.d/launcher-node-<K>.json each node launcher's part: `LauncherPart`
RUN_DIR/traces/rank-<N>.json.gz          Kineto trace as torch.profiler writes it
RUN_DIR/traces/rank-<N>.summary.zds      its rank summary, made in the job after the export
RUN_DIR/memory/rank-<N>.timeline.json.gz torch.profiler memory timeline (CPU or CUDA)
RUN_DIR/memory/rank-<N>.snapshot.pickle  CUDA memory snapshot with stacks
RUN_DIR/memory/rank-<N>.oom.json         what was known when the rank ran out of memory: `OomRecord`
RUN_DIR/steps/rank-<N>.jsonl             one JSON line per training step
RUN_DIR/hang/rank-<N>.json               what the rank was doing when the hang watchdog fired
RUN_DIR/model/rank-<N>.json              the model description (schema zdiag.model/1)
RUN_DIR/captures/capture-<K>/rank-<N>.json.gz  a capture the monitor triggered (and its summary)
```

Paths stored in the manifest are relative to RUN_DIR (POSIX separators). docs/run-dir.md is the
user-facing description of this contract. The records themselves (`Manifest`, `RankPart`,
`OomRecord`, ...) are in `run_records.py`; the analyzers read run-dir files through
`analyzers/inputs/run_dir.py` (confined to the run directory, capped).

Standard library only: the launcher and the analyzers import it without torch.
"""

from __future__ import annotations

from pathlib import Path

MANIFEST_SCHEMA = "zdiag.manifest/1"
MANIFEST = "manifest.json"
PARTS_DIR = "manifest.d"
TRACES_DIR = "traces"
MEMORY_DIR = "memory"
STEPS_DIR = "steps"
HANG_DIR = "hang"
MODEL_DIR = "model"
SUBDIRS = (TRACES_DIR, MEMORY_DIR, STEPS_DIR, PARTS_DIR)
OOM_RECORD_GLOB = "rank-*.oom.json"
RANK_PART_GLOB = "rank-*.json"
LAUNCHER_PART_GLOB = "launcher-node-*.json"


CAPTURES_DIR = "captures"


def capture_trace_relpath(capture_id: int, rank: int) -> str:
    """Rank `rank`'s trace of triggered capture `capture_id`, relative to the run directory."""
    return f"{CAPTURES_DIR}/capture-{capture_id}/rank-{rank}.json.gz"


def trace_relpath(rank: int) -> str:
    """The rank's Kineto trace, relative to the run directory."""
    return f"{TRACES_DIR}/rank-{rank}.json.gz"


SUMMARY_SUFFIX = ".summary.zds"


def summary_path_for(trace: str | Path) -> Path:
    """The in-job summary of a trace: beside it, its `.json`/`.json.gz` suffix replaced by
    `.summary.zds` (`traces/rank-3.json.gz` -> `traces/rank-3.summary.zds`)."""
    path = Path(trace)
    name = path.name
    for suffix in (".json.gz", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return path.with_name(name + SUMMARY_SUFFIX)


def memory_timeline_relpath(rank: int) -> str:
    """The rank's profiler memory timeline, relative to the run directory."""
    return f"{MEMORY_DIR}/rank-{rank}.timeline.json.gz"


def memory_snapshot_relpath(rank: int) -> str:
    """The rank's CUDA memory snapshot (pickle), relative to the run directory."""
    return f"{MEMORY_DIR}/rank-{rank}.snapshot.pickle"


def oom_relpath(rank: int) -> str:
    """The rank's out-of-memory record (JSON), relative to the run directory."""
    return f"{MEMORY_DIR}/rank-{rank}.oom.json"


def remove_unfinished_writes(run_dir: str | Path) -> int:
    """Delete the temporary files that ranks killed mid-write left (`.NAME.tmp-*`, see
    `fsio.temp_path_for`) in the run directory's folders; how many were removed."""
    removed = 0
    for sub in (TRACES_DIR, MEMORY_DIR, STEPS_DIR, PARTS_DIR, HANG_DIR, MODEL_DIR):
        folder = Path(run_dir) / sub
        if not folder.is_dir():
            continue
        for path in folder.glob(".*.tmp-*"):
            try:
                if path.is_file() and not path.is_symlink():
                    path.unlink()
                    removed += 1
            except OSError:
                continue
    return removed


def hang_relpath(rank: int) -> str:
    """The rank's hang dump (stacks, collective, flight recorder), relative to the run directory."""
    return f"{HANG_DIR}/rank-{rank}.json"


def step_log_relpath(rank: int) -> str:
    """The rank's step log (JSON lines), relative to the run directory."""
    return f"{STEPS_DIR}/rank-{rank}.jsonl"


def rank_part_path(run_dir: str | Path, rank: int) -> Path:
    """Where a rank writes its part of the manifest."""
    return Path(run_dir) / PARTS_DIR / f"rank-{rank}.json"


def launcher_part_path(run_dir: str | Path, node_rank: int) -> Path:
    """Where the launcher of node `node_rank` writes its part of the manifest."""
    return Path(run_dir) / PARTS_DIR / f"launcher-node-{node_rank}.json"


def make_run_dir(run_dir: str | Path) -> Path:
    """Create the run directory and its subfolders (existing ones are kept)."""
    root = Path(run_dir)
    for sub in SUBDIRS:
        (root / sub).mkdir(parents=True, exist_ok=True)
    return root


def is_run_dir(path: Path) -> bool:
    """Whether `path` looks like a run directory (a manifest, or a traces/ folder)."""
    return (path / MANIFEST).is_file() or (path / TRACES_DIR).is_dir()


def model_description_relpath(rank: int) -> str:
    """The rank's model description (JSON, schema zdiag.model/1), relative to the run directory."""
    return f"{MODEL_DIR}/rank-{rank}.json"
