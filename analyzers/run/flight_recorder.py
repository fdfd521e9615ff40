"""Hangs from torch.distributed flight-recorder dumps: which ranks never arrived, and where.

The flight recorder (FR) keeps, per rank, a ring buffer of the collectives and point-to-point ops
that rank issued. torch writes it as a pickle (`TORCH_FR_DUMP_TEMP_FILE` + rank, or
`torch._C._distributed_c10d._dump_fr_trace()`, formerly `_dump_nccl_trace()`): a dict with
`version` ("2.x"), `pg_config` (process group name -> desc, member ranks), `pg_status` (pg id ->
last enqueued / started / completed sequence number), `nccl_version` or `comm_lib_version`, and
`entries`. An entry names its process group (`pg_id`, a per-process number, and `process_group`
= (name, desc), the name being the same on every rank), its sequence numbers
(`collective_seq_id` counts the group's collectives, `p2p_seq_id` its send/recv ops),
`profiling_name` ("nccl:all_reduce", "nccl:send 0->3" with group-local ranks), sizes and dtypes,
`state` ("scheduled", "started", "completed"), `retired`, timestamps and `frames` (the issuing
stack, innermost frame first).

Reading (`read_dump`) uses the plain-container unpickler of `inputs/plain_pickle.py` (a file naming any
class or function is refused) after a size check, and never imports torch. A dump that is empty
or cut short is not an error: the rank's process was frozen or killed while writing, and the
rank becomes a suspect (`RankDump.readable` is False).

Analysis (`analyze_dumps`), per process group (matched across ranks by name and member ranks):

- collectives: each rank's first not-completed collective is where it waits. A member that never
  enqueued that sequence number (its last one is lower, or it has no entry in the group, and no
  member completed it) is *missing*; a member that still shows pending an earlier collective the
  waiting rank completed, and went on issuing ops after it, is *stuck* (for ops that need every
  member's data, a peer cannot complete without it, so its device or progress thread stopped);
  members with a different op, sizes or dtypes at the same sequence number are *mismatched*;
- point-to-point: pending sends from A to B are paired with pending receives on B from A; an
  unpaired op means its peer never posted the other side.

Waiting ranks point at the ranks they wait for. The culprits are the stuck and mismatched ranks
plus the ranks that others wait for and that wait for nobody themselves (the terminal strongly
connected components of that graph: a rank missing from one group because it waits in another is
not a culprit; a cycle is a deadlock and all its ranks are named; a rank without a readable dump
is named "no dump"). `hang_findings` turns the result into the `hang` Finding; docs/
flight-recorder.md has the details and the checks on real dumps.
"""

from __future__ import annotations

import bisect
import functools
import io
import itertools
import pickletools
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from zdiag import __version__
from zdiag.errors import InputError

from ..inputs.loader import MAX_RANK
from ..inputs.plain_pickle import PlainUnpickler
from ..report import Finding, Report

MAX_DUMP_BYTES = 512 * 1024 * 1024
"""Largest dump read (a 20k-entry buffer with C++ stacks is tens of MB); larger is refused."""

SNIFF_BYTES = 64
"""Bytes read to tell a flight-recorder dump by its content (the pickle's first key/value)."""

MAX_FINDING_GROUPS = 8
"""Process groups listed in the finding's evidence (all are in `HangAnalysis.disagreements`)."""

SUPPORTED_MAJOR_VERSION = 2

MAX_WORLD_SIZE = 2**18
"""Most ranks one process group may list, the dumps of one job may name (listed or dumped), and
dump files read at once: 262,144, above the largest torch.distributed jobs run (about 10^5 GPUs).
More is a damaged or hostile dump, refused in one sentence (a group of 10^6 listed ranks took
over 60 s and 1.2 GB before this bound)."""

MAX_LISTED_RANKS_PER_DUMP = 16 * MAX_WORLD_SIZE
"""Most group memberships one dump's `pg_config` may list in all (the sum of its groups' sizes):
a rank sits in 10-20 groups (TP, PP, DP, EP, CP and their products). Bounds a pickle that shares
one huge member list among thousands of groups at the cost of a few bytes each."""

MAX_SEQ = 2**63 - 1
"""Sequence numbers, record and op ids are 64-bit in torch; a number outside +-MAX_SEQ in a
numeric field is read as absent (its default), as a non-number is."""

# Collectives that cannot complete on any member before every member contributed its data: a
# peer that completed one proves the others ran it (a rank still showing it pending is stuck).
_NEEDS_ALL_DATA = re.compile(
    r"^_?(all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|barrier)", re.IGNORECASE
)
# Ops whose input (output) sizes legitimately differ across members (torch's matcher agrees).
_FREE_INPUT_SIZES = ("all_to_all", "alltoall", "scatter", "_v")
_FREE_OUTPUT_SIZES = ("all_to_all", "alltoall", "gather", "_v")
_TORCH_FRAME = re.compile(r"[/\\]torch[/\\]|^<frozen |^<string>|^\?\?$|^$")
_RANK_IN_NAME = re.compile(r"(\d+)(?:\.[A-Za-z]+)?$")  # "nccl_trace_rank_3", "fr_3.pkl"
_NEGATIVE_RANK_IN_NAME = re.compile(r"(?<![A-Za-z0-9])-\d+(?:\.[A-Za-z]+)?$")  # "fr_-3"
_LONG_NUMBER = re.compile(rf"\d{{{len(str(MAX_RANK)) + 1},}}", re.ASCII)  # more than a rank has
# The member list torch writes as a string: "[0, 1, 2]" (digits only: no sign, no exponent).
_RANK_LIST_TEXT = re.compile(r"\[\s*(?:\d+\s*,\s*)*(?:\d+\s*)?\]", re.ASCII)


# --- the dump --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """One stack frame of the code that issued an op."""

    name: str
    filename: str
    line: int

    def __str__(self) -> str:
        return f"{self.filename}:{self.line} in {self.name}"


class Entry(NamedTuple):
    """One op in a rank's flight-recorder buffer (a NamedTuple: built 4x faster than a frozen
    dataclass, and a dump holds up to tens of thousands of them)."""

    record_id: int
    pg_id: int
    pg_name: str
    pg_desc: str
    collective_seq_id: int
    p2p_seq_id: int
    op_id: int
    profiling_name: str  # "nccl:all_reduce", "nccl:send 0->3", "gloo:broadcast"
    op: str  # "all_reduce", "send", "recv", ...
    is_p2p: bool
    src: int | None  # send/recv: group-local ranks from the profiling name
    dst: int | None
    input_sizes: tuple[tuple[int, ...], ...]
    output_sizes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    state: str  # "scheduled", "started", "completed"
    retired: bool
    time_created_ns: int | None
    time_started_ns: int | None
    time_completed_ns: int | None
    timeout_ms: int | None
    thread_name: str
    frames: tuple[Frame, ...]  # innermost first

    @property
    def completed(self) -> bool:
        """Whether the op finished on this rank (gloo never sets "completed", only `retired`)."""
        return self.state == "completed" or self.retired

    @property
    def signature(self) -> tuple[Any, ...]:
        """What every member of a collective must agree on (sizes only where they must match)."""
        free_in = any(x in self.op for x in _FREE_INPUT_SIZES)
        free_out = any(x in self.op for x in _FREE_OUTPUT_SIZES)
        return (
            self.op,
            None if free_in else self.input_sizes,
            None if free_out else self.output_sizes,
            self.input_dtypes,
            self.output_dtypes,
        )


@dataclass(frozen=True)
class GroupConfig:
    """A process group as a dump's `pg_config` describes it."""

    name: str
    desc: str
    ranks: tuple[int, ...]  # global ranks, in group-rank order


@dataclass(frozen=True)
class PgStatus:
    """`pg_status` of one process group on one rank (sequence numbers; -1: none)."""

    pg_id: str
    last_enqueued: int
    last_started: int
    last_completed: int


@dataclass(frozen=True)
class RankDump:
    """One rank's dump. `readable` is False for an empty or cut-short file (`problem` says
    which): the rank was frozen or killed while dumping, a suspect rather than an error."""

    rank: int
    path: str
    readable: bool
    problem: str = ""
    version: str = ""
    comm_lib_version: str = ""
    groups: tuple[GroupConfig, ...] = ()
    pg_status: tuple[PgStatus, ...] = ()
    entries: tuple[Entry, ...] = ()


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


def _rank_from_name(path: Path) -> int | None:
    """The rank the file name ends with (torch names dumps `<prefix><rank>`), None when it ends
    with no number; InputError for a negative number or one beyond MAX_RANK."""
    m = _RANK_IN_NAME.search(path.name)
    if m is None:
        return None
    digits = m.group(1).lstrip("0") or "0"
    if (
        _NEGATIVE_RANK_IN_NAME.search(path.name)
        or len(digits) > len(str(MAX_RANK))
        or (int(digits) > MAX_RANK)
    ):
        shown = path.name if len(path.name) <= 80 else path.name[:40] + "..." + path.name[-20:]
        raise InputError(
            f"{path.parent / shown}: the file name ends with a rank outside 0..{MAX_RANK}, which "
            "no torch.distributed job has; rename the dump to <prefix><rank> with its real rank."
        )
    return int(digits)


def _opt_int(value: Any) -> int | None:
    return value if type(value) is int and -MAX_SEQ <= value <= MAX_SEQ else None


def _int(value: Any, default: int) -> int:
    """An integer field: ints within +-MAX_SEQ, and decimal strings of one (`pg_status` in the
    JSON form); anything else (a float, NaN, a huge or malformed number) is `default`."""
    if type(value) is int:
        return value if -MAX_SEQ <= value <= MAX_SEQ else default
    if isinstance(value, str) and 0 < len(value) <= 20 and value.lstrip("-").isascii():
        if value.lstrip("-").isdigit():
            n = int(value)
            return n if -MAX_SEQ <= n <= MAX_SEQ else default
    return default


def _text(value: Any, default: str = "") -> str:
    """A string field; ints are written out, anything else (a list, a dict: a damaged dump,
    whose str() could be huge) is `default`."""
    if isinstance(value, str):
        return value
    if type(value) is int and -MAX_SEQ <= value <= MAX_SEQ:
        return str(value)
    return default


def _shape(value: Any) -> tuple[int, ...]:
    """One tensor's sizes; () when it is not a list of ints (sizes are compared and hashed, so a
    nested list or dict in a damaged dump must not get through)."""
    if not isinstance(value, list | tuple):
        return ()
    shape = tuple(value)
    return shape if all(type(x) is int for x in shape) else ()


def _sizes(value: Any) -> tuple[tuple[int, ...], ...]:
    """Sizes as tuples of ints, () for anything that is not a list (a damaged dump)."""
    if not isinstance(value, list | tuple):
        return ()
    return tuple(map(_shape, value))


MAX_FRAMES_PER_ENTRY = 256
"""Stack frames kept per entry (innermost first as torch writes them): enough to reach the user's
code, and a bound on what a dump with long stacks shared by every entry costs."""


def _frames(value: Any) -> tuple[Frame, ...]:
    if not isinstance(value, list | tuple):
        return ()
    return tuple(
        Frame(_text(f.get("name")), _text(f.get("filename")), _int(f.get("line"), 0))
        for f in value[:MAX_FRAMES_PER_ENTRY]
        if isinstance(f, dict)
    )


@functools.lru_cache(maxsize=4096)
def _parse_op(profiling_name: str) -> tuple[str, int | None, int | None]:
    """("send", 0, 3) from "nccl:send 0->3", ("recv", 3, 0) from "nccl:recv 0<-3" (src, dst),
    ("all_reduce", None, None) from "nccl:all_reduce"."""
    name = profiling_name.split(":", 1)[-1].strip()
    op, _, meta = name.partition(" ")
    src = dst = None
    if op == "send" and "->" in meta:
        s, d = meta.split("->", 1)
        src, dst = int(s), int(d)
    elif op == "recv" and "<-" in meta:
        d, s = meta.split("<-", 1)
        src, dst = int(s), int(d)
    return op, src, dst


def _entry(raw: Any, where: str, frame_cache: dict[int, tuple[Frame, ...]]) -> Entry:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} is not a dict")
    get = raw.get
    pg = get("process_group")
    if not isinstance(pg, list | tuple) or len(pg) != 2:
        raise ValueError(f"{where} has no process_group (name, desc) pair")
    name = _text(get("profiling_name"))
    try:
        op, src, dst = _parse_op(name)
    except ValueError as exc:
        raise ValueError(f"{where} has an unreadable profiling_name {name[:80]!r}") from exc
    frames = get("frames")
    if frames:  # every entry of a dump may share one stack list: build its frames once
        parsed_frames = frame_cache.get(id(frames))
        if parsed_frames is None:
            parsed_frames = frame_cache[id(frames)] = _frames(frames)
    else:
        parsed_frames = ()
    return Entry(
        record_id=_int(get("record_id"), 0),
        pg_id=_int(get("pg_id"), -1),
        pg_name=_text(pg[0]),
        pg_desc=_text(pg[1]),
        # early 2.x writers numbered ops with one `seq_id`
        collective_seq_id=_int(get("collective_seq_id", get("seq_id")), 0),
        p2p_seq_id=_int(get("p2p_seq_id"), 0),
        op_id=_int(get("op_id"), 0),
        profiling_name=name,
        op=op,
        is_p2p=bool(get("is_p2p", op in ("send", "recv"))),
        src=src,
        dst=dst,
        input_sizes=_sizes(get("input_sizes")),
        output_sizes=_sizes(get("output_sizes")),
        input_dtypes=_dtypes(get("input_dtypes")),
        output_dtypes=_dtypes(get("output_dtypes")),
        state=_text(get("state")),
        retired=bool(get("retired", False)),
        time_created_ns=_opt_int(get("time_created_ns")),
        time_started_ns=_opt_int(get("time_discovered_started_ns")),
        time_completed_ns=_opt_int(get("time_discovered_completed_ns")),
        timeout_ms=_opt_int(get("timeout_ms")),
        thread_name=_text(get("thread_name")),
        frames=parsed_frames,
    )


def _dtypes(value: Any) -> tuple[str, ...]:
    """A list of dtype names, () for anything that is not a list (a damaged dump)."""
    return tuple(map(_text, value)) if isinstance(value, list | tuple) else ()


class _RankLists:
    """Member lists of `pg_config` parsed once per distinct text (every dump of a job repeats
    its default group's list: 10,000 dumps of a 10,000-rank job parsed it 10,000 times), each
    checked against MAX_WORLD_SIZE and MAX_RANK before it is built."""

    def __init__(self) -> None:
        self._parsed: dict[str, tuple[int, ...]] = {}
        self._sets: dict[int, tuple[tuple[int, ...], frozenset[int]]] = {}

    def members(self, ranks: tuple[int, ...]) -> frozenset[int]:
        """`ranks` as a set, built once per member list (keyed by identity: the lists parsed
        here are shared by every dump that repeats them)."""
        hit = self._sets.get(id(ranks))
        if hit is None or hit[0] is not ranks:
            hit = self._sets[id(ranks)] = (ranks, frozenset(ranks))
        return hit[1]

    def parse(self, value: Any, where: str) -> tuple[int, ...]:
        """The member ranks `value` lists ("[0, 1]" as torch writes it, or a list); ValueError
        (a sentence without the file) when it is not a list of distinct ranks within bounds."""
        if isinstance(value, str):
            hit = self._parsed.get(value)
            if hit is not None:
                return hit
            # count before building anything: 10^6 listed ranks are refused in milliseconds
            _check_world(value.count(",") + 1, where)
            if _LONG_NUMBER.search(value):  # before int(), which refuses 4300+ digits
                raise ValueError(f"{where} lists a rank outside 0..{MAX_RANK}")
            if not _RANK_LIST_TEXT.fullmatch(value):
                raise ValueError(f"{where} lists its ranks as {value[:40]!r}, not a list of ranks")
            ranks = tuple(int(x) for x in value[1:-1].split(",") if x.strip())
            self._check(ranks, where)
            self._parsed[value] = ranks
            return ranks
        if isinstance(value, list | tuple):
            _check_world(len(value), where)
            if not all(type(r) is int for r in value):
                raise ValueError(f"{where} lists ranks that are not integers")
            ranks = tuple(value)
            self._check(ranks, where)
            return ranks
        raise ValueError(f"{where} has ranks of type {type(value).__name__}, not a list")

    @staticmethod
    def _check(ranks: tuple[int, ...], where: str) -> None:
        if ranks and not 0 <= min(ranks) <= max(ranks) <= MAX_RANK:
            raise ValueError(f"{where} lists a rank outside 0..{MAX_RANK}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{where} lists a rank twice")


def _check_world(n: int, where: str) -> None:
    if n > MAX_WORLD_SIZE:
        raise ValueError(
            f"{where} lists {n} ranks, more than the {MAX_WORLD_SIZE} (MAX_WORLD_SIZE) of any "
            "torch.distributed job"
        )


def _groups(raw: Any, lists: _RankLists) -> tuple[GroupConfig, ...]:
    """The groups of a `pg_config`; ValueError when a member list is damaged or the groups list
    more than MAX_LISTED_RANKS_PER_DUMP memberships in all."""
    out = []
    listed = 0
    for key, cfg in raw.items() if isinstance(raw, dict) else ():
        if not isinstance(cfg, dict):
            continue
        name = _text(cfg.get("name"), _text(key))
        where = f"process group {name[:40]!r} of pg_config"
        members = lists.parse(cfg.get("ranks", "[]"), where)
        listed += len(members)
        if listed > MAX_LISTED_RANKS_PER_DUMP:
            raise ValueError(
                f"pg_config lists more than {MAX_LISTED_RANKS_PER_DUMP} group memberships in all "
                "(MAX_LISTED_RANKS_PER_DUMP)"
            )
        if name or members:  # gloo writes one {'': ranks '[]'} placeholder
            out.append(GroupConfig(name=name, desc=_text(cfg.get("desc")), ranks=members))
    return tuple(out)


def _statuses(raw: Any) -> tuple[PgStatus, ...]:
    out = []
    for key, st in (raw or {}).items() if isinstance(raw, dict) else ():
        if isinstance(st, dict):
            out.append(
                PgStatus(
                    pg_id=_text(key),
                    last_enqueued=_int(st.get("last_enqueued_collective"), -1),
                    last_started=_int(st.get("last_started_collective"), -1),
                    last_completed=_int(st.get("last_completed_collective"), -1),
                )
            )
    return tuple(out)


def read_dump(path: str | Path, rank: int | None = None) -> RankDump:
    """One rank's dump (see `_read_dump`)."""
    return _read_dump(Path(path), rank, _RankLists())


def _read_dump(p: Path, rank: int | None, lists: _RankLists) -> RankDump:
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
    name_rank = rank if rank is not None else _rank_from_name(p)
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
    return _parse_dump(raw, p, rank, lists)


def dump_from_dict(raw: Any, *, source: str | Path, rank: int | None = None) -> RankDump:
    """A dump already decoded, e.g. the JSON form (`_dump_fr_trace_json()`, which zdiag run's
    hang watchdog stores in hang/rank-N.json): lists for tuples, 0 for unknown times, numbers
    as strings in `pg_status`. InputError as for `read_dump`."""
    return _parse_dump(raw, Path(source), rank, _RankLists())


def _parse_dump(raw: Any, p: Path, rank: int | None, lists: _RankLists) -> RankDump:
    if not isinstance(raw, dict) or not isinstance(raw.get("entries", []), list):
        raise InputError(f"{p}: not a flight-recorder dump (no 'entries' list).")
    version = _text(raw.get("version"))
    major = version.split(".", 1)[0]
    if not major.isdigit() or int(major) != SUPPORTED_MAJOR_VERSION:
        raise InputError(
            f"{p}: flight-recorder format {version!r} is not supported (zdiag reads 2.x)."
        )
    try:
        groups = _groups(raw.get("pg_config"), lists)
    except ValueError as exc:
        raise InputError(
            f"{p}: {exc}, so the dump is damaged or not torch's; remove it or re-dump that rank."
        ) from None
    if rank is None:
        rank = _rank_from_name(p)
    elif not 0 <= rank <= MAX_RANK:
        raise InputError(f"{p}: rank {rank} is outside 0..{MAX_RANK}; pass the rank that wrote it.")
    if rank is None:
        common = set.intersection(*(set(g.ranks) for g in groups)) if groups else set()
        if len(common) != 1:
            raise InputError(
                f"{p}: cannot tell which rank wrote this dump; name it <prefix><rank> "
                "as torch does (e.g. fr_dump_3)."
            )
        rank = common.pop()
    try:
        # A pickle may reference one entry dict many times: parse each object once.
        parsed: dict[int, Entry] = {}
        frame_cache: dict[int, tuple[Frame, ...]] = {}
        entries = tuple(
            parsed[id(e)]
            if id(e) in parsed
            else parsed.setdefault(id(e), _entry(e, f"entry {i}", frame_cache))
            for i, e in enumerate(raw.get("entries") or [])
        )
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:
        raise InputError(f"{p}: malformed flight-recorder dump ({exc}).") from None
    named = {g.name: g for g in groups}
    for pg_name in {e.pg_name for e in entries}:  # a file renamed to another rank's name
        g = named.get(pg_name)
        if g is not None and g.ranks and rank not in lists.members(g.ranks):
            raise InputError(
                f"{p}: read as rank {rank}'s dump, but its process group {g.name[:40]!r} (where "
                "it has entries) does not list that rank; name the file after the rank that "
                "wrote it."
            )
    return RankDump(
        rank=rank,
        path=str(p),
        readable=True,
        version=version,
        comm_lib_version=_text(raw.get("comm_lib_version") or raw.get("nccl_version")),
        groups=groups,
        pg_status=_statuses(raw.get("pg_status")),
        entries=tuple(sorted(entries, key=lambda e: e.record_id)),
    )


def _with_empty_siblings(found: list[Path], candidates: list[Path]) -> list[Path]:
    """`found` plus the candidates too short to be recognised that are named like the dumps
    (same name up to the trailing rank number): a rank frozen or killed while dumping."""
    prefixes = {_RANK_IN_NAME.sub("", x.name) for x in found}
    seen = set(found)
    extra = []
    for x in candidates:
        if x in seen or not _RANK_IN_NAME.search(x.name):
            continue
        try:
            short = x.stat().st_size < SNIFF_BYTES
        except OSError:
            continue
        if short and _RANK_IN_NAME.sub("", x.name) in prefixes:
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
    lists = _RankLists()  # a job's dumps repeat the same member lists: parse each once
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


# --- the analysis ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RankAtOp:
    """A member of a process group at the op where the group disagrees."""

    rank: int
    # "waiting" (reached it, not completed), "completed", "missing" (never reached it),
    # "stuck" (earlier op not completed though peers completed it), "mismatched",
    # "no dump" (empty, cut short or not given)
    status: str
    last_seq: int | None  # the last sequence number this rank enqueued in the group
    profiling_name: str = ""
    input_sizes: tuple[tuple[int, ...], ...] = ()
    input_dtypes: tuple[str, ...] = ()
    frame: Frame | None = None  # innermost user frame of its entry, when the dump has stacks
    state: str = ""  # its entry's state: "scheduled", "started" (with timing on), "completed"


@dataclass(frozen=True)
class Disagreement:
    """The first op of a process group where its members disagree."""

    pg_name: str
    pg_desc: str
    group_ranks: tuple[int, ...]
    kind: str  # "missing", "stuck", "mismatch", "p2p"
    seq: int  # collective_seq_id (p2p: the waiting op's p2p_seq_id)
    profiling_name: str
    ranks: tuple[RankAtOp, ...]

    def with_status(self, *statuses: str) -> tuple[int, ...]:
        """The ranks in one of these statuses."""
        return tuple(r.rank for r in self.ranks if r.status in statuses)


@dataclass(frozen=True)
class Culprit:
    """A rank that others wait for, why, in which groups, and where it was last seen."""

    rank: int
    reason: str  # "missing", "stuck", "mismatched", "no dump", "deadlock"
    groups: tuple[str, ...]  # "pg_name:desc" of the groups where it is the cause
    last_op: str  # its last op in the buffer ("" when none)
    frame: Frame | None


@dataclass(frozen=True)
class HangAnalysis:
    """What the dumps of one job say about a hang."""

    ranks: tuple[int, ...]  # ranks with a dump file (readable or not)
    unreadable: tuple[int, ...]  # empty or cut-short dumps
    expected_ranks: tuple[int, ...]  # all ranks the process groups name
    disagreements: tuple[Disagreement, ...]  # the first per group, earliest-blocking first
    culprits: tuple[Culprit, ...]
    waiting: tuple[int, ...]  # ranks waiting for another rank
    version: str
    comm_lib_version: str

    @property
    def culprit_ranks(self) -> tuple[int, ...]:
        """The culprits' ranks, ascending."""
        return tuple(sorted(c.rank for c in self.culprits))


def user_frame(frames: tuple[Frame, ...]) -> Frame | None:
    """The innermost frame outside torch (the user's code), else the innermost frame."""
    for f in frames:
        if not _TORCH_FRAME.search(f.filename):
            return f
    return frames[0] if frames else None


@dataclass
class _Group:
    name: str
    desc: str
    ranks: tuple[int, ...]
    # per rank: this group's entries, in record order
    entries: dict[int, list[Entry]]


def _collect_groups(dumps: list[RankDump]) -> dict[tuple[str, tuple[int, ...]], _Group]:
    """Process groups by (name, members), with each member's entries in them. A group that no
    pg_config lists (gloo writes none) gets the ranks that have entries in it as members, or
    every dumped rank for the default group. A member tuple is hashed and turned into a set
    once per list object (`read_dumps` shares the lists its dumps repeat), not per dump or
    entry: hashing the 10,000-rank default group per entry took seconds."""
    groups: dict[tuple[str, tuple[int, ...]], _Group] = {}
    by_rank_name: dict[tuple[int, str], _Group] = {}
    member_sets: dict[int, tuple[tuple[int, ...], frozenset[int]]] = {}
    by_list: dict[tuple[int, str], _Group] = {}  # (id(ranks), name) -> its group
    for d in dumps:
        for g in d.groups:
            ranks = member_sets.get(id(g.ranks))
            if ranks is None or ranks[0] is not g.ranks:
                ranks = member_sets[id(g.ranks)] = (g.ranks, frozenset(g.ranks))
            group = by_list.get((id(g.ranks), g.name))
            if group is None:
                group = groups.setdefault((g.name, g.ranks), _Group(g.name, g.desc, g.ranks, {}))
                by_list[(id(g.ranks), g.name)] = group
            if d.rank in ranks[1]:
                by_rank_name[(d.rank, g.name)] = group
    unlisted: dict[str, set[int]] = defaultdict(set)
    descs: dict[str, str] = {}
    for d in dumps:
        for e in d.entries:
            if (d.rank, e.pg_name) not in by_rank_name:
                unlisted[e.pg_name].add(d.rank)
                descs[e.pg_name] = e.pg_desc
    everyone = tuple(sorted(d.rank for d in dumps))
    for name, members in unlisted.items():
        ranks_t = everyone if descs[name] == "default_pg" else tuple(sorted(members))
        group = groups.setdefault((name, ranks_t), _Group(name, descs[name], ranks_t, {}))
        for r in members:  # the ranks with entries in it: the only ones looked up below
            by_rank_name.setdefault((r, name), group)
    for d in dumps:
        for e in d.entries:
            by_rank_name[(d.rank, e.pg_name)].entries.setdefault(d.rank, []).append(e)
    return groups


def _at(rank: int, status: str, last: int | None, e: Entry | None) -> RankAtOp:
    if e is None:
        return RankAtOp(rank, status, last)
    return RankAtOp(
        rank,
        status,
        last,
        e.profiling_name,
        e.input_sizes,
        e.input_dtypes,
        user_frame(e.frames),
        e.state,
    )


def _collective_analysis(
    g: _Group, readable: set[int], edges: dict[int, set[int]], node_ids: Iterator[int]
) -> tuple[Disagreement | None, dict[int, str]]:
    """The group's first disagreement among its collectives, the blame per rank ("stuck",
    "mismatched"), and the wait edges (waiting rank -> ranks it waits for) added to `edges`.

    Waiters that wait for the same set of members share one node standing for that set (a
    negative id from `node_ids`), so the edges grow with the members, not with members x
    waiters (every rank of a 10,000-rank job waiting in one all-reduce made 10^8 of them)."""
    coll = {r: {e.collective_seq_id: e for e in es if not e.is_p2p} for r, es in g.entries.items()}
    # The last collective each member enqueued: p2p entries carry the collective counter too.
    last = {r: max(e.collective_seq_id for e in es) for r, es in g.entries.items() if es}
    first_pending = {
        r: min(s for s, e in by_seq.items() if not e.completed)
        for r, by_seq in coll.items()
        if any(not e.completed for e in by_seq.values())
    }
    if not first_pending:
        return None, {}

    # Everything up to the frontier was completed by some member; a collective completes on no
    # member before every member issued it, so every member reached the frontier (this is what
    # tells an absent dump or an evicted entry apart from a rank that never arrived).
    frontier = max(
        (first_pending[r] - 1 if r in first_pending else last[r] for r in last if r in readable),
        default=-1,
    )

    def reached(r: int, s: int) -> bool:
        return s <= frontier or (r in readable and last.get(r, -1) >= s)

    blame: dict[int, str] = {}
    points: set[tuple[int, str]] = set()  # (seq, kind) where members disagree
    newest = {r: es[-1].record_id for r, es in g.entries.items() if es}
    # Every waiter waits at or before frontier + 1 (the frontier counts its own completed ops),
    # and every member reached the frontier: only waiters at frontier + 1 can miss anyone.
    beyond = frontier + 1
    top_waiters = [w for w, s_w in first_pending.items() if s_w == beyond]
    if top_waiters:
        missing = [m for m in g.ranks if not reached(m, beyond)]  # never enqueued it
        if missing:
            node = next(node_ids)
            edges[node].update(missing)
            for w in top_waiters:
                edges[w].add(node)
            points.add((beyond, "missing"))

    # A member m still showing s_m pending that a waiter at s_w > s_m completed: for an op that
    # needs every member's data, m's part ran, so m's device or progress stopped: m is stuck, if
    # it went on issuing ops after s_m (a rank's last op may show pending only because the
    # backend marks completion late, as gloo's `retired` does). Below the frontier every member
    # went on; at frontier + 1, only those that enqueued it or issued later ops.
    def went_on_beyond(m: int) -> bool:
        return reached(m, beyond) or newest[m] > coll[m][first_pending[m]].record_id

    pending_at = sorted(set(first_pending.values()))
    for m, s_m in first_pending.items():
        nxt = bisect.bisect_right(pending_at, s_m)  # the next waiting point after s_m
        if nxt == len(pending_at):
            continue
        if pending_at[nxt] <= frontier or went_on_beyond(m):
            points.add((s_m, "stuck"))
            if _NEEDS_ALL_DATA.match(coll[m][s_m].op):
                blame[m] = "stuck"
    # Waiters below the frontier wait for every member pending earlier: a chain of nodes, the
    # node of the i-th waiting point standing for the members pending at it or before.
    by_point: dict[int, list[int]] = defaultdict(list)
    for m, s_m in first_pending.items():
        by_point[s_m].append(m)
    chain: list[int] = []
    for w, s_w in first_pending.items():
        if s_w > frontier:
            continue
        i = bisect.bisect_left(pending_at, s_w) - 1  # the last waiting point before s_w
        while len(chain) <= i:  # built only as far as a waiter needs it
            node = next(node_ids)
            edges[node].update(by_point[pending_at[len(chain)]])
            if chain:
                edges[node].add(chain[-1])
            chain.append(node)
        if i >= 0:
            edges[w].add(chain[i])
    if top_waiters:
        behind = [m for m, s_m in first_pending.items() if s_m < beyond and went_on_beyond(m)]
        if behind:
            node = next(node_ids)
            edges[node].update(behind)
            for w in top_waiters:
                edges[w].add(node)
    # Mismatches: members holding the same sequence number with different ops, sizes or dtypes.
    held_at: dict[int, dict[int, Entry]] = defaultdict(dict)
    for r, by_seq in coll.items():
        for s, e in by_seq.items():
            held_at[s][r] = e
    for s in sorted(held_at):
        held = held_at[s]
        if len(held) < 2 or all(e.completed for e in held.values()):
            continue  # what completed everywhere did not hang the job
        sigs: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for r, e in held.items():
            sigs[e.signature].append(r)
        if len(sigs) > 1:
            ranked = sorted(sigs.values(), key=len, reverse=True)
            odd = [r for rs in ranked[1:] for r in rs]
            if len(ranked[0]) == len(ranked[1]):  # no majority: all of them
                odd = [r for rs in ranked for r in rs]
            for r in odd:
                blame[r] = "mismatched"
            points.add((s, "mismatch"))
            break
    if not points:
        return None, blame
    seq, kind = min(points)
    # whether some member completed `seq` (listed as completed, or passed: its first pending
    # op is later)
    seq_done = any(seq in by_seq and by_seq[seq].completed for by_seq in coll.values()) or any(
        s_r > seq for s_r in first_pending.values()
    )
    statuses = []
    ref: Entry | None = None
    for r in g.ranks:
        at: Entry | None = coll.get(r, {}).get(seq)
        if r not in readable:
            status = "no dump"
        elif kind == "mismatch" and blame.get(r) == "mismatched":
            status = "mismatched"
        elif at is not None and not at.completed:
            status = "stuck" if seq_done else "waiting"
        elif reached(r, seq):
            status = "completed"
        else:
            status = "missing"
        if at is not None and ref is None:
            ref = at
        if at is None and g.entries.get(r):  # not at this op: its last op in the group
            at = g.entries[r][-1]
        statuses.append(_at(r, status, last.get(r), at))
    return (
        Disagreement(
            g.name, g.desc, g.ranks, kind, seq, ref.profiling_name if ref else "", tuple(statuses)
        ),
        blame,
    )


def _p2p_analysis(g: _Group, readable: set[int], edges: dict[int, set[int]]) -> Disagreement | None:
    """Pending sends paired with pending receives, per (src, dst) pair in order; an unpaired op
    means the peer never posted its side: the op's owner waits for the peer."""
    pending: dict[tuple[int, int, str], list[tuple[int, Entry]]] = defaultdict(list)
    for r, es in g.entries.items():
        for e in es:
            if not e.is_p2p or e.completed or e.src is None or e.dst is None:
                continue
            if min(e.src, e.dst) < 0 or max(e.src, e.dst) >= len(g.ranks):
                continue
            src, dst = g.ranks[e.src], g.ranks[e.dst]
            pending[(src, dst, e.op)].append((r, e))
    first: tuple[int, int, int, Entry] | None = None  # (p2p seq, waiting rank, peer, entry)
    for (src, dst, op), ops in pending.items():
        if op != "send":
            continue
        recvs = pending.get((src, dst, "recv"), [])
        for extra, waiter, peer in ((ops[len(recvs) :], src, dst), (recvs[len(ops) :], dst, src)):
            for _, e in extra:
                edges[waiter].add(peer)
                if first is None or e.p2p_seq_id < first[0]:
                    first = (e.p2p_seq_id, waiter, peer, e)
    for (src, dst, op), recvs in pending.items():
        if op == "recv" and (src, dst, "send") not in pending:
            for _, e in recvs:
                edges[dst].add(src)
                if first is None or e.p2p_seq_id < first[0]:
                    first = (e.p2p_seq_id, dst, src, e)
    if first is None:
        return None
    seq, waiter, peer, e = first
    peer_entries = g.entries.get(peer, [])
    peer_last = peer_entries[-1] if peer_entries else None
    return Disagreement(
        g.name,
        g.desc,
        g.ranks,
        "p2p",
        seq,
        e.profiling_name,
        (
            _at(waiter, "waiting", None, e),
            _at(peer, "missing" if peer in readable else "no dump", None, peer_last),
        ),
    )


def _terminal_components(nodes: set[int], edges: dict[int, set[int]]) -> list[set[int]]:
    """Strongly connected components with no edge leaving them (iterative Kosaraju). A node
    with no edge out (a rank without a dump, say: there may be 10^5 of them) is one such
    component by itself and is not walked."""
    sinks = {n for n in nodes if not edges.get(n)}
    order: list[int] = []
    seen: set[int] = set(sinks)
    for start in sorted(nodes):
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(sorted(edges.get(start, ()))))]
        while stack:
            node, it = stack[-1]
            nxt = next((n for n in it if n not in seen), None)
            if nxt is None:
                order.append(node)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(sorted(edges.get(nxt, ())))))
    reverse: dict[int, set[int]] = defaultdict(set)
    for a, bs in edges.items():
        for b in bs:
            if b not in sinks:
                reverse[b].add(a)
    comp: dict[int, int] = {}
    comps: list[set[int]] = []
    for root in reversed(order):
        if root in comp:
            continue
        members = {root}
        comp[root] = len(comps)
        todo = [root]
        while todo:
            n = todo.pop()
            for m in reverse.get(n, ()):
                if m not in comp:
                    comp[m] = len(comps)
                    members.add(m)
                    todo.append(m)
        comps.append(members)
    return [
        c for i, c in enumerate(comps) if all(comp.get(b) == i for a in c for b in edges[a])
    ] + [{n} for n in sorted(sinks)]


def analyze_dumps(dumps: list[RankDump]) -> HangAnalysis:
    """The first disagreement per process group and the culprit ranks (see the module doc).
    InputError when the groups and dumps name more than MAX_WORLD_SIZE ranks in all."""
    readable = {d.rank for d in dumps if d.readable}
    groups = _collect_groups([d for d in dumps if d.readable])
    expected_set = {d.rank for d in dumps}
    for ranks in {id(g.ranks): g.ranks for g in groups.values()}.values():
        expected_set.update(ranks)
        if len(expected_set) > MAX_WORLD_SIZE:
            raise InputError(
                f"{dumps[0].path}: the process groups of these dumps name more than "
                f"{MAX_WORLD_SIZE} ranks (MAX_WORLD_SIZE), more than any torch.distributed job "
                "has; pass the dumps of one job."
            )
    # waiting rank -> the ranks it waits for; negative ids are nodes standing for a set of ranks
    edges: dict[int, set[int]] = defaultdict(set)
    node_ids = itertools.count(-1, -1)
    p2p_edges: dict[int, set[int]] = defaultdict(set)
    blame: dict[int, str] = {}
    found: list[Disagreement] = []
    for g in groups.values():
        dis, group_blame = _collective_analysis(g, readable, edges, node_ids)
        for r, why in group_blame.items():
            blame.setdefault(r, why)
        p2p = _p2p_analysis(g, readable, p2p_edges)
        found.extend(x for x in (dis, p2p) if x is not None)
    # A pending send/recv whose peer left no dump may be paired on the peer's side: that wait
    # is a guess, so it does not make its owner a waiter (it still makes the peer a suspect).
    sure = {w: set(bs) for w, bs in edges.items()}
    for w, bs in p2p_edges.items():
        sure.setdefault(w, set()).update(b for b in bs if b in readable)
        edges[w] |= bs
    awaited = {b for bs in edges.values() for b in bs if b >= 0}
    nodes = set(edges) | {b for bs in edges.values() for b in bs}
    culprit_reason: dict[int, str] = dict(blame)
    for comp in _terminal_components(nodes, sure):
        roots = comp & awaited
        for r in roots:
            if r not in readable:
                culprit_reason.setdefault(r, "no dump")
            elif sum(x >= 0 for x in comp) > 1:
                culprit_reason.setdefault(r, "deadlock")
            else:
                culprit_reason.setdefault(r, "missing")
    last_entry = {d.rank: d.entries[-1] for d in dumps if d.entries}
    at_fault: dict[int, set[str]] = defaultdict(set)  # rank -> groups where it is a cause
    for x in found:
        for at in x.ranks:
            if at.status not in ("waiting", "completed") and at.rank in culprit_reason:
                at_fault[at.rank].add(f"{x.pg_name}:{x.pg_desc}")
    culprits = []
    for r, why in sorted(culprit_reason.items()):
        where = sorted(at_fault.get(r, ()))
        e = last_entry.get(r)
        culprits.append(
            Culprit(
                r,
                why,
                tuple(where),
                e.profiling_name if e else "",
                user_frame(e.frames) if e else None,
            )
        )
    culprit_set = set(culprit_reason)
    # Earliest-blocking first: groups where a culprit is at fault, then by time of the op.
    found.sort(
        key=lambda x: (
            not any(at.rank in culprit_set and at.status != "waiting" for at in x.ranks),
            x.pg_desc,
            x.pg_name,
        )
    )
    expected = sorted(expected_set)
    first_readable = next(d for d in dumps if d.readable)
    return HangAnalysis(
        ranks=tuple(d.rank for d in dumps),
        unreadable=tuple(d.rank for d in dumps if not d.readable),
        expected_ranks=tuple(expected),
        disagreements=tuple(found),
        culprits=tuple(culprits),
        waiting=tuple(
            sorted(w for w, bs in edges.items() if bs and w >= 0 and w not in culprit_set)
        ),
        version=first_readable.version,
        comm_lib_version=first_readable.comm_lib_version,
    )


# --- the finding -----------------------------------------------------------------------------


def _ranks_text(ranks: Iterable[int]) -> str:
    """ "rank 3", "ranks 1, 3", runs of three or more as "ranks 2-999" (a finding may name every
    rank of a large job that left no dump)."""
    rs = sorted(ranks)
    parts = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{rs[i]}-{rs[j]}")
        else:
            parts.extend(map(str, rs[i : j + 1]))
        i = j + 1
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(parts)


def _group_evidence(d: Disagreement) -> dict[str, Any]:
    out: dict[str, Any] = {
        "pg": d.pg_name,
        "desc": d.pg_desc,
        "kind": d.kind,
        "seq": d.seq,
        "op": d.profiling_name,
    }
    for status in ("waiting", "completed", "missing", "stuck", "mismatched", "no dump"):
        ranks = d.with_status(status)
        if ranks:
            out[status.replace(" ", "_")] = list(ranks)
    ahead = max((a.last_seq for a in d.ranks if a.last_seq is not None), default=None)
    behind = {
        str(a.rank): ahead - a.last_seq
        for a in d.ranks
        if a.status == "missing" and a.last_seq is not None and ahead is not None
    }
    if behind:
        out["behind_by"] = behind
    frames = {str(a.rank): str(a.frame) for a in d.ranks if a.frame is not None}
    if frames:  # where each rank issued its op there (its last op in the group when missing)
        out["frames"] = frames
    return out


def hang_findings(analysis: HangAnalysis) -> list[Finding]:
    """The `hang` Finding (critical; `ranks` = the culprits), or none when no rank disagrees."""
    if not analysis.culprits:
        return []
    culprits = analysis.culprit_ranks
    blocking = [
        d
        for d in analysis.disagreements
        if any(a.rank in culprits and a.status != "waiting" for a in d.ranks)
    ]
    head = blocking[0] if blocking else None
    if head is None:
        title = f"{_ranks_text(culprits)} never arrived (their peers wait for them)"
    else:
        where = (
            f"{head.pg_desc or 'process group'} (pg {head.pg_name}) "
            f"{'p2p op' if head.kind == 'p2p' else 'collective'} #{head.seq} {head.profiling_name}"
        )
        if head.kind == "stuck":
            title = (
                f"{_ranks_text(head.with_status('stuck'))} stuck in {where}, which "
                f"{_ranks_text(head.with_status('completed'))} completed"
            )
        elif head.kind == "mismatch":
            title = (
                f"{_ranks_text(head.with_status('mismatched'))} issued a different op at {where}"
            )
        else:
            title = (
                f"{_ranks_text(head.with_status('missing', 'no dump'))} never arrived at {where}, "
                f"where {_ranks_text(head.with_status('waiting'))} wait"
            )
        if set(culprits) - set(head.with_status("stuck", "missing", "no dump", "mismatched")):
            title += f" (culprits: {_ranks_text(culprits)})"
    frames = {str(c.rank): str(c.frame) for c in analysis.culprits if c.frame is not None}
    evidence: dict[str, Any] = {
        "culprit_ranks": list(culprits),
        "reasons": {str(c.rank): c.reason for c in analysis.culprits},
        "waiting_ranks": list(analysis.waiting),
        "first_group": _group_evidence(head) if head else None,
        "culprit_frames": frames,
        "unreadable_dumps": list(analysis.unreadable),
        "dumps": len(analysis.ranks),
        "expected_ranks": len(analysis.expected_ranks),
        "groups_disagreeing": len(analysis.disagreements),
        "fr_version": analysis.version,
        "groups": [_group_evidence(d) for d in blocking[:MAX_FINDING_GROUPS]],
    }
    reasons = {c.reason for c in analysis.culprits}
    advice = []
    if reasons & {"missing", "no dump", "deadlock"}:
        advice.append(
            "look at what the culprit ranks were doing instead of the collective (their last op "
            "and stack, their logs, py-spy dump of the process)"
        )
    if "stuck" in reasons:
        advice.append(
            "a stuck rank's device stopped completing ops its peers finished: check its GPU "
            "(Xid errors in dmesg, nvidia-smi) and its host"
        )
    if "mismatched" in reasons:
        advice.append("make every rank issue the same collectives in the same order and shapes")
    if "no dump" in reasons:
        advice.append("an empty or missing dump means the process was frozen or killed")
    return [
        Finding(
            id="hang",
            severity="critical",
            title=title,
            ranks=list(culprits),
            evidence=evidence,
            recommendation="; ".join(advice) + ".",
            gain_method="",
        )
    ]


def analyze_flight_recorder(paths: Iterable[Path]) -> tuple[HangAnalysis, list[Finding]]:
    """Read dump files, analyze them and build the findings."""
    analysis = analyze_dumps(read_dumps(paths))
    return analysis, hang_findings(analysis)


def dump_warnings(analysis: HangAnalysis, findings: list[Finding]) -> list[str]:
    """What the dumps could not tell (empty or absent dumps, no disagreement found)."""
    out = [
        f"rank {r}: its flight-recorder dump is empty or cut short (the process was frozen or "
        "killed while dumping)"
        for r in analysis.unreadable
    ]
    absent = sorted(set(analysis.expected_ranks) - set(analysis.ranks))
    if absent:
        out.append(
            f"no flight-recorder dump for {_ranks_text(absent)} of the {len(analysis.expected_ranks)} "
            "ranks its process groups name"
        )
    if not findings:
        out.append(
            f"flight-recorder dumps of {len(analysis.ranks)} rank(s): no collective where ranks "
            "disagree (no rank is missing, stuck or mismatched)"
        )
    return out


def flight_recorder_report(dumps: list[Path], *, ranks: list[int] | None = None) -> Report:
    """The Report of `zdiag analyze` on flight-recorder dumps alone (no profiler trace).
    `ranks` (--rank) is not applied: who waits for whom needs every rank's dump."""
    analysis, findings = analyze_flight_recorder(dumps)
    run: dict[str, Any] = {
        "world_size": len(analysis.expected_ranks),
        "flight_recorder_version": analysis.version,
    }
    if analysis.comm_lib_version:
        run["comm_lib_version"] = analysis.comm_lib_version
    return Report(
        zdiag_version=__version__,
        inputs=[str(p) for p in dumps],
        findings=findings,
        warnings=dump_warnings(analysis, findings)
        + (
            ["--rank is not applied to flight-recorder dumps: every rank's dump is analyzed"]
            if ranks
            else []
        ),
        run=run,
    )
