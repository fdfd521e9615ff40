"""Reading torch.distributed flight-recorder dumps from files: finding them, bounds, suspects.

A dump is told by its content (`is_flight_recorder_dump`: a pickled dict whose first item is its
'version', from its first SNIFF_BYTES), whatever its name. `read_dump` refuses a file over
MAX_DUMP_BYTES before reading it and loads it with the plain-container unpickler of
plain_pickle.py (a file naming any class or function is refused), and never imports torch. A
dump that is empty or cut short is not an error: the rank's process was frozen or killed while
writing, and the rank becomes a suspect (`RankDump.readable` is False). `read_dumps` reads the
dumps of one job: at most MAX_WORLD_SIZE files, one per rank. The decoded dict is checked by
flight_dump_parse.py; the analysis is analyzers/run/wait_graph.py.
"""

from __future__ import annotations

import io
import pickletools
import re
from collections.abc import Iterable
from pathlib import Path

from zdiag.errors import InputError

from .flight_dump_parse import (
    MAX_WORLD_SIZE,
    RANK_IN_NAME,
    RankDump,
    RankLists,
    parse_dump,
    rank_from_name,
)
from .plain_pickle import PlainUnpickler
from .reader import Reader

MAX_DUMP_BYTES = 512 * 1024 * 1024
"""Largest dump read (a 20k-entry buffer with C++ stacks is tens of MB); larger is refused."""

SNIFF_BYTES = 64
"""Bytes read to tell a flight-recorder dump by its content (the pickle's first key/value)."""


def _sniff(head: bytes) -> bool:
    """Whether `head` starts a pickled dict whose first item is ('version', '2.x'-like str)."""
    if not head.startswith(b"\x80"):
        return False
    strings: list[str] = []
    try:
        for op, arg, _ in pickletools.genops(head):
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "SHORT_BINSTRING"):
                strings.append(str(arg))
                if len(strings) == 2:
                    break
            elif op.name not in ("PROTO", "EMPTY_DICT", "MARK", "BINPUT", "MEMOIZE", "FRAME"):
                return False
    except (ValueError, EOFError, IndexError, KeyError):
        pass  # the sniffed head ends mid-opcode
    return (
        len(strings) == 2
        and strings[0] == "version"
        and bool(re.fullmatch(r"\d+\.\d+", strings[1]))
    )


def is_flight_recorder_dump(path: str | Path) -> bool:
    """Whether `path` is a torch flight-recorder pickle, from its first bytes (cheap: 64 bytes
    read, no unpickling); False for folders, unreadable files and empty files."""
    p = Path(path)
    try:
        if not p.is_file():
            return False
        with p.open("rb") as f:
            return _sniff(f.read(SNIFF_BYTES))
    except OSError:
        return False


def read_dump(path: str | Path, rank: int | None = None) -> RankDump:
    """One rank's dump (see `_read_dump`)."""
    return _read_dump(Path(path), rank, RankLists())


def _read_dump(p: Path, rank: int | None, lists: RankLists) -> RankDump:
    """One rank's dump. The rank is `rank`, else the number the file name ends with (torch names
    dumps `<prefix><rank>`), else the one rank all groups in its `pg_config` share.

    Empty or cut-short files give `readable=False` (a suspect rank). InputError (one sentence)
    for a file that is not a flight-recorder dump, names a class, has another major version or
    whose rank cannot be told, is out of bounds or contradicts its `pg_config`.
    """
    try:
        size = p.stat().st_size
        if size > MAX_DUMP_BYTES:
            raise InputError(
                f"{p}: {size / 2**20:.0f} MiB is more than a flight-recorder dump holds "
                f"(limit {MAX_DUMP_BYTES // 2**20} MiB); pass the per-rank dump files."
            )
        data = p.read_bytes() if size else b""
    except OSError as exc:
        raise InputError(f"{p}: cannot read the flight-recorder dump ({exc.strerror}).") from exc
    name_rank = rank if rank is not None else rank_from_name(p)
    if not data or (not _sniff(data[:SNIFF_BYTES]) and len(data) < SNIFF_BYTES):
        if name_rank is None:
            raise InputError(f"{p}: empty file, and its name ends with no rank number.")
        problem = "cut short" if data else "empty"
        return RankDump(name_rank, str(p), readable=False, problem=problem)
    if not _sniff(data[:SNIFF_BYTES]):
        raise InputError(
            f"{p}: not a torch flight-recorder dump (a pickled dict starting with its "
            "'version'); pass the files written by TORCH_FR_DUMP_TEMP_FILE or _dump_fr_trace()."
        )
    try:
        raw = PlainUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # names a class, corrupt opcode: the same to the user
        if isinstance(exc, EOFError) or "truncated" in str(exc):
            if name_rank is None:
                raise InputError(
                    f"{p}: cut-short dump, and its name ends with no rank number."
                ) from None
            return RankDump(name_rank, str(p), readable=False, problem="cut short")
        raise InputError(
            f"{p}: not a plain flight-recorder dump ({exc}); zdiag reads only dumps made of "
            "plain containers."
        ) from None
    return parse_dump(raw, p, rank, lists)


def _with_empty_siblings(found: list[Path], candidates: list[Path]) -> list[Path]:
    """`found` plus the candidates too short to be recognised that are named like the dumps
    (same name up to the trailing rank number): a rank frozen or killed while dumping."""
    prefixes = {RANK_IN_NAME.sub("", x.name) for x in found}
    seen = set(found)
    extra = []
    for x in candidates:
        if x in seen or not RANK_IN_NAME.search(x.name):
            continue
        try:
            short = x.stat().st_size < SNIFF_BYTES
        except OSError:
            continue
        if short and RANK_IN_NAME.sub("", x.name) in prefixes:
            extra.append(x)
    return sorted([*found, *extra])


def _dumps_in(folder: Path) -> list[Path]:
    """The dumps in a folder: its own files, else (none there) those below it. Files that
    look like profiler traces (*.json, *.json.gz) are not opened."""

    def candidates(xs: Iterable[Path]) -> list[Path]:
        return sorted(
            x
            for x in xs
            if x.is_file()
            and not x.name.startswith(".")
            and not x.name.endswith((".json", ".json.gz"))
        )

    files = candidates(folder.iterdir())
    found = [x for x in files if is_flight_recorder_dump(x)]
    if not found:
        files = candidates(folder.rglob("*"))
        found = [x for x in files if is_flight_recorder_dump(x)]
    return _with_empty_siblings(found, files) if found else []


def find_dumps(paths: Iterable[Path]) -> tuple[list[Path], list[Path]]:
    """Split inputs into flight-recorder dumps and the rest.

    Files are recognised by content (`is_flight_recorder_dump`), whatever their name, plus the
    empty or very short files named like them (a rank frozen while dumping). A folder is
    searched like `zdiag analyze` searches for traces (its files, else the files below it); a
    folder holding dumps and no profiler trace (*.json, *.json.gz), manifest or traces/ folder
    is used up, others stay in the rest.
    """
    paths = list(paths)
    files = [p for p in paths if p.is_file()]
    dumps = _with_empty_siblings([p for p in files if is_flight_recorder_dump(p)], files)
    given = set(dumps)
    rest: list[Path] = []
    for p in paths:
        if p in given:
            continue
        if not p.is_dir():
            rest.append(p)
            continue
        found = _dumps_in(p)
        dumps.extend(found)
        traces = any(x.name.endswith((".json", ".json.gz")) for x in p.rglob("*"))
        if not found or traces or (p / "manifest.json").exists() or (p / "traces").is_dir():
            rest.append(p)
    return dumps, rest


def read_dumps(paths: Iterable[Path]) -> list[RankDump]:
    """Read dump files; InputError when none is readable, two claim the same rank, or there are
    more than MAX_WORLD_SIZE of them (refused before any is read)."""
    paths = list(paths)
    if len(paths) > MAX_WORLD_SIZE:
        raise InputError(
            f"{len(paths)} flight-recorder dumps given, more than the {MAX_WORLD_SIZE} ranks "
            "(MAX_WORLD_SIZE) of any torch.distributed job; pass the dumps of one job."
        )
    lists = RankLists()  # a job's dumps repeat the same member lists: parse each once
    dumps = [_read_dump(Path(p), None, lists) for p in paths]
    if not dumps:
        raise InputError("no flight-recorder dump given.")
    by_rank: dict[int, RankDump] = {}
    for d in dumps:
        if d.rank in by_rank:
            raise InputError(
                f"{d.path} and {by_rank[d.rank].path}: both are dumps of rank {d.rank}; pass the "
                "dumps of one job."
            )
        by_rank[d.rank] = d
    if not any(d.readable for d in dumps):
        raise InputError(
            f"{dumps[0].path}: every flight-recorder dump given is empty or cut short; nothing "
            "to analyze."
        )
    return sorted(dumps, key=lambda d: d.rank)


READER = Reader(
    name="flight-recorder-dump",
    kind="flight-recorder-dump",
    what="torch.distributed flight-recorder dump",
    sniff=lambda _path, head: _sniff(head[:SNIFF_BYTES]),
    read=read_dump,
)
"""Flight-recorder dumps in the input registry (recognized by content: a pickled dict whose
first item is its format version)."""
