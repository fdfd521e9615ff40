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
not run code. torch is never imported. Reading is bounded (`load_plain_pickle`): only a regular
file within the size cap of `safe_read`, loaded under a memory budget (a 10-byte pickle can
otherwise ask the unpickler for gigabytes of memo table), and the loaded object is then copied
into a fixed schema (`_SnapshotReader`) that visits each container once: pickle's memo lets a
40 KB file reference one big list millions of times, which a naive walk would follow every
time. A field of the wrong type is an InputError.
"""

from __future__ import annotations

import io
import os
import pickle
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from zdiag.analyzers.safe_read import current_limits, open_regular, read_capped
from zdiag.errors import InputError

PICKLE_MEMORY_BASE_BYTES = 256 << 20
PICKLE_MEMORY_PER_BYTE = 32
"""While a pickle loads, the process may grow by at most BASE + PER_BYTE x its size (Linux:
an address-space limit; a loaded snapshot takes ~10x its pickle's size in Python objects)."""
MAX_SNAPSHOT_ITEMS = 50_000_000
"""Containers and frames `_SnapshotReader` visits at most (each once)."""
MAX_SNAPSHOT_SECONDS = 20.0
"""Wall time `_SnapshotReader` may spend on one snapshot."""
_INT64_MAX = 2**63 - 1

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


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every global: only the pickle protocol's own containers and scalars load.

    `load` runs under a memory budget of PICKLE_MEMORY_BASE_BYTES + PICKLE_MEMORY_PER_BYTE x the
    input's size (a memo bomb raises MemoryError instead of taking gigabytes), for an in-memory
    `io.BytesIO` input or a real file; the flight-recorder reader uses this class too.
    """

    def __init__(self, file: BinaryIO) -> None:
        super().__init__(file)
        self._input_bytes = _input_size(file)

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")

    def load(self) -> Any:
        """The unpickled object (`PickleMemoryError` beyond the budget)."""
        try:
            with _memory_budget(
                PICKLE_MEMORY_BASE_BYTES + PICKLE_MEMORY_PER_BYTE * self._input_bytes
            ):
                return super().load()
        except MemoryError:
            raise PickleMemoryError(
                f"it asks for far more memory than its {self._input_bytes} bytes can hold "
                "(a damaged or hostile pickle)"
            ) from None


class PickleMemoryError(pickle.UnpicklingError):
    """A pickle that asks for more memory than its size allows (a memo bomb)."""


def _input_size(file: BinaryIO) -> int:
    """Bytes in an unpickler's input: a BytesIO's buffer, else the file's size (0 if unknown)."""
    if isinstance(file, io.BytesIO):
        return file.getbuffer().nbytes
    try:
        return os.fstat(file.fileno()).st_size
    except (OSError, AttributeError, ValueError):
        return 0


@contextmanager
def _memory_budget(extra_bytes: int) -> Iterator[None]:
    """Let the process grow by at most `extra_bytes` of address space inside the block (Linux;
    a no-op where the limit cannot be read or set). Allocations past it raise MemoryError."""
    try:
        with open("/proc/self/statm") as f:
            vm_bytes = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        old = resource.getrlimit(resource.RLIMIT_AS)
    except (OSError, ValueError, IndexError, AttributeError):
        yield
        return
    soft = vm_bytes + extra_bytes
    if old[1] != resource.RLIM_INFINITY:
        soft = min(soft, old[1])
    if old[0] != resource.RLIM_INFINITY and old[0] <= soft:
        yield  # an existing, tighter limit stays
        return
    resource.setrlimit(resource.RLIMIT_AS, (soft, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


def load_plain_pickle(path: str | Path, what: str, root: Path | None = None) -> Any:
    """The plain data (dict, list, str, bytes, numbers, None) pickled in `path`, read with
    bounds: a regular file (inside `root`, when given) within `safe_read`'s size cap, no class or
    function (refused: nothing runs), and a memory budget while loading.

    The loaded object may still share containers (pickle's memo): walk it visiting each
    container once (see `_SnapshotReader`). InputError, one sentence naming `what`, otherwise.
    """
    p = Path(path)
    with open_regular(p, what, root) as f:
        data = read_capped(f, p, what, current_limits().max_bytes)
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except PickleMemoryError as exc:
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


def read_snapshot(path: str | Path, root: Path | None = None) -> dict[str, Any]:
    """The snapshot in `path` in a fixed schema (`_SnapshotReader`); InputError (one sentence)
    if it is not a plain snapshot (or, with `root`, lies outside that folder)."""
    p = Path(path)
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
    several times counts once, and a frames list shared by many blocks (torch shares identical
    stacks) is copied once and shared again. Work is bounded by `MAX_SNAPSHOT_ITEMS` and
    `MAX_SNAPSHOT_SECONDS`.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.items = 0
        self.deadline = time.monotonic() + MAX_SNAPSHOT_SECONDS
        self.seen: set[int] = set()
        self.frames: dict[int, list[dict[str, str]]] = {}

    def read(self, data: dict[str, Any]) -> dict[str, Any]:
        """The snapshot's segments (device, total_size, blocks) and OOM trace entries."""
        segments = []
        for seg in self._unique(data["segments"], "segments"):
            blocks = self._list(seg.get("blocks"), "a segment's 'blocks'")
            segments.append(
                {
                    "device": self._int(seg.get("device"), "a segment's 'device'"),
                    "total_size": self._int(seg.get("total_size"), "a segment's 'total_size'"),
                    "blocks": [
                        {
                            "size": self._int(b.get("size"), "a block's 'size'"),
                            "state": self._str(b.get("state"), "a block's 'state'"),
                            "frames": self._frames(b.get("frames")),
                        }
                        for b in self._unique(blocks, "a segment's 'blocks'")
                    ],
                }
            )
        traces: list[list[dict[str, Any]]] = []
        raw_traces = data.get("device_traces")
        for entries in self._list(raw_traces, "'device_traces'"):
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
                            if isinstance(free, int) and not isinstance(free, bool)
                            else None,
                        }
                    )
            traces.append(ooms)
        return {"segments": segments, "device_traces": traces}

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
        if not -_INT64_MAX <= value <= _INT64_MAX:
            raise InputError(
                f"{self.path}: {what} is {value}, beyond any 64-bit integer, so the snapshot "
                "is damaged; re-create it or remove the file."
            )
        return value

    def _str(self, value: Any, what: str) -> str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise self._wrong(what, value)
        return value

    def _frames(self, value: Any) -> list[dict[str, str]]:
        """A block's stack as (filename, name) dicts; shared lists are copied once."""
        if value is None:
            return []
        if not isinstance(value, list):
            raise self._wrong("a block's 'frames'", value)
        done = self.frames.get(id(value))
        if done is not None:
            return done
        out = []
        for f in value:
            self._tick()
            if isinstance(f, dict):
                filename, name = f.get("filename", ""), f.get("name", "")
                out.append(
                    {
                        "filename": filename if isinstance(filename, str) else "",
                        "name": name if isinstance(name, str) else "",
                    }
                )
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
        filename = str(f.get("filename", ""))
        name = str(f.get("name", ""))
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
