"""The run directory contract: its layout (every path spelled here once) and typed manifest records.

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
```

Paths stored in the manifest are relative to RUN_DIR (POSIX separators). docs/run-dir.md is the
user-facing description of this contract.

The collectors write with `to_json()`; the analyzers read with `from_json()`, which is tolerant:
unknown fields are ignored (files from newer zdiag builds load), a field of the wrong type takes
its documented default and adds a warning, and only damage that leaves nothing to analyze (not a
JSON object, a rank outside 0..world_size-1) raises `InputError`. Analyzers read run-dir files
through `run_file` / `read_run_file` only: regular files, confined to the run directory, capped.

Standard library only (plus zdiag.errors): the launcher and the analyzers import it without torch.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from zdiag.errors import InputError

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

MAX_WORLD_SIZE = 1 << 22
"""Ranks and world sizes above this (4 194 304) are taken as damage, not as a real job."""
MAX_SMALL_FILE_BYTES = 64 * 1024 * 1024
"""The cap on a manifest, a manifest part or an OOM record read whole (64 MiB)."""


# --- layout -----------------------------------------------------------------------------------


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


# --- reading run-dir files (the analyzers' side) -----------------------------------------------


def run_file(run_dir: str | Path, rel: str | Path) -> Path:
    """The file `rel` names inside `run_dir`, checked: after resolving links it stays inside the
    run directory and is a regular file (no FIFO, device or folder). InputError otherwise."""
    root = Path(run_dir).resolve()
    rel_path = Path(rel)
    path = (rel_path if rel_path.is_absolute() else root / rel_path).resolve()
    if path != root and root not in path.parents:
        raise InputError(
            f"{rel}: the path points outside the run directory {root}; it was not read."
        )
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc}).") from None
    if not stat.S_ISREG(mode):
        raise InputError(f"{path}: not a regular file (a folder, FIFO or device); it was not read.")
    return path


def read_run_file(
    run_dir: str | Path, rel: str | Path, *, max_bytes: int = MAX_SMALL_FILE_BYTES
) -> bytes:
    """The bytes of the run-dir file `rel` (checked by `run_file`), at most `max_bytes`.

    The one place where the analyzers read a small run-dir file whole (the manifest, an OOM
    record); InputError when it is not a confined regular file, unreadable, or over the cap.
    """
    path = run_file(run_dir, rel)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc}).") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # replaced since run_file looked
            raise InputError(f"{path}: not a regular file; it was not read.")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputError(
            f"{path}: larger than {max_bytes} bytes, too large for a run-directory record; "
            "it is damaged or not written by zdiag."
        )
    return data


def read_run_json(run_dir: str | Path, rel: str | Path) -> Any:
    """A small run-dir JSON file decoded (see `read_run_file`); InputError when not valid JSON."""
    data = read_run_file(run_dir, rel)
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise InputError(
            f"{Path(run_dir) / rel}: not valid JSON ({_short(exc)}); fix or remove it."
        ) from None


def check_rank(value: int, world_size: int | None, where: str) -> int:
    """`value` if it is a rank of a job of `world_size` ranks (0..world_size-1; without a world
    size, 0..MAX_WORLD_SIZE-1), else InputError naming `where` the rank came from."""
    limit = world_size if world_size else MAX_WORLD_SIZE
    if 0 <= value < limit:
        return value
    shown = _show_int(value)
    bound = f"the world size is {world_size}" if world_size else f"at most {MAX_WORLD_SIZE - 1}"
    raise InputError(
        f"{where}: rank {shown} is not a valid rank ({bound}); the file is damaged or belongs to "
        "another run."
    )


def _show_int(value: int) -> str:
    """An integer for a message: as is, or its digit count when it is absurdly long (never
    converting a huge integer to text, which Python limits to 4300 digits)."""
    if abs(value) < 10**12:
        return str(value)
    sign = "-" if value < 0 else ""
    if value.bit_length() > 10_000:
        return f"{sign}about 2^{value.bit_length()}"
    digits = str(abs(value))
    return f"{sign}{digits[:3]}... ({len(digits)} digits)"


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


# --- tolerant field reading ----------------------------------------------------------------------


class _Fields:
    """Typed reads of one JSON object; a wrong type gives the default and a warning."""

    def __init__(self, data: Mapping[str, Any], where: str, warnings: list[str]) -> None:
        self.data = data
        self.where = where
        self.warnings = warnings

    def _bad(self, key: str, value: Any, what: str) -> None:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        self.warnings.append(f"{self.where}: {key} is {shown}, not {what}; ignored")

    def int_or_none(self, key: str, *, minimum: int | None = None) -> int | None:
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self._bad(key, value, "a whole number")
            return None
        if minimum is not None and value < minimum:
            self._bad(key, value, f"a whole number of at least {minimum}")
            return None
        return value

    def int_(self, key: str, default: int, *, minimum: int | None = None) -> int:
        value = self.int_or_none(key, minimum=minimum)
        return default if value is None else value

    def float_or_none(self, key: str) -> float | None:
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            self._bad(key, value, "a number")
            return None
        return float(value)

    def str_or_none(self, key: str) -> str | None:
        value = self.data.get(key)
        if value is None or isinstance(value, str):
            return value
        self._bad(key, value, "a string")
        return None

    def bool_or_none(self, key: str) -> bool | None:
        value = self.data.get(key)
        if value is None or isinstance(value, bool):
            return value
        self._bad(key, value, "true or false")
        return None

    def bool_(self, key: str) -> bool:
        return bool(self.bool_or_none(key))

    def strs(self, key: str) -> tuple[str, ...]:
        value = self.data.get(key)
        if value is None:
            return ()
        if not isinstance(value, list):
            self._bad(key, value, "a list of strings")
            return ()
        return tuple(str(v) for v in value)

    def obj(self, key: str) -> dict[str, Any] | None:
        value = self.data.get(key)
        if value is None or isinstance(value, dict):
            return value
        self._bad(key, value, "an object")
        return None

    def relpath(self, key: str) -> str | None:
        """A run-dir path: relative, POSIX, never climbing out with `..` (else ignored)."""
        value = self.str_or_none(key)
        if value is None:
            return None
        pure = PurePosixPath(value)
        if not value or pure.is_absolute() or ".." in pure.parts or "\\" in value:
            self.warnings.append(
                f"{self.where}: {key} {value!r} points outside the run directory; ignored"
            )
            return None
        return value


def _object(data: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(data, dict):
        raise InputError(f"{where}: not a JSON object; fix or remove it.")
    return data


def _rank_of(data: Mapping[str, Any], where: str, world_size: int | None) -> int:
    """The object's `rank`, checked by `check_rank`; InputError when it is not a whole number."""
    rank = data.get("rank")
    if isinstance(rank, float) and rank.is_integer():
        rank = int(rank)
    if isinstance(rank, bool) or not isinstance(rank, int):
        shown = repr(rank) if len(repr(rank)) <= 40 else repr(rank)[:37] + "..."
        raise InputError(f"{where}: rank is {shown}, not a whole number; fix or remove it.")
    return check_rank(rank, world_size, where)


# --- records -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FsdpUnitRecord:
    """One `fully_shard` unit recorded with `record_run_info(fsdp_units=[...])`."""

    name: str
    param_count: int | None = None
    param_bytes: int | None = None

    @classmethod
    def from_json(cls, data: Any, where: str, warnings: list[str]) -> FsdpUnitRecord | None:
        """The unit, or None (with a warning) when `data` is not an object."""
        if not isinstance(data, dict):
            warnings.append(f"{where}: not an object; ignored")
            return None
        f = _Fields(data, where, warnings)
        return cls(
            name=f.str_or_none("name") or "",
            param_count=f.int_or_none("param_count", minimum=0),
            param_bytes=f.int_or_none("param_bytes", minimum=0),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this unit."""
        return {"name": self.name, "param_count": self.param_count, "param_bytes": self.param_bytes}


@dataclass(frozen=True)
class SourceLine:
    """A line of the user's code: where a rank raised (`ranks[i].error_source`)."""

    file: str
    line: int
    function: str | None = None
    code: str | None = None

    @classmethod
    def from_json(cls, data: Any, where: str, warnings: list[str]) -> SourceLine | None:
        """The line, or None (with a warning) when it is not an object with a file and line."""
        if data is None:
            return None
        if not isinstance(data, Mapping):
            warnings.append(f"{where}: not an object; ignored")
            return None
        f = _Fields(data, where, warnings)
        file, line = f.str_or_none("file"), f.int_or_none("line", minimum=0)
        if file is None or line is None:
            warnings.append(f"{where}: no file and line; ignored")
            return None
        return cls(file, line, f.str_or_none("function"), f.str_or_none("code"))

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this line."""
        return {"file": self.file, "line": self.line, "function": self.function, "code": self.code}


@dataclass(frozen=True)
class HangRecord:
    """What the hang watchdog saw on a rank that stopped finishing steps (`ranks[i].hang`).

    `op` is the innermost torch.distributed function the training thread was in (None: not in a
    collective: the rank itself is stuck), with its process group's name, ranks and sequence
    number and the FSDP unit when known; `user_*` is the innermost frame of the user's code;
    `dump` the run-dir path of the full dump (every thread's stack, the flight recorder).
    """

    step: int
    stalled_s: float
    timeout_s: float
    time_unix: float | None = None
    op: str | None = None
    group_name: str | None = None
    group_ranks: tuple[int, ...] = ()
    sequence_number: int | None = None
    fsdp_unit: str | None = None
    user_file: str | None = None
    user_line: int | None = None
    user_function: str | None = None
    user_code: str | None = None
    dump: str | None = None

    @classmethod
    def from_json(cls, data: Any, where: str, warnings: list[str]) -> HangRecord | None:
        """The record, or None (with a warning) when it is not an object."""
        if data is None:
            return None
        if not isinstance(data, Mapping):
            warnings.append(f"{where}: not an object; ignored")
            return None
        f = _Fields(data, where, warnings)
        ranks = data.get("group_ranks")
        return cls(
            step=f.int_("step", 0, minimum=0),
            stalled_s=f.float_or_none("stalled_s") or 0.0,
            timeout_s=f.float_or_none("timeout_s") or 0.0,
            time_unix=f.float_or_none("time_unix"),
            op=f.str_or_none("op"),
            group_name=f.str_or_none("group_name"),
            group_ranks=tuple(
                r
                for r in (ranks if isinstance(ranks, list) else [])
                if type(r) is int and 0 <= r < MAX_WORLD_SIZE
            ),
            sequence_number=f.int_or_none("sequence_number"),
            fsdp_unit=f.str_or_none("fsdp_unit"),
            user_file=f.str_or_none("user_file"),
            user_line=f.int_or_none("user_line"),
            user_function=f.str_or_none("user_function"),
            user_code=f.str_or_none("user_code"),
            dump=f.relpath("dump"),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this record."""
        return {
            "step": self.step,
            "stalled_s": self.stalled_s,
            "timeout_s": self.timeout_s,
            "time_unix": self.time_unix,
            "op": self.op,
            "group_name": self.group_name,
            "group_ranks": list(self.group_ranks),
            "sequence_number": self.sequence_number,
            "fsdp_unit": self.fsdp_unit,
            "user_file": self.user_file,
            "user_line": self.user_line,
            "user_function": self.user_function,
            "user_code": self.user_code,
            "dump": self.dump,
        }


@dataclass(frozen=True)
class RankEntry:
    """One rank in the merged manifest (`ranks[i]`). Paths are relative to RUN_DIR, or None."""

    rank: int
    local_rank: int | None = None
    node_rank: int | None = None
    host: str | None = None
    pid: int | None = None
    device: str | None = None  # "cpu" | "cuda:<index>"; None: not known (yet)
    trace: str | None = None
    memory_timeline: str | None = None
    memory_snapshot: str | None = None
    oom_record: str | None = None
    memory_timeline_categorized: bool | None = None
    step_log: str | None = None
    steps: int = 0
    step_log_truncated: bool = False
    exit_code: int | None = None  # None: the rank did not finish (killed), or still running
    oom: bool = False
    error: str | None = None
    error_source: SourceLine | None = None  # the user's line the exception came from
    collector_errors: tuple[str, ...] = ()
    started_at: str | None = None
    ended_at: str | None = None
    ended_by: str | None = None  # "SIGTERM", "SIGINT (...)": a signal ended the rank
    hang: HangRecord | None = None  # the hang watchdog fired on this rank
    stopped_in: HangRecord | None = None  # where the training thread was when a signal ended it
    missing: bool = False  # the rank never wrote a part

    @classmethod
    def from_json(
        cls, data: Any, where: str, warnings: list[str], world_size: int | None = None
    ) -> RankEntry:
        """The entry; InputError when it is not an object or its rank is not a valid rank."""
        f = _Fields(_object(data, where), where, warnings)
        rank = _rank_of(data, where, world_size)
        return cls(
            rank=rank,
            local_rank=f.int_or_none("local_rank", minimum=0),
            node_rank=f.int_or_none("node_rank", minimum=0),
            host=f.str_or_none("host"),
            pid=f.int_or_none("pid"),
            device=f.str_or_none("device"),
            trace=f.relpath("trace"),
            memory_timeline=f.relpath("memory_timeline"),
            memory_snapshot=f.relpath("memory_snapshot"),
            oom_record=f.relpath("oom_record"),
            memory_timeline_categorized=f.bool_or_none("memory_timeline_categorized"),
            step_log=f.relpath("step_log"),
            steps=f.int_("steps", 0, minimum=0),
            step_log_truncated=f.bool_("step_log_truncated"),
            exit_code=f.int_or_none("exit_code"),
            oom=f.bool_("oom"),
            error=f.str_or_none("error"),
            error_source=SourceLine.from_json(
                data.get("error_source"), f"{where}.error_source", warnings
            ),
            collector_errors=f.strs("collector_errors"),
            started_at=f.str_or_none("started_at"),
            ended_at=f.str_or_none("ended_at"),
            ended_by=f.str_or_none("ended_by"),
            hang=HangRecord.from_json(data.get("hang"), f"{where}.hang", warnings),
            stopped_in=HangRecord.from_json(
                data.get("stopped_in"), f"{where}.stopped_in", warnings
            ),
            missing=f.bool_("missing"),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this entry (`missing` only when true)."""
        out: dict[str, Any] = {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "node_rank": self.node_rank,
            "host": self.host,
            "pid": self.pid,
            "device": self.device,
            "trace": self.trace,
            "memory_timeline": self.memory_timeline,
            "memory_snapshot": self.memory_snapshot,
            "oom_record": self.oom_record,
            "memory_timeline_categorized": self.memory_timeline_categorized,
            "step_log": self.step_log,
            "steps": self.steps,
            "step_log_truncated": self.step_log_truncated,
            "exit_code": self.exit_code,
            "oom": self.oom,
            "error": self.error,
            "collector_errors": list(self.collector_errors),
            "started_at": self.started_at,
            "ended_at": self.ended_at,
        }
        if self.error_source is not None:
            out["error_source"] = self.error_source.to_json()
        if self.ended_by is not None:
            out["ended_by"] = self.ended_by
        if self.hang is not None:
            out["hang"] = self.hang.to_json()
        if self.stopped_in is not None:
            out["stopped_in"] = self.stopped_in.to_json()
        if self.missing:
            out["missing"] = True
        return out


@dataclass(frozen=True)
class RankPart:
    """What one rank writes to `manifest.d/rank-<N>.json`: its entry plus the run-level facts it
    knows (merged into the manifest from rank 0, or the lowest rank present)."""

    entry: RankEntry
    world_size: int | None = None
    command: tuple[str, ...] = ()
    cwd: str | None = None
    backend: str | None = None
    versions: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] | None = None
    run_info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any, where: str, warnings: list[str]) -> RankPart:
        """The part; InputError when it is not an object or names no valid rank."""
        f = _Fields(_object(data, where), where, warnings)
        world_size = f.int_or_none("world_size", minimum=1)
        if world_size is not None and world_size > MAX_WORLD_SIZE:
            f._bad("world_size", world_size, f"a world size up to {MAX_WORLD_SIZE}")
            world_size = None
        return cls(
            # Checked against MAX_WORLD_SIZE only: the merge widens the world size to every part.
            entry=RankEntry.from_json(data, where, warnings),
            world_size=world_size,
            command=f.strs("command"),
            cwd=f.str_or_none("cwd"),
            backend=f.str_or_none("backend"),
            versions=f.obj("versions") or {},
            profile=f.obj("profile"),
            run_info=f.obj("run_info") or {},
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this part (the entry's fields and the run-level ones, flat)."""
        entry = self.entry.to_json()
        entry.pop("missing", None)
        return {
            **entry,
            "world_size": self.world_size,
            "command": list(self.command),
            "cwd": self.cwd,
            "backend": self.backend,
            "versions": dict(self.versions),
            "profile": self.profile,
            "run_info": dict(self.run_info),
        }


@dataclass(frozen=True)
class LauncherPart:
    """What node K's `zdiag run` writes to `manifest.d/launcher-node-<K>.json`."""

    node_rank: int
    nnodes: int = 1
    command: tuple[str, ...] = ()
    cwd: str | None = None
    expected_world_size: int | None = None
    profile: dict[str, Any] | None = None
    started_at: str | None = None
    ended_at: str | None = None
    exit_code: int | None = None
    error: str | None = None

    @classmethod
    def from_json(cls, data: Any, where: str, warnings: list[str]) -> LauncherPart:
        """The part; InputError when it is not an object or has no valid node rank."""
        f = _Fields(_object(data, where), where, warnings)
        node_rank = f.int_or_none("node_rank", minimum=0)
        if node_rank is None:
            raise InputError(f"{where}: no valid node_rank; fix or remove it.")
        world = f.int_or_none("expected_world_size", minimum=1)
        return cls(
            node_rank=node_rank,
            nnodes=f.int_("nnodes", 1, minimum=1),
            command=f.strs("command"),
            cwd=f.str_or_none("cwd"),
            expected_world_size=world if world is None or world <= MAX_WORLD_SIZE else None,
            profile=f.obj("profile"),
            started_at=f.str_or_none("started_at"),
            ended_at=f.str_or_none("ended_at"),
            exit_code=f.int_or_none("exit_code"),
            error=f.str_or_none("error"),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this part."""
        return {
            "node_rank": self.node_rank,
            "nnodes": self.nnodes,
            "command": list(self.command),
            "cwd": self.cwd,
            "expected_world_size": self.expected_world_size,
            "profile": self.profile,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "exit_code": self.exit_code,
            "error": self.error,
        }


@dataclass(frozen=True)
class ExitInfo:
    """How the training ended: `manifest["exit"]`."""

    code: int | None = None
    oom: bool = False
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object."""
        return {"code": self.code, "oom": self.oom, "error": self.error}


@dataclass(frozen=True)
class Manifest:
    """RUN_DIR/manifest.json (schema `zdiag.manifest/1`), as the analyzers read it.

    `warnings` (not serialized) says which fields of the file were ignored when it was read.
    """

    world_size: int
    ranks: tuple[RankEntry, ...] = ()
    schema: str = MANIFEST_SCHEMA
    zdiag_version: str | None = None
    command: tuple[str, ...] = ()
    cwd: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    nnodes: int = 1
    hosts: tuple[str, ...] = ()
    device: str | None = None
    backend: str | None = None
    versions: dict[str, Any] = field(default_factory=dict)
    harness: dict[str, Any] | None = None
    profile: dict[str, Any] | None = None
    fsdp_units: tuple[FsdpUnitRecord, ...] = ()
    memory_budget_bytes: int | None = None
    run_info: dict[str, Any] = field(default_factory=dict)
    exit: ExitInfo = ExitInfo()
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_json(cls, data: Any, where: str = MANIFEST) -> Manifest:
        """The manifest of decoded JSON `data` (tolerant: see the module docstring).

        InputError when `data` is not an object, `ranks` is not a list, or an entry's rank is not
        within 0..world_size-1.
        """
        warnings: list[str] = []
        f = _Fields(_object(data, where), where, warnings)
        schema = f.str_or_none("schema") or MANIFEST_SCHEMA
        if not schema.startswith("zdiag.manifest/"):
            raise InputError(
                f"{where}: schema {schema!r} is not a zdiag run manifest; pass the run's traces "
                "without it."
            )
        if schema != MANIFEST_SCHEMA:
            warnings.append(
                f"{where}: schema {schema!r} is newer than this zdiag reads ({MANIFEST_SCHEMA}); "
                "the fields it knows are used"
            )
        raw_ranks = data.get("ranks")
        if raw_ranks is None:
            raw_ranks = []
        if not isinstance(raw_ranks, list):
            raise InputError(f"{where}: ranks is not a list; fix or remove the manifest.")
        world_size = f.int_or_none("world_size", minimum=1)
        if world_size is not None and world_size > MAX_WORLD_SIZE:
            raise InputError(
                f"{where}: world_size {_show_int(world_size)} is not a real job's size (at most "
                f"{MAX_WORLD_SIZE}); the manifest is damaged."
            )
        if world_size is None:
            world_size = max(len(raw_ranks), 1)
        ranks = tuple(
            RankEntry.from_json(r, f"{where}: ranks[{i}]", warnings, world_size)
            for i, r in enumerate(raw_ranks)
        )
        raw_units = data.get("fsdp_units")
        if raw_units is not None and not isinstance(raw_units, list):
            f._bad("fsdp_units", raw_units, "a list")
            raw_units = None
        units = (
            FsdpUnitRecord.from_json(u, f"{where}: fsdp_units[{i}]", warnings)
            for i, u in enumerate(raw_units or [])
        )
        ex = _Fields(f.obj("exit") or {}, f"{where}: exit", warnings)
        return cls(
            world_size=world_size,
            ranks=ranks,
            schema=schema,
            zdiag_version=f.str_or_none("zdiag_version"),
            command=f.strs("command"),
            cwd=f.str_or_none("cwd"),
            started_at=f.str_or_none("started_at"),
            ended_at=f.str_or_none("ended_at"),
            nnodes=f.int_("nnodes", 1, minimum=1),
            hosts=f.strs("hosts"),
            device=f.str_or_none("device"),
            backend=f.str_or_none("backend"),
            versions=f.obj("versions") or {},
            harness=f.obj("harness"),
            profile=f.obj("profile"),
            fsdp_units=tuple(u for u in units if u is not None),
            memory_budget_bytes=f.int_or_none("memory_budget_bytes", minimum=1),
            run_info=f.obj("run_info") or {},
            exit=ExitInfo(
                code=ex.int_or_none("code"), oom=ex.bool_("oom"), error=ex.str_or_none("error")
            ),
            warnings=tuple(warnings),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object written as manifest.json."""
        return {
            "schema": self.schema,
            "zdiag_version": self.zdiag_version,
            "command": list(self.command),
            "cwd": self.cwd,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "world_size": self.world_size,
            "nnodes": self.nnodes,
            "hosts": list(self.hosts),
            "device": self.device,
            "backend": self.backend,
            "versions": dict(self.versions),
            "harness": self.harness,
            "profile": self.profile,
            "fsdp_units": [u.to_json() for u in self.fsdp_units],
            "memory_budget_bytes": self.memory_budget_bytes,
            "run_info": dict(self.run_info),
            "ranks": [r.to_json() for r in self.ranks],
            "exit": self.exit.to_json(),
        }

    def unit_param_bytes(self) -> dict[str, int]:
        """{unit fqn: parameter bytes} of the recorded FSDP units that have a positive size."""
        return {u.name: u.param_bytes for u in self.fsdp_units if u.param_bytes}


@dataclass(frozen=True)
class OomRecord:
    """RUN_DIR/memory/rank-<N>.oom.json: what was known when the rank ran out of memory."""

    rank: int
    host: str | None = None
    step: int | None = None
    time_unix: float | None = None
    error_type: str | None = None
    error: str = ""
    mem_allocated_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    mem_peak_bytes: int | None = None
    memory_budget_bytes: int | None = None
    profiler_window_open: bool = False

    @classmethod
    def from_json(
        cls, data: Any, where: str, warnings: list[str], world_size: int | None = None
    ) -> OomRecord:
        """The record; InputError when it is not an object or its rank is not valid."""
        f = _Fields(_object(data, where), where, warnings)
        return cls(
            rank=_rank_of(data, where, world_size),
            host=f.str_or_none("host"),
            step=f.int_or_none("step", minimum=0),
            time_unix=f.float_or_none("time_unix"),
            error_type=f.str_or_none("error_type"),
            error=f.str_or_none("error") or "",
            mem_allocated_bytes=f.int_or_none("mem_allocated_bytes", minimum=0),
            mem_reserved_bytes=f.int_or_none("mem_reserved_bytes", minimum=0),
            mem_peak_bytes=f.int_or_none("mem_peak_bytes", minimum=0),
            memory_budget_bytes=f.int_or_none("memory_budget_bytes", minimum=1),
            profiler_window_open=f.bool_("profiler_window_open"),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object written as the OOM record."""
        return {
            "rank": self.rank,
            "host": self.host,
            "step": self.step,
            "time_unix": self.time_unix,
            "error_type": self.error_type,
            "error": self.error,
            "mem_allocated_bytes": self.mem_allocated_bytes,
            "mem_reserved_bytes": self.mem_reserved_bytes,
            "mem_peak_bytes": self.mem_peak_bytes,
            "memory_budget_bytes": self.memory_budget_bytes,
            "profiler_window_open": self.profiler_window_open,
        }


def read_manifest(run_dir: str | Path) -> Manifest | None:
    """RUN_DIR/manifest.json as a `Manifest`, None when there is none; InputError when damaged."""
    root = Path(run_dir)
    if not (root / MANIFEST).exists():
        return None
    data = read_run_json(root, MANIFEST)
    return Manifest.from_json(data, str(root / MANIFEST))


def model_description_relpath(rank: int) -> str:
    """The rank's model description (JSON, schema zdiag.model/1), relative to the run directory."""
    return f"{MODEL_DIR}/rank-{rank}.json"
