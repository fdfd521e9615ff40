"""Stored rank summaries: in-job summaries beside a trace, and the summary cache of any folder.

A stored summary (`StoredSummary`, msgpack, kind `zdiag.stored-summary/2`) is a `RankSummary`
(`summary_msgpack` bytes: uncompressed, so that the reduce can skip the timelines it does not
show without inflating them; ~80 KB a rank where zlib would make 30 KB) plus what it was computed from:

- the trace's **fingerprint** (`TraceFingerprint`): its size and the SHA-256 of its whole content
  (a file edited anywhere, even with its size and mtime restored, no longer matches; hashing
  takes under 2% of the time decoding the same trace takes, 0.2% for a gzip trace:
  docs/benchmarks.md, "Stored summaries: trust and fingerprint cost"). mtime is not compared:
  copying a run directory changes it, not the content;
- the summary schema (`SUMMARY_SCHEMA`) and the code that computed it (`MAP_CODE_VERSION`: the
  zdiag version plus a digest of the analyzer sources, so an analysis by changed code, a release
  or a development checkout, never reuses a summary its map would now compute differently);
- the **context key**: a digest of what the run said about the rank (its rank from the manifest,
  the world size, `RankContext`), since the same trace gives another summary in another context.

Where they live:

- **in-job summaries** (`zdiag run`): `summary_path_for(trace)`, beside the trace
  (`traces/rank-N.summary.zds`), written by `python -m zdiag.analyzers.engine.summarize_trace` right
  after the export, with an empty context (the run's final manifest does not exist yet). They are
  used when the trace's fingerprint matches and the run's manifest can be applied to it without
  the trace (`apply_context`).
- **the summary cache** (`zdiag analyze`, unless `--no-cache` or `ZDIAG_CACHE=off`): beside the
  traces in `<folder>/.zdiag-cache/<trace name>.zds` when that folder is writable and
  `.zdiag-cache` is a real folder of the invoking user, else in `$XDG_CACHE_HOME/zdiag/`
  (default `~/.cache/zdiag/`) under a digest of the trace's absolute path. An entry is used when
  the fingerprint, the schema, the code version and the context key are the ones this analysis
  would use.

**Trust.** A stored summary replaces the trace it describes, so whoever can write one could
change the findings. zdiag uses a stored summary only when the file is a regular file (not a
symbolic link, FIFO or device), owned by the user running zdiag (the effective uid) and writable
by nobody else (no group or other write bit): that is, a file this user wrote (`write_stored`
creates them so) that no one else can have changed since. Anything else that stands where a
stored summary would be is ignored with a warning (`Untrusted`) and the trace is decoded. Writes
never follow a symbolic link: the folder is opened without following links and must belong to
the user, the temporary file is created exclusively (`O_EXCL | O_NOFOLLOW`) and renamed over the
entry (a rename replaces a planted link, never writes through it). A stored summary that is
readable but damaged or inconsistent (`summary_checks.check_summary`) is likewise a warning and a
decode, never an error.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from zdiag import __version__

from ...collectors.rundir import summary_path_for
from ..inputs.safe_read import open_regular
from ..rank.fsdp_ledger import fill_missing_bytes
from ..rank.rank_analysis import RankContext
from ..rank.step_model import fill_missing_op_bytes
from ..rank.summary import (
    SUMMARY_SCHEMA,
    RankSummary,
    decode_summary,
    decode_summary_without_spans,
)
from ..rank.summary_checks import check_summary

ANALYZERS_ROOT = Path(__file__).resolve().parent.parent
"""The analyzer package (engine/, rank/, run/, ...): every source the map may call."""


def digested_sources() -> list[Path]:
    """The analyzer package's Python sources, in digest order."""
    return sorted(ANALYZERS_ROOT.rglob("*.py"))


def _analyzer_digest() -> str:
    """A digest of the analyzer package's Python sources (the map and what it calls)."""
    h = hashlib.sha1(usedforsecurity=False)
    for path in digested_sources():
        h.update(str(path.relative_to(ANALYZERS_ROOT)).encode())
        try:
            h.update(path.read_bytes())
        except OSError:
            continue
    return h.hexdigest()[:12]


MAP_CODE_VERSION = f"{__version__}+{_analyzer_digest()}"
"""The code that computes a summary: stored with it, compared before reusing it."""

STORED_KIND = "zdiag.stored-summary/2"
"""/2: the fingerprint is a whole-content SHA-256 (/1 entries, edge digests, are misses)."""
FINGERPRINT_ALGORITHM = "sha256"
HASH_CHUNK_BYTES = 1 << 20
SETTLED_NS = 2_000_000_000
"""A stamp vouches for a file only when it was hashed at least 2 s after the file's last change
(coarser than any filesystem's timestamp granularity, FAT's 2 s included)."""
CACHE_DIR_NAME = ".zdiag-cache"
CACHE_SUFFIX = ".zds"
CACHE_ENV = "ZDIAG_CACHE"
"""`ZDIAG_CACHE=off` disables the cache (as `--no-cache` does)."""
MAX_STORED_BYTES = 256 * 1024 * 1024
"""A stored summary larger than this is taken as damage (a miss), never read whole."""
STORED_FILE_MODE = 0o644
"""Entries: readable by others (only their owner uses them), writable by the owner alone."""
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

__all__ = [
    "FileStamp",
    "StoredReads",
    "StoredSummary",
    "TraceFingerprint",
    "TraceIdentity",
    "Untrusted",
    "apply_context",
    "cache_candidates",
    "cache_disabled_by_env",
    "cache_path_for_writing",
    "context_key",
    "fingerprint",
    "read_stored",
    "summary_path_for",
    "write_stored",
]


class Untrusted(Exception):
    """A file stands where a stored summary would be, but zdiag will not use it (see the module
    docstring, "Trust"); `str(exc)` says where and why, as one sentence for a warning."""


class FileStamp(msgspec.Struct, frozen=True, array_like=True):
    """What `stat` said of a trace when it was hashed, and when that was (ns since the epoch)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    hashed_at_ns: int

    @staticmethod
    def of(st: os.stat_result, hashed_at_ns: int) -> FileStamp:
        """The stamp of a status taken when hashing started."""
        return FileStamp(
            st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, hashed_at_ns
        )

    def still(self, st: os.stat_result) -> bool:
        """Whether `st` is the same file, unchanged since it was hashed: device, inode, size,
        mtime and ctime equal, and the hash taken at least `SETTLED_NS` after the last change
        (a change within a timestamp's granularity of the hash could leave the stamp equal:
        git's "racy" entries, handled the same way)."""
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) == (
            self.dev,
            self.ino,
            self.size,
            self.mtime_ns,
            self.ctime_ns,
        ) and self.hashed_at_ns - self.ctime_ns >= SETTLED_NS


class TraceFingerprint(msgspec.Struct, frozen=True, kw_only=True):
    """A trace file's size and the SHA-256 of its content (see the module docstring), and the
    stamp of the file it was hashed from (None: changed while hashed)."""

    size: int
    digest: str
    stamp: FileStamp | None = None

    def same_content(self, other: TraceFingerprint) -> bool:
        """Size and digest agree (the stamps, where the files were, are not compared)."""
        return self.size == other.size and self.digest == other.digest


class TraceIdentity:
    """One trace as a stored summary's fingerprint is checked against it: `matches` compares
    the stamp first (a `stat`, no read) and hashes the whole file only when the stamp does not
    tell (another copy of the file, a change, a hash taken too soon after a change); the hash is
    taken once per trace."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stat: os.stat_result | None = None
        self._print: TraceFingerprint | None = None

    def _status(self) -> os.stat_result:
        if self._stat is None:
            st = os.stat(self.path)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"{self.path}: not a regular file")
            self._stat = st
        return self._stat

    def matches(self, stored: TraceFingerprint) -> bool:
        """Whether the trace's content is the one `stored` fingerprints (OSError or InputError:
        unreadable)."""
        st = self._status()
        if stored.size != st.st_size:
            return False
        if stored.stamp is not None and stored.stamp.still(st):
            return True
        if self._print is None:
            self._print = fingerprint(self.path)
        return self._print.same_content(stored)


class StoredSummary(msgspec.Struct, kw_only=True):
    """One stored summary and what it was computed from."""

    kind: str = STORED_KIND
    schema: str = SUMMARY_SCHEMA
    zdiag_version: str = msgspec.field(default_factory=lambda: MAP_CODE_VERSION)
    rank: int
    trace: TraceFingerprint
    context_key: str
    summary_msgpack: bytes  # summary.summary_msgpack(): uncompressed, so that reading many
    # summaries skips their timelines' spans without inflating them

    def decoded(self, *, spans: bool = True) -> RankSummary:
        """The RankSummary, checked (`summary_checks.check_summary`); `spans=False` skips the
        timeline's spans (`decode_summary_without_spans`). ValueError, saying why, when its bytes
        are damaged or it is not a summary the map could have made."""
        raw = self.summary_msgpack
        if spans:
            summary = decode_summary(raw, compressed=False)
        else:
            summary = decode_summary_without_spans(raw, compressed=False)
        check_summary(summary)
        if summary.rank != self.rank:
            raise ValueError(f"it is stored as rank {self.rank} but holds rank {summary.rank}")
        return summary


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StoredSummary)


def fingerprint(path: Path) -> TraceFingerprint:
    """The fingerprint of a trace file: its size and the SHA-256 of all its bytes, with its stamp
    (None when the file changed while it was hashed). InputError, the loader's one sentence, when
    it is missing, unreadable or not a regular file (`safe_read.open_regular`: a FIFO or a device
    is never read)."""
    started_ns = time.time_ns()
    with open_regular(path, "trace") as f:
        before = os.fstat(f.fileno())
        h = hashlib.new(FINGERPRINT_ALGORITHM)
        size = 0
        while chunk := f.read(HASH_CHUNK_BYTES):
            h.update(chunk)
            size += len(chunk)
        after = os.fstat(f.fileno())
    unchanged = (before.st_size, before.st_mtime_ns, before.st_ctime_ns) == (
        after.st_size,
        after.st_mtime_ns,
        after.st_ctime_ns,
    )
    stamp = FileStamp.of(before, started_ns) if unchanged and size == before.st_size else None
    return TraceFingerprint(size=size, digest=h.hexdigest(), stamp=stamp)


def context_key(
    context: RankContext | None, manifest_rank: int | None = None, world_size: int | None = None
) -> str:
    """A digest of what the run says about a rank; `context_key(None)` is the empty context."""
    ctx = context or RankContext()
    parts: list[object] = [
        manifest_rank,
        world_size,
        ctx.finished_steps,
        ctx.failure,
        list(ctx.collector_errors),
        sorted(ctx.unit_param_bytes.items()),
    ]
    if ctx.thread_groups:  # (absent from older keys, which stay valid)
        parts.append(sorted(ctx.thread_groups.items()))
    return hashlib.blake2b(_ENCODER.encode(parts), digest_size=12).hexdigest()


EMPTY_CONTEXT_KEY = context_key(None)


def apply_context(summary: RankSummary, context: RankContext) -> RankSummary | None:
    """A summary computed with the empty context, made the one `context` gives, or None when
    that needs the trace: the rank must come from its own trace (distributedInfo), no step may
    be dropped as unfinished, no collector error reported and no gloo call to attribute by its
    thread (a rank of groups of different members with recorded threads); FSDP message sizes the
    trace did not record are filled from `context.unit_param_bytes` (as the map does: the
    ledger's totals do not depend on them), in the ledger and in the step models. `summary` is changed in place and returned."""
    if summary.rank_source != "distributedInfo" or context.collector_errors:
        return None
    if context.thread_groups and _groups_differ(summary):  # gloo calls: groups by thread
        return None
    if (
        context.finished_steps is not None
        and context.finished_steps > 0
        and summary.step_source == "ProfilerStep"
        and any(s.step >= context.finished_steps for s in summary.steps)
    ):
        return None
    if context.unit_param_bytes and summary.ledger is not None:
        fill_missing_bytes(summary.ledger, context.unit_param_bytes)
    if context.unit_param_bytes:
        fill_missing_op_bytes(summary.step_models, context.unit_param_bytes)
    return summary


def _groups_differ(summary: RankSummary) -> bool:
    """Whether the rank declares groups of different members: only there do gloo calls take
    their group from `RankContext.thread_groups` (`collective_table.attribute_by_thread`)."""
    members = {tuple(g.ranks) for g in summary.facts.process_groups if g.ranks is not None}
    return len(members) > 1


def cache_disabled_by_env() -> bool:
    """`ZDIAG_CACHE=off` (or 0, no, false) in the environment."""
    return os.environ.get(CACHE_ENV, "").strip().lower() in ("off", "0", "no", "false")


def user_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/zdiag`, default `~/.cache/zdiag`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "zdiag"


def _user_cache_entry(trace: Path) -> Path:
    key = hashlib.blake2b(str(trace.resolve()).encode(), digest_size=16).hexdigest()
    return user_cache_dir() / (key + CACHE_SUFFIX)


def cache_candidates(trace: Path) -> Iterator[Path]:
    """Where the cache entry of `trace` may be: beside it, then the user cache directory (the
    second is computed only when the first is asked past)."""
    yield trace.parent / CACHE_DIR_NAME / (trace.name + CACHE_SUFFIX)
    yield _user_cache_entry(trace)


def _euid() -> int | None:
    """The effective uid (None where the platform has none: ownership is not checked there)."""
    geteuid = getattr(os, "geteuid", None)
    return None if geteuid is None else geteuid()


def _not_yours(st: os.stat_result, what: str) -> str | None:
    """Why a file or folder with this status does not belong to the invoking user."""
    euid = _euid()
    if euid is not None and st.st_uid != euid:
        return f"{what} belongs to uid {st.st_uid}, not to you (uid {euid})"
    return None


def _not_yours_alone(st: os.stat_result, what: str) -> str | None:
    """Why a file with this status is not one the invoking user alone can have written."""
    reason = _not_yours(st, what)
    if reason is None and st.st_mode & _OTHERS_WRITE:
        reason = f"{what} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return reason


def _own_folder_fd(folder: Path, *, create: bool) -> int:
    """A descriptor of `folder`, opened without following a link at its last component, that
    belongs to the invoking user; `create` makes it (mode 0755 less the umask) when absent.
    Untrusted when it is a link or another user's, OSError when it cannot be opened. (Others
    may be able to write into it: an entry they put there is theirs, and never read.)"""
    if create:
        try:
            folder.mkdir(mode=0o755)
        except FileExistsError:
            pass
    try:
        fd = os.open(folder, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and folder.is_symlink():
            raise Untrusted(f"{folder} is a symbolic link") from None
        raise
    try:
        reason = _not_yours(os.fstat(fd), str(folder))
    except BaseException:
        os.close(fd)
        raise
    if reason is not None:
        os.close(fd)
        raise Untrusted(reason)
    return fd


def cache_path_for_writing(trace: Path, warnings: list[str] | None = None) -> Path | None:
    """Where to write the cache entry of `trace`: beside it in `.zdiag-cache/` (made when
    absent) when the trace's folder is writable and that `.zdiag-cache` is a real folder of the
    invoking user, else the user cache directory; None when neither can be used. A
    `.zdiag-cache` that is a link or another user's is left alone, with a warning appended to
    `warnings`."""
    beside = trace.parent / CACHE_DIR_NAME
    if os.access(trace.parent, os.W_OK):
        try:
            os.close(_own_folder_fd(beside, create=True))
            return beside / (trace.name + CACHE_SUFFIX)
        except Untrusted as exc:
            warning = (
                f"the summary cache beside the traces was not used: {exc}; entries go to "
                f"{user_cache_dir()} instead (remove {beside} if it is not yours)"
            )
            if warnings is not None and warning not in warnings:
                warnings.append(warning)
        except OSError:
            pass
    user = _user_cache_entry(trace)
    try:
        user.parent.parent.mkdir(parents=True, exist_ok=True)
        os.close(_own_folder_fd(user.parent, create=True))
        return user
    except (OSError, Untrusted):
        return None


def read_stored(path: Path) -> StoredSummary | None:
    """The stored summary at `path`: None when absent, damaged, foreign or of another schema;
    Untrusted when a file is there that zdiag will not use (a link, a FIFO or device, another
    user's file, or one others can write). Reading never waits on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Untrusted(f"{path} is a symbolic link") from None
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"{path} is not a regular file")
        reason = _not_yours_alone(st, str(path))
        if reason is not None:
            raise Untrusted(reason)
        try:
            data = f.read(MAX_STORED_BYTES + 1)
        except OSError:
            return None
    if len(data) > MAX_STORED_BYTES:
        return None
    try:
        stored = _DECODER.decode(data)
    except msgspec.DecodeError:
        return None
    if stored.kind != STORED_KIND or stored.schema != SUMMARY_SCHEMA:
        return None
    return stored


def write_stored(path: Path, stored: StoredSummary) -> bool:
    """Write `stored` to `path` atomically and without following links: the folder must be the
    invoking user's own (not a link), the temporary file is created exclusively with
    `STORED_FILE_MODE`, then renamed over `path`. False when it cannot be written so."""
    try:
        dir_fd = _own_folder_fd(path.parent, create=False)
    except (OSError, Untrusted):
        return False
    tmp = f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC,
            STORED_FILE_MODE,
            dir_fd=dir_fd,
        )
        with os.fdopen(fd, "wb") as f:
            f.write(_ENCODER.encode(stored))
        os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return True
    except OSError:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        return False
    finally:
        os.close(dir_fd)


class StoredReads:
    """Reads stored summaries for one analysis, and remembers those found but not used (not
    trusted, or damaged) for one warning of each kind."""

    def __init__(self) -> None:
        self.untrusted: list[str] = []
        self.damaged: list[str] = []

    def read(self, place: Path) -> StoredSummary | None:
        """`read_stored(place)`, an untrusted file noted and taken as a miss."""
        try:
            return read_stored(place)
        except Untrusted as exc:
            self.untrusted.append(str(exc))
            return None

    def decoded(self, stored: StoredSummary, place: Path) -> RankSummary | None:
        """The stored summary without its spans, checked; a damaged one noted and taken as a miss."""
        try:
            return stored.decoded(spans=False)
        except ValueError as exc:
            self.damaged.append(f"{place}: {exc}")
            return None

    def warnings(self) -> list[str]:
        """At most one warning per kind, naming the first file and how many more."""
        out = []
        for reasons, what in (
            (self.untrusted, "not trusted (see docs/analyze.md, 'Trust')"),
            (self.damaged, "damaged"),
        ):
            if reasons:
                more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
                out.append(
                    f"stored summary not used, {what}: {reasons[0]}{more}; the trace was decoded "
                    "instead"
                )
        return out
