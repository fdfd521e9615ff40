"""The run directory's records: the manifest, its parts, and the OOM record (`rundir.py` says
where each file lies; docs/run-dir.md describes them for users).

The collectors write them with `to_json()`; the launcher and the analyzers read them with
`from_json()`, which is tolerant (see `record_codec.py`): unknown fields are ignored (files from
newer zdiag builds load), a field of the wrong type takes its documented default and adds a
warning, and only damage that leaves nothing to analyze (not a JSON object, a rank outside
0..world_size-1) raises `InputError`.

Standard library only (plus zdiag.errors): the launcher and the analyzers import it without torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zdiag.errors import InputError

from .record_codec import (
    INT64_MAX,
    WRITTEN_WHEN_SET,
    Fields,
    JsonRecord,
    as_object,
    at_least,
    nested_sep,
    not_written,
    run_path,
    show_int,
)
from .rundir import MANIFEST, MANIFEST_SCHEMA

MAX_WORLD_SIZE = 1 << 22
"""Ranks and world sizes above this (4 194 304) are taken as damage, not as a real job."""


def check_rank(value: int, world_size: int | None, where: str) -> int:
    """`value` if it is a rank of a job of `world_size` ranks (0..world_size-1; without a world
    size, 0..MAX_WORLD_SIZE-1), else InputError naming `where` the rank came from."""
    limit = world_size if world_size else MAX_WORLD_SIZE
    if 0 <= value < limit:
        return value
    shown = show_int(value)
    bound = f"the world size is {world_size}" if world_size else f"at most {MAX_WORLD_SIZE - 1}"
    raise InputError(
        f"{where}: rank {shown} is not a valid rank ({bound}); the file is damaged or belongs to "
        "another run."
    )


def _rank_of(data: Mapping[str, Any], where: str, world_size: int | None) -> int:
    """The object's `rank`, checked by `check_rank`; InputError when it is not a whole number."""
    rank = data.get("rank")
    if isinstance(rank, float) and rank.is_integer():
        rank = int(rank)
    if isinstance(rank, bool) or not isinstance(rank, int):
        shown = repr(rank) if len(repr(rank)) <= 40 else repr(rank)[:37] + "..."
        raise InputError(f"{where}: rank is {shown}, not a whole number; fix or remove it.")
    return check_rank(rank, world_size, where)


def _lenient_object(data: Any, where: str, warnings: list[str]) -> Mapping[str, Any] | None:
    """`data` when it is an object; None when absent; None and a warning when not an object."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        warnings.append(f"{where}: not an object; ignored")
        return None
    return data


@dataclass(frozen=True)
class FsdpUnitRecord(JsonRecord):
    """One `fully_shard` unit recorded with `record_run_info(fsdp_units=[...])`."""

    name: str
    param_count: int | None = at_least(0)
    param_bytes: int | None = at_least(0)

    @classmethod
    def from_json(cls, data: Any, where: str, warnings: list[str]) -> FsdpUnitRecord | None:  # type: ignore[override]
        """The unit, or None (with a warning) when `data` is not an object."""
        if not isinstance(data, dict):
            warnings.append(f"{where}: not an object; ignored")
            return None
        return cls.read(data, where, warnings)


@dataclass(frozen=True)
class SourceLine(JsonRecord):
    """A line of the user's code: where a rank raised (`ranks[i].error_source`)."""

    file: str
    line: int
    function: str | None = None
    code: str | None = None

    @classmethod
    def from_json(cls, data: Any, where: str, warnings: list[str]) -> SourceLine | None:  # type: ignore[override]
        """The line, or None (with a warning) when it is not an object with a file and line."""
        obj = _lenient_object(data, where, warnings)
        if obj is None:
            return None
        f = Fields(obj, where, warnings)
        file, line = f.str_or_none("file"), f.int_or_none("line", minimum=0)
        if file is None or line is None:
            warnings.append(f"{where}: no file and line; ignored")
            return None
        return cls.read(obj, where, warnings, file=file, line=line)


@dataclass(frozen=True)
class HangRecord(JsonRecord):
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
    dump: str | None = run_path()

    @classmethod
    def from_json(cls, data: Any, where: str, warnings: list[str]) -> HangRecord | None:  # type: ignore[override]
        """The record, or None (with a warning) when it is not an object."""
        obj = _lenient_object(data, where, warnings)
        if obj is None:
            return None
        step = Fields(obj, where, warnings).int_or_none("step", minimum=0) or 0
        ranks = obj.get("group_ranks")
        valid = (
            r
            for r in (ranks if isinstance(ranks, list) else [])
            if type(r) is int and 0 <= r < MAX_WORLD_SIZE
        )
        return cls.read(obj, where, warnings, step=step, group_ranks=tuple(valid))


@dataclass(frozen=True)
class RankEntry(JsonRecord):
    """One rank in the merged manifest (`ranks[i]`). Paths are relative to RUN_DIR, or None."""

    rank: int
    local_rank: int | None = at_least(0)
    node_rank: int | None = at_least(0)
    host: str | None = None
    pid: int | None = None
    device: str | None = None  # "cpu" | "cuda:<index>"; None: not known (yet)
    # the CPU cores the rank may run on, as ranges ("0-3,8"): its affinity when its part was
    # written; None where the OS does not say (analyzers/run/core_use.py reads it)
    cpu_set: str | None = field(default=None, metadata=WRITTEN_WHEN_SET)
    trace: str | None = run_path()
    memory_timeline: str | None = run_path()
    memory_snapshot: str | None = run_path()
    oom_record: str | None = run_path()
    memory_timeline_categorized: bool | None = None
    step_log: str | None = run_path()
    steps: int = at_least(0, 0)
    step_log_truncated: bool = False
    exit_code: int | None = None  # None: the rank did not finish (killed), or still running
    oom: bool = False
    error: str | None = None
    # the user's line the exception came from
    error_source: SourceLine | None = field(default=None, metadata=WRITTEN_WHEN_SET)
    collector_errors: tuple[str, ...] = ()
    started_at: str | None = None
    ended_at: str | None = None
    # "SIGTERM", "SIGINT (...)": a signal ended the rank
    ended_by: str | None = field(default=None, metadata=WRITTEN_WHEN_SET)
    # the hang watchdog fired on this rank
    hang: HangRecord | None = field(default=None, metadata=WRITTEN_WHEN_SET)
    # where the training thread was when a signal ended it
    stopped_in: HangRecord | None = field(default=None, metadata=WRITTEN_WHEN_SET)
    missing: bool = field(default=False, metadata=WRITTEN_WHEN_SET)  # the rank never wrote a part
    # {process-group name: OS thread ids}: each gloo group's worker threads (group_threads.py)
    group_threads: dict[str, Any] | None = field(default=None, metadata=WRITTEN_WHEN_SET)

    @classmethod
    def from_json(
        cls, data: Any, where: str, warnings: list[str], world_size: int | None = None
    ) -> RankEntry:
        """The entry; InputError when it is not an object or its rank is not a valid rank."""
        obj = as_object(data, where)
        return cls.read(obj, where, warnings, rank=_rank_of(obj, where, world_size))

    @property
    def raised(self) -> bool:
        """Whether the rank exited non-zero with a recorded exception other than out of memory
        (the `crash` finding's ranks; an OOM is explained by its memory records)."""
        return self.exit_code not in (None, 0) and bool(self.error) and not self.oom

    def thread_groups(self) -> dict[int, str]:
        """{OS thread id: process-group name} from `group_threads`; entries that are not a list
        of whole numbers, and threads claimed by two groups, are left out."""
        claims: dict[int, set[str]] = {}
        for name, tids in (self.group_threads or {}).items():
            if not isinstance(tids, list):
                continue
            for tid in tids:
                if type(tid) is int and 0 < tid <= INT64_MAX:
                    claims.setdefault(tid, set()).add(name)
        return {tid: next(iter(names)) for tid, names in claims.items() if len(names) == 1}


@dataclass(frozen=True)
class RankPart(JsonRecord):
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
        obj = as_object(data, where)
        f = Fields(obj, where, warnings)
        world_size = f.int_or_none("world_size", minimum=1)
        if world_size is not None and world_size > MAX_WORLD_SIZE:
            f.bad("world_size", world_size, f"a world size up to {MAX_WORLD_SIZE}")
            world_size = None
        # Checked against MAX_WORLD_SIZE only: the merge widens the world size to every part.
        entry = RankEntry.from_json(obj, where, warnings)
        return cls.read(obj, where, warnings, world_size=world_size, entry=entry)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this part (the entry's fields and the run-level ones, flat)."""
        entry = self.entry.to_json()
        entry.pop("missing", None)
        run_level = super().to_json()
        del run_level["entry"]
        return {**entry, **run_level}


@dataclass(frozen=True)
class LauncherPart(JsonRecord):
    """What node K's `zdiag run` writes to `manifest.d/launcher-node-<K>.json`."""

    node_rank: int
    nnodes: int = at_least(1, 1)
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
        obj = as_object(data, where)
        f = Fields(obj, where, warnings)
        node_rank = f.int_or_none("node_rank", minimum=0)
        if node_rank is None:
            raise InputError(f"{where}: no valid node_rank; fix or remove it.")
        world = f.int_or_none("expected_world_size", minimum=1)
        world = world if world is None or world <= MAX_WORLD_SIZE else None
        return cls.read(obj, where, warnings, node_rank=node_rank, expected_world_size=world)


@dataclass(frozen=True)
class ExitInfo(JsonRecord):
    """How the training ended: `manifest["exit"]`."""

    code: int | None = None
    oom: bool = False
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class Manifest(JsonRecord):
    """RUN_DIR/manifest.json (schema `zdiag.manifest/1`), as the analyzers read it.

    `warnings` (not serialized) says which fields of the file were ignored when it was read.
    """

    schema: str = MANIFEST_SCHEMA
    zdiag_version: str | None = None
    command: tuple[str, ...] = ()
    cwd: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    world_size: int
    nnodes: int = at_least(1, 1)
    hosts: tuple[str, ...] = ()
    device: str | None = None
    backend: str | None = None
    versions: dict[str, Any] = field(default_factory=dict)
    harness: dict[str, Any] | None = None
    profile: dict[str, Any] | None = None
    fsdp_units: tuple[FsdpUnitRecord, ...] = ()
    memory_budget_bytes: int | None = at_least(1)
    run_info: dict[str, Any] = field(default_factory=dict)
    ranks: tuple[RankEntry, ...] = ()
    exit: ExitInfo = field(default=ExitInfo(), metadata=nested_sep(": "))
    warnings: tuple[str, ...] = not_written()

    @classmethod
    def from_json(cls, data: Any, where: str = MANIFEST) -> Manifest:  # type: ignore[override]
        """The manifest of decoded JSON `data` (tolerant: see the module docstring).

        InputError when `data` is not an object, `ranks` is not a list, or an entry's rank is not
        within 0..world_size-1.
        """
        found: list[str] = []
        obj = as_object(data, where)
        f = Fields(obj, where, found)
        schema = _manifest_schema(f)
        raw_ranks = obj.get("ranks")
        if raw_ranks is None:
            raw_ranks = []
        if not isinstance(raw_ranks, list):
            raise InputError(f"{where}: ranks is not a list; fix or remove the manifest.")
        claimed = obj.get("world_size")
        if isinstance(claimed, int) and not isinstance(claimed, bool) and claimed > MAX_WORLD_SIZE:
            raise InputError(
                f"{where}: world_size {show_int(claimed)} is not a real job's size (at most "
                f"{MAX_WORLD_SIZE}); the manifest is damaged."
            )
        world_size = f.int_or_none("world_size", minimum=1)
        if world_size is None:
            world_size = max(len(raw_ranks), 1)
        ranks = tuple(
            RankEntry.from_json(r, f"{where}: ranks[{i}]", found, world_size)
            for i, r in enumerate(raw_ranks)
        )
        manifest = cls.read(obj, where, found, schema=schema, world_size=world_size, ranks=ranks)
        return dataclasses.replace(manifest, warnings=tuple(found))

    def unit_param_bytes(self) -> dict[str, int]:
        """{unit fqn: parameter bytes} of the recorded FSDP units that have a positive size."""
        return {u.name: u.param_bytes for u in self.fsdp_units if u.param_bytes}


def _manifest_schema(f: Fields) -> str:
    """The manifest's schema; InputError when it is not a zdiag manifest's, a warning when newer."""
    schema = f.str_or_none("schema") or MANIFEST_SCHEMA
    if not schema.startswith("zdiag.manifest/"):
        raise InputError(
            f"{f.where}: schema {schema!r} is not a zdiag run manifest; pass the run's traces "
            "without it."
        )
    if schema != MANIFEST_SCHEMA:
        f.warnings.append(
            f"{f.where}: schema {schema!r} is newer than this zdiag reads ({MANIFEST_SCHEMA}); "
            "the fields it knows are used"
        )
    return schema


@dataclass(frozen=True)
class OomRecord(JsonRecord):
    """RUN_DIR/memory/rank-<N>.oom.json: what was known when the rank ran out of memory."""

    rank: int
    host: str | None = None
    step: int | None = at_least(0)
    time_unix: float | None = None
    error_type: str | None = None
    error: str = ""
    mem_allocated_bytes: int | None = at_least(0)
    mem_reserved_bytes: int | None = at_least(0)
    mem_peak_bytes: int | None = at_least(0)
    memory_budget_bytes: int | None = at_least(1)
    profiler_window_open: bool = False
    # the module paths whose call was running at the failure, outermost first (the model's own
    # description paths; collectors/failure_point.py), and whether it came inside backward
    modules: tuple[str, ...] = field(default=(), metadata=WRITTEN_WHEN_SET)
    in_backward: bool = field(default=False, metadata=WRITTEN_WHEN_SET)

    @classmethod
    def from_json(
        cls, data: Any, where: str, warnings: list[str], world_size: int | None = None
    ) -> OomRecord:
        """The record; InputError when it is not an object or its rank is not valid."""
        obj = as_object(data, where)
        return cls.read(obj, where, warnings, rank=_rank_of(obj, where, world_size))
