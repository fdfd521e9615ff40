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
not run code. torch is never imported.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zdiag.errors import InputError

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
    """Refuses every global: only the pickle protocol's own containers and scalars load."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_snapshot(path: str | Path) -> dict[str, Any]:
    """The snapshot dict in `path`; InputError (one sentence) if it is not a plain snapshot."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = _PlainUnpickler(f).load()
    except OSError as exc:
        raise InputError(f"{p}: cannot read the CUDA memory snapshot ({exc.strerror}).") from exc
    except Exception as exc:  # truncated, corrupt, or names a class: all the same to the user
        raise InputError(
            f"{p}: not a readable CUDA memory snapshot ({exc}); "
            "re-run `zdiag run` or remove the file."
        ) from exc
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise InputError(
            f"{p}: not a CUDA memory snapshot (no 'segments' list, as "
            "torch.cuda.memory._snapshot() writes)."
        )
    return data


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
            cat = categorize(frames)
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
