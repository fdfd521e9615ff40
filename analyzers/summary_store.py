"""Stored rank summaries: in-job summaries beside a trace, and the summary cache of any folder.

A stored summary (`StoredSummary`, msgpack, kind `zdiag.stored-summary/1`) is a `RankSummary`
(`summary_msgpack` bytes: uncompressed, so that the reduce can skip the timelines it does not
show without inflating them; ~80 KB a rank where zlib would make 30 KB) plus what it was computed from:

- the trace's **fingerprint** (`TraceFingerprint`): its size, its mtime (ns) and a SHA-1 digest
  (a checksum here, not a security measure) of its size and its first and last `FINGERPRINT_EDGE_BYTES` (64 KiB each). Reading 128 KiB per
  rank keeps the check cheap (1024 ranks: 128 MiB); a gzip trace's last bytes hold the CRC-32 and
  length of the whole content, and an uncompressed Kineto trace ends with its last events;
- the summary schema (`SUMMARY_SCHEMA`) and the code that computed it (`MAP_CODE_VERSION`: the
  zdiag version plus a digest of the analyzer sources, so an analysis by changed code, a release
  or a development checkout, never reuses a summary its map would now compute differently);
- the **context key**: a digest of what the run said about the rank (its rank from the manifest,
  the world size, `RankContext`), since the same trace gives another summary in another context.

Where they live:

- **in-job summaries** (`zdiag run`): `summary_path_for(trace)`, beside the trace
  (`traces/rank-N.summary.zds`), written by `python -m zdiag.analyzers.summarize_trace` right
  after the export, with an empty context (the run's final manifest does not exist yet). They are
  used when the trace's size and digest match (mtime is not compared: copying a run directory
  changes it) and the run's manifest can be applied to it without the trace (`apply_context`).
- **the summary cache** (`zdiag analyze`, unless `--no-cache` or `ZDIAG_CACHE=off`): beside the
  traces in `<folder>/.zdiag-cache/<trace name>.zds` when that folder is writable, else in
  `$XDG_CACHE_HOME/zdiag/` (default `~/.cache/zdiag/`) under a digest of the trace's absolute
  path. An entry is used when size, mtime and digest match, and the schema, code version and
  context key are the ones this analysis would use (in-job summaries: the content and the code
  version).

Nothing here raises on a damaged or foreign file: it is a miss, and the trace is decoded.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import msgspec

from zdiag import __version__
from zdiag.analyzers.fsdp_ledger import fill_missing_bytes
from zdiag.analyzers.rank_analysis import RankContext
from zdiag.analyzers.summary import SUMMARY_SCHEMA, RankSummary, decode_summary
from zdiag.collectors.rundir import summary_path_for


def _analyzer_digest() -> str:
    """A digest of the analyzer package's Python sources (the map and what it calls)."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha1(usedforsecurity=False)
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        try:
            h.update(path.read_bytes())
        except OSError:
            continue
    return h.hexdigest()[:12]


MAP_CODE_VERSION = f"{__version__}+{_analyzer_digest()}"
"""The code that computes a summary: stored with it, compared before reusing it."""

STORED_KIND = "zdiag.stored-summary/1"
FINGERPRINT_EDGE_BYTES = 64 * 1024
CACHE_DIR_NAME = ".zdiag-cache"
CACHE_SUFFIX = ".zds"
CACHE_ENV = "ZDIAG_CACHE"
"""`ZDIAG_CACHE=off` disables the cache (as `--no-cache` does)."""
MAX_STORED_BYTES = 256 * 1024 * 1024
"""A stored summary larger than this is taken as damage (a miss), never read whole."""

__all__ = [
    "StoredSummary",
    "TraceFingerprint",
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


class TraceFingerprint(msgspec.Struct, frozen=True, kw_only=True):
    """A trace file's size, mtime and edge digest (see the module docstring)."""

    size: int
    mtime_ns: int
    digest: str

    def same_content(self, other: TraceFingerprint) -> bool:
        """Size and digest agree (mtime ignored: for summaries carried with a copied run)."""
        return self.size == other.size and self.digest == other.digest


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

    def decoded(self) -> RankSummary:
        """The RankSummary (ValueError when its bytes are damaged)."""
        return decode_summary(self.summary_msgpack, compressed=False)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StoredSummary)


def fingerprint(path: Path) -> TraceFingerprint:
    """The fingerprint of a trace file (OSError when it cannot be read or is not a regular file:
    a FIFO or a device is never opened here; the loader refuses it with one sentence)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(f"{path}: not a regular file")
    with path.open("rb") as f:
        st = os.fstat(f.fileno())
        h = hashlib.sha1(str(st.st_size).encode(), usedforsecurity=False)
        h.update(f.read(FINGERPRINT_EDGE_BYTES))
        if st.st_size > FINGERPRINT_EDGE_BYTES:
            f.seek(max(FINGERPRINT_EDGE_BYTES, st.st_size - FINGERPRINT_EDGE_BYTES))
            h.update(f.read(FINGERPRINT_EDGE_BYTES))
    return TraceFingerprint(size=st.st_size, mtime_ns=st.st_mtime_ns, digest=h.hexdigest())


def context_key(
    context: RankContext | None, manifest_rank: int | None = None, world_size: int | None = None
) -> str:
    """A digest of what the run says about a rank; `context_key(None)` is the empty context."""
    ctx = context or RankContext()
    parts = [
        manifest_rank,
        world_size,
        ctx.finished_steps,
        ctx.failure,
        list(ctx.collector_errors),
        sorted(ctx.unit_param_bytes.items()),
    ]
    return hashlib.blake2b(_ENCODER.encode(parts), digest_size=12).hexdigest()


EMPTY_CONTEXT_KEY = context_key(None)


def apply_context(summary: RankSummary, context: RankContext) -> RankSummary | None:
    """A summary computed with the empty context, made the one `context` gives, or None when
    that needs the trace: the rank must come from its own trace (distributedInfo), no step may
    be dropped as unfinished and no collector error reported; FSDP message sizes the trace did
    not record are filled from `context.unit_param_bytes` (as the map does: the ledger's totals
    do not depend on them). `summary` is changed in place and returned."""
    if summary.rank_source != "distributedInfo" or context.collector_errors:
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
    return summary


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


def cache_path_for_writing(trace: Path) -> Path | None:
    """Where to write the cache entry of `trace`: beside it when its folder is writable
    (creating `.zdiag-cache/`), else the user cache directory; None when neither can be made."""
    beside = trace.parent / CACHE_DIR_NAME / (trace.name + CACHE_SUFFIX)
    if os.access(trace.parent, os.W_OK):
        try:
            beside.parent.mkdir(exist_ok=True)
            return beside
        except OSError:
            pass
    user = _user_cache_entry(trace)
    try:
        user.parent.mkdir(parents=True, exist_ok=True)
        return user
    except OSError:
        return None


def read_stored(path: Path) -> StoredSummary | None:
    """The stored summary at `path`, None when absent, damaged, foreign or of another schema."""
    try:
        with path.open("rb") as f:
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
    """Write atomically (temp file + rename); False when it cannot be written."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(_ENCODER.encode(stored))
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False
