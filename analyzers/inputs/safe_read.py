"""Bounded reads of input files: regular files only, optionally confined to a folder, capped.

Every input file `zdiag analyze` reads whole (traces, memory timelines, CUDA snapshots) goes
through `open_regular` (the run directory's small JSON records, the manifest and OOM records,
are read by `run_dir.read_run_file`, which applies the same rules with a small cap):

- **Regular files only.** The file is opened non-blocking and checked with `fstat` on the open
  descriptor (no race between the check and the read): a FIFO, a socket, a device such as
  `/dev/zero` (directly or through a symlink) is refused with one sentence, never read, so a
  planted node can neither hang the command nor feed it endless bytes.
- **Confinement.** With `root`, the file's real path (symlinks resolved) must lie inside
  `root`'s: a manifest cannot point the analysis at files outside its run directory.
- **A size cap.** A file, and a gzip file's decompressed content, may hold at most
  `max_bytes` (`DEFAULT_MAX_BYTES`, 16 GiB; `zdiag analyze --max-trace-gb` raises or lowers it
  for one command). A gzip file may also expand at most `DEFAULT_MAX_GZIP_RATIO` (100x) its own
  size, with a floor of `GZIP_RATIO_FLOOR_BYTES` (256 MiB): real traces compress 5-20x, a gzip
  bomb 1000x, so a 1 MB bomb stops at 256 MiB; giving `--max-trace-gb` lifts the ratio check
  (the user vouches for the file). Either stop is one sentence naming the flag. The
  decompressed bytes grow in one buffer, so the peak is the data, not twice it.

The cap in force is a context variable (`ReadLimits`, set with `use_limits`), so a command sets
it once around its analysis and forked decode workers inherit it; nothing else is global.
"""

from __future__ import annotations

import gzip
import os
import re
import stat
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from zdiag.errors import InputError

GIB = 1 << 30
DEFAULT_MAX_BYTES = 16 * GIB
"""Largest input file, and largest decompressed content of a .gz file (16 GiB: the largest
traces seen in practice are a few GB of JSON; a gzip bomb stops here)."""

DEFAULT_MAX_GZIP_RATIO = 100.0
"""A .gz file may expand to at most this many times its size (above the floor below)."""
GZIP_RATIO_FLOOR_BYTES = 256 << 20
"""... but always to at least this much."""

MAX_BYTES_FLAG = "--max-trace-gb"
"""The `zdiag analyze` option that sets `ReadLimits.max_bytes` (in GiB)."""

GZIP_MAGIC = b"\x1f\x8b"
_GUNZIP_CHUNK = 1 << 20  # compressed bytes fed to zlib at a time
_GUNZIP_OUT_CHUNK = 16 << 20  # decompressed bytes asked of zlib at a time (bounds the copy)


@dataclass(frozen=True)
class ReadLimits:
    """The bounds every input read obeys (see the module docstring)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_gzip_ratio: float | None = DEFAULT_MAX_GZIP_RATIO  # None: only max_bytes applies


_DEFAULT_LIMITS = ReadLimits()
_LIMITS: ContextVar[ReadLimits | None] = ContextVar("zdiag_read_limits", default=None)


def current_limits() -> ReadLimits:
    """The limits in force."""
    return _LIMITS.get() or _DEFAULT_LIMITS


@contextmanager
def use_limits(*, max_bytes: int | None = None) -> Iterator[ReadLimits]:
    """Reads inside the block obey these limits (unset ones keep their current value). A
    `max_bytes` given by the user also lifts the compression-ratio check."""
    limits = current_limits()
    if max_bytes is not None:
        limits = replace(limits, max_bytes=max_bytes, max_gzip_ratio=None)
    token = _LIMITS.set(limits)
    try:
        yield limits
    finally:
        _LIMITS.reset(token)


def _too_big(path: Path, what: str, size_text: str, limit: int) -> InputError:
    return InputError(
        f"{path}: an input may hold at most {limit / GIB:.3g} GiB and the {what} {size_text}; "
        f"if it is genuine, raise the limit with {MAX_BYTES_FLAG} N."
    )


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_confined(path: Path, root: Path, what: str) -> None:
    """InputError unless `path`'s real location (symlinks resolved) lies inside `root`'s."""
    try:
        real = path.resolve(strict=False)
        base = root.resolve(strict=False)
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise InputError(f"{path}: the {what} path cannot be resolved ({exc}).") from None
    if real != base and base not in real.parents:
        raise InputError(
            f"{path}: the {what} lies outside {root} (it resolves to {real}); a run "
            "directory's files must stay inside it."
        )


def open_regular(path: Path, what: str = "file", root: Path | None = None) -> BinaryIO:
    """`path` opened for binary reading, if it is a regular file (inside `root`, when given).

    InputError, one sentence naming `what`, for a missing or unreadable file, a folder, a FIFO,
    a device or a socket (checked on the open descriptor, so nothing is read from those), or a
    file outside `root`.
    """
    if root is not None:
        check_confined(path, root, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError(f"{path}: no such file or folder; check the path.") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a folder, expected a {what}.") from None
    except OSError as exc:
        raise InputError(
            f"{path}: the {what} cannot be read ({exc.strerror or exc}); check its permissions."
        ) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(
                f"{path}: is {_kind_of(mode)}, not a regular file, so it was not read; "
                f"pass the {what} itself."
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_capped(f: BinaryIO, path: Path, what: str, max_bytes: int) -> bytes | bytearray:
    """All of `f` (at most `max_bytes`; InputError naming the flag beyond that).

    One read of the size `fstat` reports (never a read sized by the cap, which would allocate
    the cap), then to the end in chunks if the file grew meanwhile.
    """
    size = os.fstat(f.fileno()).st_size
    if size > max_bytes:
        raise _too_big(path, what, f"is {size / GIB:.2f} GiB", max_bytes)
    data = f.read(size)
    more = f.read(_GUNZIP_CHUNK)
    if not more:
        return data
    grown = bytearray(data)
    while more:
        grown += more
        if len(grown) > max_bytes:
            raise _too_big(path, what, "grew over that while being read", max_bytes)
        more = f.read(_GUNZIP_CHUNK)
    return grown


def gunzip_capped(
    data: bytes | bytearray,
    path: Path,
    what: str,
    max_bytes: int,
    max_ratio: float | None = None,
) -> bytearray:
    """Every gzip member of `data`, decompressed into one growing buffer, at most `max_bytes`
    (and, with `max_ratio`, at most that many times `len(data)`, but never less than
    `GZIP_RATIO_FLOOR_BYTES`).

    Unlike `gzip.decompress`, which joins the decompressed pieces at the end (2x the data at its
    peak), the output grows in place, and zlib is never asked for more than the cap allows.
    InputError for truncated or corrupt data and beyond either cap.
    """
    max_bytes_given = max_bytes
    ratio_cap = None
    if max_ratio is not None:
        ratio_cap = max(int(max_ratio * len(data)), GZIP_RATIO_FLOOR_BYTES)
        if ratio_cap < max_bytes:
            max_bytes = ratio_cap
        else:
            ratio_cap = None
    out = bytearray()
    view = memoryview(data)
    pos = 0
    try:
        while pos < len(view):
            if view[pos : pos + 2] != GZIP_MAGIC:
                raise gzip.BadGzipFile(f"Not a gzipped file ({bytes(view[pos : pos + 2])!r})")
            member = zlib.decompressobj(wbits=31)
            while not member.eof:
                if member.unconsumed_tail:
                    chunk: bytes | memoryview = member.unconsumed_tail
                elif pos < len(view):
                    chunk = view[pos : pos + _GUNZIP_CHUNK]
                    pos += len(chunk)
                else:
                    break
                room = max_bytes - len(out)
                out += member.decompress(chunk, min(room + 1, _GUNZIP_OUT_CHUNK))
                if len(out) > max_bytes:
                    if ratio_cap is not None:
                        raise InputError(
                            f"{path}: the {what} expands to more than {max_ratio:g} times its "
                            f"{len(data) / 2**20:.1f} MiB (over {ratio_cap / 2**20:.0f} MiB), "
                            "which real files do not; if it is genuine, allow it with "
                            f"{MAX_BYTES_FLAG} {max(1, round(max_bytes_given / GIB))}."
                        )
                    raise _too_big(path, what, "expands to more than that", max_bytes)
            if not member.eof:
                raise EOFError("Compressed file ended before the end-of-stream marker was reached")
            pos -= len(member.unused_data)
            while pos < len(view) and view[pos] == 0:  # zero padding after a member (as gzip)
                pos += 1
    except (EOFError, OSError, zlib.error) as exc:
        raise InputError(
            f"{path}: the gzip data is truncated or corrupt ({exc}); copy the file again or "
            "re-export it."
        ) from None
    return out


def read_open(f: BinaryIO, path: Path, what: str = "file") -> bytes | bytearray:
    """The rest of open file `f`, gunzipped when it is gzip, within the current limits.

    InputError (one sentence) for anything `read_capped` or `gunzip_capped` refuses, for an
    empty file, and for a gzip file that holds only white space.
    """
    limits = current_limits()
    raw: bytes | bytearray = read_capped(f, path, what, limits.max_bytes)
    if not raw:
        raise InputError(
            f"{path}: the file is empty; re-export the {what} (the writer may have been killed "
            "while writing)."
        )
    if raw[:2] == GZIP_MAGIC:
        raw = gunzip_capped(raw, path, what, limits.max_bytes, limits.max_gzip_ratio)
        if re.search(rb"\S", raw) is None:  # (bytearray.strip() would copy it all)
            raise InputError(f"{path}: the compressed file holds no data; re-export the {what}.")
    return raw


def read_input_bytes(path: Path, what: str = "file", root: Path | None = None) -> bytes | bytearray:
    """The bytes of a regular input file (inside `root`, when given), gunzipped when it is gzip,
    within the current limits (`open_regular`, then `read_open`)."""
    with open_regular(path, what, root) as f:
        return read_open(f, path, what)
