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
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from zdiag import __version__
from zdiag.errors import InputError

from .fsio import write_json_atomically
from .run_records import ExitInfo, FsdpUnitRecord, LauncherPart, Manifest, RankEntry, RankPart
from .rundir import LAUNCHER_PART_GLOB, MANIFEST, MANIFEST_SCHEMA, PARTS_DIR, RANK_PART_GLOB
from .runinfo import memory_budget_bytes

P = TypeVar("P", RankPart, LauncherPart)

# run_info keys that the manifest lifts to fields of their own.
_LIFTED_RUN_INFO = ("harness", "fsdp_units", "memory_budget_bytes")


def utc_now_iso() -> str:
    """The current time as ISO 8601 UTC with a `Z` suffix."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def hostname() -> str:
    """This machine's host name."""
    return socket.gethostname()


def read_part(path: Path, kind: type[P]) -> P | None:
    """The manifest part (`RankPart` or `LauncherPart`) at `path`; None when it is being
    replaced right now, or damaged (its fields of the wrong type take their defaults)."""
    try:
        return kind.from_json(json.loads(path.read_text(encoding="utf-8")), path.name, [])
    except (OSError, ValueError, RecursionError, InputError):
        return None


def _read_parts(run_dir: Path) -> tuple[dict[int, RankPart], dict[int, LauncherPart]]:
    """The readable parts (see `read_part`)."""
    ranks: dict[int, RankPart] = {}
    launchers: dict[int, LauncherPart] = {}
    parts = run_dir / PARTS_DIR
    if not parts.is_dir():
        return ranks, launchers
    for path in sorted(parts.glob(RANK_PART_GLOB)):
        if (part := read_part(path, RankPart)) is not None:
            ranks[part.entry.rank] = part
    for path in sorted(parts.glob(LAUNCHER_PART_GLOB)):
        if (launcher := read_part(path, LauncherPart)) is not None:
            launchers[launcher.node_rank] = launcher
    return ranks, launchers


def _rank_entry(run_dir: Path, part: RankPart) -> RankEntry:
    """The part's entry, with paths kept only for files that exist."""
    e = part.entry

    def present(rel: str | None) -> str | None:
        return rel if rel is not None and (run_dir / rel).is_file() else None

    timeline = present(e.memory_timeline)
    return replace(
        e,
        trace=present(e.trace),
        memory_timeline=timeline,
        memory_snapshot=present(e.memory_snapshot),
        oom_record=present(e.oom_record),
        step_log=present(e.step_log),
        memory_timeline_categorized=e.memory_timeline_categorized if timeline else None,
        missing=False,
    )


def _first(values: list[Any]) -> Any:
    return next((v for v in values if v is not None), None)


def build_manifest(run_dir: str | Path) -> Manifest:
    """The merged manifest of `run_dir` from the parts present now (nothing is written)."""
    root = Path(run_dir)
    ranks, launchers = _read_parts(root)
    ordered = [ranks[r] for r in sorted(ranks)]
    launcher_list = [launchers[k] for k in sorted(launchers)]
    head = launchers.get(0) or (launcher_list[0] if launcher_list else None)
    lead = ranks.get(0) or (ordered[0] if ordered else None)

    world_size = _first([p.world_size for p in ordered])
    if world_size is None:
        world_size = _first([lnch.expected_world_size for lnch in launcher_list])
    # A part of a rank beyond the world size (a reused folder) widens it: every rank is listed.
    world_size = max(world_size or 0, len(ordered), max(ranks, default=-1) + 1, 1)
    entries = [
        _rank_entry(root, ranks[r]) if r in ranks else RankEntry(rank=r, missing=True)
        for r in range(world_size)
    ]

    run_info: dict[str, Any] = dict(lead.run_info) if lead else {}
    starts = [p.entry.started_at for p in ordered] + [lc.started_at for lc in launcher_list]
    ends = [p.entry.ended_at for p in ordered] + [lc.ended_at for lc in launcher_list]
    launcher_codes = [lc.exit_code for lc in launcher_list if lc.exit_code is not None]
    rank_codes = [e.exit_code for e in entries if e.exit_code not in (None, 0)]
    if launcher_codes:
        code: int | None = next((c for c in launcher_codes if c != 0), 0)
    else:
        code = rank_codes[0] if rank_codes else _first([e.exit_code for e in entries])
    error = _first([e.error for e in entries]) or _first([lc.error for lc in launcher_list])
    harness = run_info.get("harness")
    units_warnings: list[str] = []
    raw_units = run_info.get("fsdp_units")
    units = [
        FsdpUnitRecord.from_json(u, f"fsdp_units[{i}]", units_warnings)
        for i, u in enumerate(raw_units if isinstance(raw_units, list) else [])
    ]
    return Manifest(
        schema=MANIFEST_SCHEMA,
        zdiag_version=__version__,
        command=(head.command if head else ()) or (lead.command if lead else ()),
        cwd=(head.cwd if head else None) or (lead.cwd if lead else None),
        started_at=min((t for t in starts if t), default=None),
        ended_at=max((t for t in ends if t), default=None),
        world_size=world_size,
        nnodes=head.nnodes if head else 1,
        hosts=tuple(sorted({e.host for e in entries if e.host})),
        device=lead.entry.device if lead else None,
        backend=_first([p.backend for p in ordered]),
        versions=dict(lead.versions) if lead else {},
        harness=harness if isinstance(harness, dict) else None,
        profile=(head.profile if head else None) or (lead.profile if lead else None),
        fsdp_units=tuple(u for u in units if u is not None),
        memory_budget_bytes=memory_budget_bytes(run_info),
        run_info={k: v for k, v in run_info.items() if k not in _LIFTED_RUN_INFO},
        ranks=tuple(entries),
        exit=ExitInfo(code=code, oom=any(e.oom for e in entries), error=error),
    )


def merge_manifest(run_dir: str | Path) -> Manifest:
    """Build the manifest from the parts in `run_dir` and write `manifest.json` atomically."""
    manifest = build_manifest(run_dir)
    write_json_atomically(Path(run_dir) / MANIFEST, manifest.to_json())
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
