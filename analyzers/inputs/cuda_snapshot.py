"""The CUDA memory snapshot reader: a caching-allocator snapshot, recognized and read.

A snapshot is the pickle `torch.cuda.memory._dump_snapshot(path)` writes (or `zdiag run`'s
`memory/rank-N.snapshot.pickle`: `torch.cuda.memory._snapshot()`, taken at the out-of-memory
error or at the end of the profiler window). With allocation history on (`--profile-memory`),
every live block carries the stack that allocated it (`frames`: dicts of filename, line, name;
innermost first). The analysis is in memory/ (`memory_snapshot`, `snapshot_breakdown`).

`is_snapshot_file` recognizes one from its first bytes (a pickle of protocol 2 or later whose
first keys include `segments` or `device_traces`), never from its name alone, and never
unpickles to decide. `load_snapshot_data` reads the whole plain pickle with `plain_pickle`'s
restricted, bounded `load_plain_pickle`, with Python's cyclic garbage collector paused: a 100 MB
snapshot is ~1M event dicts and the collector's passes over them cost 5x the load itself.
`read_snapshot` copies the fields the per-device summary reads into a fixed schema, in a
bounded child process.

- **Items.** A loaded snapshot may share containers (pickle's memo lets a 40 KB file reference
  one big list millions of times, or one frame dict millions of times in one stack): readers
  visit each container once, read at most MAX_STACK_FRAMES frames of a stack and at most
  MAX_SNAPSHOT_ITEMS containers and frames in all.
- **Memory and time:** see `plain_pickle`.

Any bound exceeded, or a field of the wrong type, is an InputError (one sentence).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zdiag.errors import InputError

from .plain_pickle import MAX_SNAPSHOT_SECONDS, load_plain_pickle, run_isolated
from .reader import Reader

MAX_SNAPSHOT_ITEMS = 100_000_000
"""Containers, history events and stack frames a snapshot's readers visit at most (a 100 MB
snapshot has ~11M: 939k events and 10M frames of distinct stacks)."""
MAX_STACK_FRAMES = 4096
"""Frames of one allocation stack that are read (innermost first; torch's Python and C++
stacks have tens to a few hundred). The rest of a longer stack is left out, with a warning."""
MAX_DEVICE_BYTES = 1 << 50
"""A size, or a device's total, beyond this (1 PiB, thousands of times any GPU's memory) is
damaged: sums of such values could overflow the 64-bit arithmetic of the replay."""

PEEK_BYTES = 64 * 1024
"""Bytes read to recognize a snapshot: the dict's first keys are in the first pickle frame."""

_KEYS = (b"segments", b"device_traces")


def is_snapshot_file(path: Path) -> bool:
    """Whether `path` holds a pickled CUDA memory snapshot, from its first PEEK_BYTES bytes
    (regular files only: a FIFO or a device among the inputs is never read)."""
    try:
        if not path.is_file():
            return False
        with path.open("rb") as f:
            head = f.read(PEEK_BYTES)
    except OSError:
        return False
    return is_snapshot_head(head)


def is_snapshot_head(head: bytes) -> bool:
    """Whether a file's first bytes are a pickle (protocol 2 or later) of a snapshot's dict."""
    return len(head) > 2 and head[0] == 0x80 and head[1] >= 2 and any(k in head for k in _KEYS)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (the loaded data holds no cycles worth collecting)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load_snapshot_data(path: Path) -> dict[str, Any]:
    """The snapshot pickled in `path` as plain data (no class or function can load);
    InputError, one sentence, when it is unreadable or not a snapshot."""
    with gc_paused():  # (callers keep it paused until the data is dropped: see load_breakdowns)
        data = load_plain_pickle(path, "CUDA memory snapshot")
    _check_snapshot(data, path)
    return data


def _check_snapshot(data: Any, path: Path) -> None:
    """InputError unless `data` is a snapshot dict with a `segments` list."""
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise InputError(
            f"{path}: not a CUDA memory snapshot (no 'segments' list, as "
            "torch.cuda.memory._snapshot() writes)."
        )


def read_snapshot(path: str | Path, root: Path | None = None) -> dict[str, Any]:
    """The snapshot in `path` in a fixed schema (`SnapshotReader`); InputError (one sentence)
    if it is not a plain snapshot (or, with `root`, lies outside that folder). Read in a bounded
    child process (`run_isolated`)."""
    p = Path(path)
    return run_isolated(_read_snapshot_here, p, root, path=p, what="CUDA memory snapshot")


def _read_snapshot_here(p: Path, root: Path | None) -> dict[str, Any]:
    data = load_plain_pickle(p, "CUDA memory snapshot", root)
    _check_snapshot(data, p)
    return SnapshotReader(p).read(data)


class SnapshotReader:
    """Copies a loaded snapshot into the fields `summarize_snapshot` reads, checking their types.

    Each container is visited once (by identity): a segment or block that the pickle references
    several times counts once, a frames list shared by many blocks (torch shares identical
    stacks) is copied once and shared again, and a frame dict is copied once however many
    stacks (or places in one stack) hold it. A stack is read up to MAX_STACK_FRAMES frames.
    Work is bounded by `MAX_SNAPSHOT_ITEMS` and `MAX_SNAPSHOT_SECONDS`.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.items = 0
        self.deadline = time.monotonic() + MAX_SNAPSHOT_SECONDS
        self.seen: set[int] = set()
        self.frames: dict[int, list[dict[str, str]]] = {}
        self.frame: dict[int, dict[str, str]] = {}  # the loaded data keeps the ids alive

    def read(self, data: dict[str, Any]) -> dict[str, Any]:
        """The snapshot's segments (device, total_size, blocks) and OOM trace entries."""
        segments = []
        totals: dict[int, int] = {}  # bytes per device: a damaged file's could overflow
        for seg in self._unique(data["segments"], "segments"):
            raw_blocks = self._list(seg.get("blocks"), "a segment's 'blocks'")
            device = self._int(seg.get("device"), "a segment's 'device'")
            total_size = self._int(seg.get("total_size"), "a segment's 'total_size'")
            blocks = [
                {
                    "size": self._int(b.get("size"), "a block's 'size'"),
                    "state": self._str(b.get("state"), "a block's 'state'"),
                    "frames": self._frames(b.get("frames")),
                }
                for b in self._unique(raw_blocks, "a segment's 'blocks'")
            ]
            used = sum(b["size"] for b in blocks)  # type: ignore[misc]
            totals[device] = totals.get(device, 0) + max(total_size, used)
            segments.append({"device": device, "total_size": total_size, "blocks": blocks})
        for dev, total in totals.items():
            if total > MAX_DEVICE_BYTES:
                raise InputError(
                    f"{self.path}: the segments on cuda:{dev} add up to {total:,} bytes, more "
                    "than any device holds, so the snapshot is damaged; re-create it or remove "
                    "the file."
                )
        traces: list[list[dict[str, Any]]] = []
        raw_traces = data.get("device_traces")
        done: dict[int, list[dict[str, Any]]] = {}  # a list referenced again is read once
        for entries in self._list(raw_traces, "'device_traces'"):
            self._tick()
            ooms = done.get(id(entries))
            if ooms is None:
                ooms = done[id(entries)] = self._ooms(entries)
            traces.append(ooms)
        return {"segments": segments, "device_traces": traces}

    def _ooms(self, entries: Any) -> list[dict[str, Any]]:
        """The `oom` entries of one device's trace."""
        ooms = []
        for e in self._list(entries, "a 'device_traces' entry"):
            self._tick()
            if isinstance(e, dict) and e.get("action") == "oom":
                free = e.get("device_free")
                ooms.append(
                    {
                        "action": "oom",
                        "size": self._int(e.get("size"), "an OOM entry's 'size'"),
                        "device_free": free
                        if isinstance(free, int) and not isinstance(free, bool) and free >= 0
                        else None,
                    }
                )
        return ooms

    def _tick(self) -> None:
        self.items += 1
        if self.items > MAX_SNAPSHOT_ITEMS or (
            self.items % 65536 == 0 and time.monotonic() > self.deadline
        ):
            raise InputError(
                f"{self.path}: the CUDA memory snapshot holds more than can be read in bounded "
                f"time ({MAX_SNAPSHOT_ITEMS} items or {MAX_SNAPSHOT_SECONDS:g} s); it was skipped."
            )

    def _wrong(self, what: str, value: Any) -> InputError:
        return InputError(
            f"{self.path}: {what} is a {type(value).__name__}, not what "
            "torch.cuda.memory._snapshot() writes, so the snapshot is damaged; re-create it or "
            "remove the file."
        )

    def _list(self, value: Any, what: str) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise self._wrong(what, value)
        return value

    def _unique(self, values: list[Any], what: str) -> Iterator[dict[str, Any]]:
        """The dicts of `values` not visited before (anything else is an InputError)."""
        for v in values:
            self._tick()
            if not isinstance(v, dict):
                raise self._wrong(f"an item of {what}", v)
            if id(v) in self.seen:
                continue
            self.seen.add(id(v))
            yield v

    def _int(self, value: Any, what: str) -> int:
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(what, value)
        if not 0 <= value <= MAX_DEVICE_BYTES:
            beyond = "negative" if value < 0 else "more than any device holds"
            raise InputError(
                f"{self.path}: {what} is {value if value.bit_length() < 200 else 'huge'}, "
                f"{beyond}, so the snapshot is damaged; re-create it or remove the file."
            )
        return value

    def _str(self, value: Any, what: str) -> str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise self._wrong(what, value)
        return value

    def _frames(self, value: Any) -> list[dict[str, str]]:
        """A block's stack as (filename, name) dicts, its first MAX_STACK_FRAMES frames; a
        shared list is copied once, a frame dict once however often it is referenced."""
        if value is None:
            return []
        if not isinstance(value, list):
            raise self._wrong("a block's 'frames'", value)
        done = self.frames.get(id(value))
        if done is not None:
            return done
        out = []
        for f in value[:MAX_STACK_FRAMES]:
            self._tick()
            if isinstance(f, dict):
                copy = self.frame.get(id(f))
                if copy is None:
                    filename, name = f.get("filename", ""), f.get("name", "")
                    copy = self.frame[id(f)] = {
                        "filename": filename if isinstance(filename, str) else "",
                        "name": name if isinstance(name, str) else "",
                    }
                out.append(copy)
        self.frames[id(value)] = out
        return out


READER = Reader(
    name="cuda-snapshot",
    kind="cuda-snapshot",
    what="CUDA memory snapshot (torch.cuda.memory._dump_snapshot's pickle)",
    sniff=lambda path, head: is_snapshot_head(head),
    read=load_snapshot_data,
)
