"""Merge the per-rank and per-launcher parts of a run directory into `manifest.json`.

Each rank writes `manifest.d/rank-<N>.json` (at start, and again when it ends); each node's launcher
writes `manifest.d/launcher-node-<K>.json`. `merge_manifest` reads whatever parts exist and writes
`manifest.json` atomically. It is idempotent: on a shared filesystem every node's launcher merges
when its ranks end, and the last one to finish leaves the complete manifest. Ranks that never wrote a
part (killed, or on a node whose files are elsewhere) appear with `"missing": true`.

Standard library only: the launcher merges without importing torch.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from zdiag import __version__
from zdiag.collectors.fsio import write_json_atomically
from zdiag.collectors.rundir import MANIFEST, MANIFEST_SCHEMA, PARTS_DIR
from zdiag.collectors.runinfo import memory_budget_bytes

RANK_FILE_KEYS = ("trace", "memory_timeline", "memory_snapshot", "oom_record", "step_log")


def utc_now_iso() -> str:
    """The current time as ISO 8601 UTC with a `Z` suffix."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def hostname() -> str:
    """This machine's host name."""
    return socket.gethostname()


def _read_parts(run_dir: Path) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    ranks: dict[int, dict[str, Any]] = {}
    launchers: dict[int, dict[str, Any]] = {}
    parts = run_dir / PARTS_DIR
    if not parts.is_dir():
        return ranks, launchers
    for path in sorted(parts.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # a part being replaced right now, or damaged: merge what is readable
        if not isinstance(data, dict):
            continue
        if path.name.startswith("rank-") and isinstance(data.get("rank"), int):
            ranks[data["rank"]] = data
        elif path.name.startswith("launcher-node-") and isinstance(data.get("node_rank"), int):
            launchers[data["node_rank"]] = data
    return ranks, launchers


def _rank_entry(run_dir: Path, part: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "rank": part["rank"],
        "local_rank": part.get("local_rank"),
        "node_rank": part.get("node_rank"),
        "host": part.get("host"),
        "pid": part.get("pid"),
        "device": part.get("device"),
    }
    for key in RANK_FILE_KEYS:
        rel = part.get(key)
        entry[key] = rel if isinstance(rel, str) and (run_dir / rel).is_file() else None
    categorized = part.get("memory_timeline_categorized")
    entry["memory_timeline_categorized"] = categorized if entry["memory_timeline"] else None
    entry["steps"] = part.get("steps", 0)
    entry["step_log_truncated"] = bool(part.get("step_log_truncated", False))
    entry["exit_code"] = part.get("exit_code")
    entry["oom"] = bool(part.get("oom", False))
    entry["error"] = part.get("error")
    entry["collector_errors"] = part.get("collector_errors", [])
    entry["started_at"] = part.get("started_at")
    entry["ended_at"] = part.get("ended_at")
    return entry


def _missing_entry(rank: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"rank": rank, "local_rank": None, "node_rank": None, "host": None}
    entry.update(pid=None, device=None)
    entry.update(dict.fromkeys(RANK_FILE_KEYS), memory_timeline_categorized=None)
    entry.update(steps=0, step_log_truncated=False, exit_code=None, oom=False, error=None)
    entry.update(collector_errors=[], started_at=None, ended_at=None, missing=True)
    return entry


def _first(values: list[Any]) -> Any:
    return next((v for v in values if v is not None), None)


def build_manifest(run_dir: str | Path, *, node_rank: int = 0) -> dict[str, Any]:
    """The merged manifest of `run_dir` from the parts present now (nothing is written)."""
    root = Path(run_dir)
    ranks, launchers = _read_parts(root)
    ordered = [ranks[r] for r in sorted(ranks)]
    launcher_list = [launchers[k] for k in sorted(launchers)]
    head = launchers.get(0) or (launcher_list[0] if launcher_list else {})
    lead = ranks.get(0) or (ordered[0] if ordered else {})

    world_size = _first([p.get("world_size") for p in ordered])
    if world_size is None:
        world_size = _first([lnch.get("expected_world_size") for lnch in launcher_list])
    world_size = int(world_size or len(ordered))
    entries = [
        _rank_entry(root, ranks[r]) if r in ranks else _missing_entry(r) for r in range(world_size)
    ]
    entries += [_rank_entry(root, ranks[r]) for r in sorted(ranks) if r >= world_size]

    run_info: dict[str, Any] = lead.get("run_info") or {}
    starts = [
        t
        for t in [
            *(p.get("started_at") for p in ordered),
            *(lc.get("started_at") for lc in launcher_list),
        ]
        if t
    ]
    ends = [
        t
        for t in [
            *(p.get("ended_at") for p in ordered),
            *(lc.get("ended_at") for lc in launcher_list),
        ]
        if t
    ]
    launcher_codes = [
        lc.get("exit_code") for lc in launcher_list if lc.get("exit_code") is not None
    ]
    rank_codes = [e["exit_code"] for e in entries if e["exit_code"] not in (None, 0)]
    if launcher_codes:
        code: int | None = next((c for c in launcher_codes if c != 0), 0)
    else:
        code = rank_codes[0] if rank_codes else _first([e["exit_code"] for e in entries])
    oom = any(e["oom"] for e in entries)
    error = _first([e["error"] for e in entries]) or _first(
        [lc.get("error") for lc in launcher_list]
    )
    memory_budget = memory_budget_bytes(run_info)
    harness = run_info.get("harness")

    return {
        "schema": MANIFEST_SCHEMA,
        "zdiag_version": __version__,
        "command": head.get("command") or lead.get("command") or [],
        "cwd": head.get("cwd") or lead.get("cwd"),
        "started_at": min(starts) if starts else None,
        "ended_at": max(ends) if ends else None,
        "world_size": world_size,
        "nnodes": int(head.get("nnodes") or lead.get("nnodes") or 1),
        "node_rank": node_rank,
        "hosts": sorted({e["host"] for e in entries if e["host"]}),
        "device": lead.get("device"),
        "backend": _first([p.get("backend") for p in ordered]),
        "versions": lead.get("versions") or {},
        "harness": harness,
        "profile": head.get("profile") or lead.get("profile"),
        "fsdp_units": list(run_info.get("fsdp_units") or []),
        "memory_budget_bytes": memory_budget,
        "run_info": {k: v for k, v in run_info.items() if k not in ("harness", "fsdp_units")},
        "ranks": entries,
        "exit": {"code": code, "oom": oom, "error": error},
    }


def merge_manifest(run_dir: str | Path, *, node_rank: int = 0) -> dict[str, Any]:
    """Build the manifest from the parts in `run_dir` and write `manifest.json` atomically."""
    manifest = build_manifest(run_dir, node_rank=node_rank)
    write_json_atomically(Path(run_dir) / MANIFEST, manifest)
    return manifest


def process_env_info() -> dict[str, Any]:
    """Rank, local rank, node rank and world size from torchrun's environment (defaults: 1 process)."""

    def env_int(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default

    return {
        "rank": env_int("RANK", 0),
        "local_rank": env_int("LOCAL_RANK", 0),
        "node_rank": env_int("GROUP_RANK", env_int("ZDIAG_NODE_RANK", 0)),
        "world_size": env_int("WORLD_SIZE", 1),
    }
