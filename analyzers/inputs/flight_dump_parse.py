"""A torch.distributed flight-recorder dump, decoded, as a `RankDump` (no file is read here).

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

`parse_dump` checks the decoded dict (its version, member lists within MAX_WORLD_SIZE and
MAX_LISTED_RANKS_PER_DUMP, the rank that wrote it) and reads each field with a fallback: a field
of the wrong type or out of bounds is read as absent. The files themselves are read by
flight_dumps.py; the analysis is analyzers/run/wait_graph.py.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from zdiag.errors import InputError

from .loader import MAX_RANK

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

# Ops whose input (output) sizes legitimately differ across members (torch's matcher agrees).
_FREE_INPUT_SIZES = ("all_to_all", "alltoall", "scatter", "_v")
_FREE_OUTPUT_SIZES = ("all_to_all", "alltoall", "gather", "_v")
RANK_IN_NAME = re.compile(r"(\d+)(?:\.[A-Za-z]+)?$")  # "nccl_trace_rank_3", "fr_3.pkl"
_NEGATIVE_RANK_IN_NAME = re.compile(r"(?<![A-Za-z0-9])-\d+(?:\.[A-Za-z]+)?$")  # "fr_-3"
_LONG_NUMBER = re.compile(rf"\d{{{len(str(MAX_RANK)) + 1},}}", re.ASCII)  # more than a rank has
# The member list torch writes as a string: "[0, 1, 2]" (digits only: no sign, no exponent).
_RANK_LIST_TEXT = re.compile(r"\[\s*(?:\d+\s*,\s*)*(?:\d+\s*)?\]", re.ASCII)


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


def rank_from_name(path: Path) -> int | None:
    """The rank the file name ends with (torch names dumps `<prefix><rank>`), None when it ends
    with no number; InputError for a negative number or one beyond MAX_RANK."""
    m = RANK_IN_NAME.search(path.name)
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


class RankLists:
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


def _groups(raw: Any, lists: RankLists) -> tuple[GroupConfig, ...]:
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


def dump_from_dict(raw: Any, *, source: str | Path, rank: int | None = None) -> RankDump:
    """A dump already decoded, e.g. the JSON form (`_dump_fr_trace_json()`, which zdiag run's
    hang watchdog stores in hang/rank-N.json): lists for tuples, 0 for unknown times, numbers
    as strings in `pg_status`. InputError as for `read_dump`."""
    return parse_dump(raw, Path(source), rank, RankLists())


def parse_dump(raw: Any, p: Path, rank: int | None, lists: RankLists) -> RankDump:
    """`raw`, decoded from the file `p`, as the dump of rank `rank`, else of the rank the file
    name ends with, else of the one rank all groups in its `pg_config` share (`lists`: the member
    lists already parsed for the job's other dumps). InputError (one sentence naming `p`) for a
    dict that is not a dump, another major version, a damaged member list, a rank that cannot be
    told, is out of bounds or contradicts the groups, or a malformed entry."""
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
        rank = rank_from_name(p)
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
