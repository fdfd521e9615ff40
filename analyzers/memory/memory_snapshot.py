"""What filled CUDA memory, by category, from a caching-allocator snapshot.

`zdiag run` writes `memory/rank-N.snapshot.pickle` on CUDA: `torch.cuda.memory._snapshot()`,
taken at the out-of-memory error (or at the end of the profiler window). With allocation
history on (`--profile-memory`), every live block carries the stack that allocated it
(`frames`: dicts of filename, line, name; innermost first; Python frames, plus C++ frames when
torch records them). Without history the blocks have no frames and no category can be told.

Each live block (`state == "active_allocated"`) is put in one category by its stack, first
match wins, in the category names torch's memory timeline uses where one fits:

1. `OPTIMIZER_STATE`: allocated inside `torch/optim/` (AdamW's moments, foreach temporaries).
2. `PARAMETER_UNSHARDED`: an FSDP frame gathering or unsharding (`foreach_all_gather`,
   `unshard`, `alloc_all_gather_outputs`, FSDP1 `_unshard`).
3. `GRADIENT`: an FSDP frame reducing gradients (`post_backward`, `foreach_reduce`).
4. `ACTIVATION`: re-computed by activation checkpointing (`torch/utils/checkpoint.py`) or, outside
   backward, allocated under a module's forward (`Module._call_impl`).
5. `AUTOGRAD_DETAIL`: other allocations during backward (the autograd engine's frames), i.e.
   activation gradients and backward temporaries.
6. `MODEL_STATE`: other FSDP frames (sharded parameters) and module construction, when they
   happen after the history started.
7. `UNKNOWN`: anything else, blocks without frames included. `zdiag run` starts the history at
   the first module forward, so the model built before it (its sharded parameters) is here.

The pickle is read with an unpickler that accepts plain containers only (dict, list, str, int,
float, bool, None): a file that names any class or function is refused, so a crafted pickle can
not run code. torch is never imported. Reading is bounded (see "Bounds" in docs/memory.md):

- **Memory.** `load_plain_pickle` reads only a regular file within the size cap of `safe_read`
  and loads it under a memory budget, `memory_budget(size)` (inputs/plain_pickle.py): PICKLE_MEMORY_BASE_BYTES +
  PICKLE_MEMORY_PER_BYTE x the file's size, never more than PICKLE_MEMORY_MAX_BYTES nor
  PICKLE_MEMORY_MAX_SHARE of the machine's memory (a 10-byte pickle can otherwise ask the
  unpickler for gigabytes of memo table).
- **Items.** A loaded snapshot may share containers (pickle's memo lets a 40 KB file reference
  one big list millions of times, or one frame dict millions of times in one stack): readers
  visit each container once, read at most MAX_STACK_FRAMES frames of a stack and at most
  MAX_SNAPSHOT_ITEMS containers and frames in all.
- **Time.** `run_isolated` reads and analyzes a snapshot in a forked child process under the
  memory budget, killed after MAX_SNAPSHOT_SECONDS: work inside the C unpickler (hashing a
  tuple that nests itself 2**40 times, as a 200-byte pickle can ask) cannot be interrupted
  in-process. Without fork (not Linux, or other threads running) the work runs in this process
  and the unpickler checks PICKLE_LOAD_SECONDS between input chunks.

Any bound exceeded, or a field of the wrong type, is an InputError (one sentence).
"""

from __future__ import annotations

import io
import os
import pickle
import select
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from zdiag.errors import InputError

from ..inputs.plain_pickle import (
    PickleMemoryError,
    PickleTimeError,
    PlainUnpickler,
    address_space_budget,
    memory_budget,
)
from ..inputs.safe_read import current_limits, open_regular, read_capped

T = TypeVar("T")

MAX_SNAPSHOT_ITEMS = 100_000_000
"""Containers, history events and stack frames a snapshot's readers visit at most (a 100 MB
snapshot has ~11M: 939k events and 10M frames of distinct stacks)."""
MAX_STACK_FRAMES = 4096
"""Frames of one allocation stack that are read (innermost first; torch's Python and C++
stacks have tens to a few hundred). The rest of a longer stack is left out, with a warning."""
MAX_SNAPSHOT_SECONDS = 60.0
"""Wall time to read and analyze one snapshot (`run_isolated` kills the work after it; a
100 MB snapshot takes ~4 s)."""
MAX_DEVICE_BYTES = 1 << 50
"""A size, or a device's total, beyond this (1 PiB, thousands of times any GPU's memory) is
damaged: sums of such values could overflow the 64-bit arithmetic of the replay."""
_RESULT_MAX_BYTES = 1 << 30  # what a child process may send back (a summary, not the data)

# Stack patterns: a frame matches a (filename part, name parts) pair when its filename contains
# the first and its function name contains one of the second ("" matches any name).
_ANY = ("",)
_OPTIMIZER = "/torch/optim/"
_FSDP = "/distributed/fsdp/"
_FSDP_GATHER = ("all_gather", "unshard")
_FSDP_REDUCE = ("post_backward", "reduce")
_CHECKPOINT = "/torch/utils/checkpoint.py"
_MODULE = "/torch/nn/modules/module.py"
_MODULE_CALL = ("_call_impl",)
# Backward: the Python entry points, and the C++ engine when C++ frames are recorded (on CUDA
# backward runs in the engine's device thread, whose stack has no Python frames). Not any
# `torch::autograd::` frame: forward ops from Python pass through `torch::autograd::VariableType`.
_BACKWARD_PY = ("_engine_run_backward", "run_backward")
_BACKWARD_CPP = ("autograd::Engine",)
_CONSTRUCTION = ("reset_parameters", "__init__")

CATEGORIES = (
    "OPTIMIZER_STATE",
    "PARAMETER_UNSHARDED",
    "GRADIENT",
    "ACTIVATION",
    "AUTOGRAD_DETAIL",
    "MODEL_STATE",
    "UNKNOWN",
)


@dataclass
class SnapshotMemory:
    """One device's live memory in a snapshot, by category."""

    device: int
    in_use_bytes: int = 0
    reserved_bytes: int = 0
    category_bytes: dict[str, int] = field(default_factory=dict)
    blocks_with_frames: int = 0
    blocks: int = 0
    oom_request_bytes: int | None = None  # the allocation that failed, from the history
    oom_device_free_bytes: int | None = None

    @property
    def has_stacks(self) -> bool:
        """Whether the allocator recorded stacks (`--profile-memory`) for the live blocks."""
        return self.blocks_with_frames > 0


def load_plain_pickle(path: str | Path, what: str, root: Path | None = None) -> Any:
    """The plain data (dict, list, str, bytes, numbers, None) pickled in `path`, read with
    bounds: a regular file (inside `root`, when given) within `safe_read`'s size cap, no class or
    function (refused: nothing runs), a memory budget and PICKLE_LOAD_SECONDS while loading.

    The loaded object may still share containers (pickle's memo): walk it visiting each
    container once (see `_SnapshotReader`). InputError, one sentence naming `what`, otherwise.
    """
    p = Path(path)
    with open_regular(p, what, root) as f:
        data = read_capped(f, p, what, current_limits().max_bytes)
    try:
        return PlainUnpickler(io.BytesIO(data)).load()
    except (PickleMemoryError, PickleTimeError) as exc:
        raise InputError(f"{p}: the {what} was not loaded: {exc}.") from None
    except RecursionError:
        raise InputError(
            f"{p}: the {what} is nested too deep to read; it was not loaded."
        ) from None
    except Exception as exc:  # truncated, corrupt, or names a class: all the same to the user
        raise InputError(
            f"{p}: not a readable {what} ({type(exc).__name__}: {str(exc)[:100]}); "
            "re-create it or remove the file."
        ) from None


def fork_available() -> bool:
    """Whether `run_isolated` can fork (Linux, one thread, not a daemonic process)."""
    from ..inputs.decode_batches import fork_available as available

    return available()


def run_isolated(fn: Callable[..., T], *args: Any, path: Path, what: str) -> T:
    """`fn(*args)` in a forked child process, its result sent back pickled: the child may grow
    by `memory_budget(size of path)` and is killed after MAX_SNAPSHOT_SECONDS, whatever it is
    doing (InputError, naming `path` and `what`, when it is). An InputError in the child is
    raised here; any other exception is a RuntimeError (a bug, not the input's fault). Without
    fork, `fn(*args)` runs here (the unpickler's own bounds still apply)."""
    if not fork_available():
        return fn(*args)
    try:
        size = path.stat().st_size
    except OSError:
        size = 0  # the child's open says why
    budget = memory_budget(size)
    seconds = MAX_SNAPSHOT_SECONDS
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        _child(fn, args, w, r, budget)
    os.close(w)
    try:
        payload, code = _collect(r, pid, seconds, path, what)
    finally:
        os.close(r)
    try:
        status, value = pickle.loads(payload)
    except Exception:  # no result: killed (the kernel's out-of-memory killer) or crashed
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        status, value = "died", f"the process reading it stopped without a result ({how})"
    if status == "ok":
        return value
    if status == "input":
        raise InputError(value)
    if status == "memory":
        raise InputError(
            f"{path}: the {what} was not read: it needs more than the {budget >> 20} MiB of "
            f"memory its {size} bytes may take (a damaged or hostile file; if it is genuine, "
            "--max-trace-gb lifts the fixed cap)."
        )
    if status == "died":
        raise InputError(f"{path}: the {what} was not read: {value}.")
    raise RuntimeError(f"reading {path} failed: {value}")


def _child(fn: Callable[..., Any], args: tuple[Any, ...], w: int, r: int, budget: int) -> None:
    """The forked child: run `fn` under the memory budget, send (status, value), exit."""
    code = 0
    try:
        os.close(r)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            with address_space_budget(budget):
                out: tuple[str, Any] = ("ok", fn(*args))
        except InputError as exc:
            out = ("input", exc.message)
        except MemoryError:
            out = ("memory", "")
        except RecursionError:
            out = ("died", "it is nested too deep to read")
        except BaseException as exc:  # a bug: the parent reports it as one
            out = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            payload = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            payload = pickle.dumps(("error", f"result not picklable: {exc}"))
        view = memoryview(payload)
        while view:
            view = view[os.write(w, view) :]
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _collect(r: int, pid: int, seconds: float, path: Path, what: str) -> tuple[bytes, int]:
    """The child's whole output and its exit code (negative: the signal that ended it); kills
    it once `seconds` have passed (InputError then)."""
    deadline = time.monotonic() + seconds
    chunks: list[bytes] = []
    got = 0
    done = False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise InputError(
                    f"{path}: the {what} was not read: it takes longer than the "
                    f"{seconds:g} s a snapshot may take (a damaged or hostile file)."
                )
            ready, _, _ = select.select([r], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            got += len(chunk)
            if got > _RESULT_MAX_BYTES:
                raise InputError(f"{path}: the {what} gives a result too large to keep.")
            chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
        done = True
    finally:
        if not done:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
    return b"".join(chunks), os.waitstatus_to_exitcode(status)


def read_snapshot(path: str | Path, root: Path | None = None) -> dict[str, Any]:
    """The snapshot in `path` in a fixed schema (`_SnapshotReader`); InputError (one sentence)
    if it is not a plain snapshot (or, with `root`, lies outside that folder). Read in a bounded
    child process (`run_isolated`)."""
    p = Path(path)
    return run_isolated(_read_snapshot_here, p, root, path=p, what="CUDA memory snapshot")


def _read_snapshot_here(p: Path, root: Path | None) -> dict[str, Any]:
    data = load_plain_pickle(p, "CUDA memory snapshot", root)
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise InputError(
            f"{p}: not a CUDA memory snapshot (no 'segments' list, as "
            "torch.cuda.memory._snapshot() writes)."
        )
    return _SnapshotReader(p).read(data)


class _SnapshotReader:
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


# The rules in precedence order: (category, filename part, name parts); "" matches anything.
_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("OPTIMIZER_STATE", _OPTIMIZER, _ANY),
    ("PARAMETER_UNSHARDED", _FSDP, _FSDP_GATHER),
    ("GRADIENT", _FSDP, _FSDP_REDUCE),
    ("ACTIVATION", _CHECKPOINT, _ANY),
    ("AUTOGRAD_DETAIL", "", _BACKWARD_PY + _BACKWARD_CPP),
    ("ACTIVATION", _MODULE, _MODULE_CALL),
    ("MODEL_STATE", _FSDP, _ANY),
    ("MODEL_STATE", "/torch/nn/", _CONSTRUCTION),
)


def categorize(frames: list[Any]) -> str:
    """The category of a block allocated with stack `frames` (rules in the module docstring).

    One pass over the frames (a snapshot can hold 100k blocks of dozens of frames each): the
    best-ranked rule any frame matches wins.
    """
    best = len(_RULES)
    for f in frames:
        if not isinstance(f, dict):
            continue
        filename = f.get("filename", "")
        name = f.get("name", "")
        # (not str() of a damaged field: a list nested 100k deep would recurse without end)
        filename = filename if isinstance(filename, str) else ""
        name = name if isinstance(name, str) else ""
        for i in range(best):
            _, file_part, name_parts = _RULES[i]
            if file_part in filename and any(part in name for part in name_parts):
                best = i
                break
        if best == 0:
            break
    return _RULES[best][0] if best < len(_RULES) else "UNKNOWN"


def summarize_snapshot(data: dict[str, Any], device: int | None = None) -> SnapshotMemory:
    """Live bytes by category on `device` (when absent from the snapshot, or not given: the
    device with the most memory in use)."""
    per_device: dict[int, SnapshotMemory] = {}
    by_stack: dict[int, str] = {}  # id(frames) -> category: read_snapshot shares equal stacks
    for seg in data.get("segments") or []:
        if not isinstance(seg, dict):
            continue
        dev = int(seg.get("device", 0) or 0)
        mem = per_device.setdefault(dev, SnapshotMemory(device=dev))
        mem.reserved_bytes += int(seg.get("total_size", 0) or 0)
        for block in seg.get("blocks") or []:
            if not isinstance(block, dict) or block.get("state") != "active_allocated":
                continue
            size = int(block.get("size", 0) or 0)
            frames = block.get("frames") or []
            frames = frames if isinstance(frames, list) else []
            cat = by_stack.get(id(frames)) if frames else None
            if cat is None:
                cat = categorize(frames)
                if frames:
                    by_stack[id(frames)] = cat
            mem.category_bytes[cat] = mem.category_bytes.get(cat, 0) + size
            mem.in_use_bytes += size
            mem.blocks += 1
            mem.blocks_with_frames += 1 if frames else 0
    traces = data.get("device_traces")
    if isinstance(traces, list):
        for dev, entries in enumerate(traces):
            ooms = [e for e in entries or [] if isinstance(e, dict) and e.get("action") == "oom"]
            if ooms:
                mem = per_device.setdefault(dev, SnapshotMemory(device=dev))
                mem.oom_request_bytes = int(ooms[-1].get("size", 0) or 0)
                free = ooms[-1].get("device_free")
                mem.oom_device_free_bytes = int(free) if isinstance(free, int) else None
    if device is not None and device in per_device:
        return per_device[device]
    if not per_device:
        return SnapshotMemory(device=0)
    return max(per_device.values(), key=lambda m: (m.in_use_bytes, m.oom_request_bytes or 0))
