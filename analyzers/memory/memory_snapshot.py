"""What filled CUDA memory, by category, from a caching-allocator snapshot.

`zdiag run` writes `memory/rank-N.snapshot.pickle` on CUDA: `torch.cuda.memory._snapshot()`,
taken at the out-of-memory error (or at the end of the profiler window). With allocation
history on (`--profile-memory`), every live block carries the stack that allocated it
(`frames`: dicts of filename, line, name; innermost first; Python frames, plus C++ frames when
torch records them). Without history the blocks have no frames and no category can be told.

Each live block (`state == "active_allocated"`) is put in one category by its stack, first
match wins, by the stack rules of the one category table (`categories.py`): optimizer state,
unsharded parameters (FSDP gathers), gradients (FSDP reduce), communication buffers,
activations (checkpoint recomputation, module forwards), autograd temporaries and model state.
Blocks without frames are `UNKNOWN` here (the breakdown, `snapshot_breakdown`, calls them
`PREEXISTING`). `summarize_snapshot` gives one device's live bytes by category and the failed
request of its out-of-memory event.

The snapshot is read by `inputs/cuda_snapshot.py` (`read_snapshot`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .categories import STACK_RULES, stack_category, stack_rule_rank


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


def categorize(frames: list[Any]) -> str:
    """The category of a block allocated with stack `frames` (the stack rules of
    `categories.py`; UNKNOWN when none matches, frames or not).

    One pass over the frames (a snapshot can hold 100k blocks of dozens of frames each): the
    best-ranked rule any frame matches wins.
    """
    best = len(STACK_RULES)
    for f in frames:
        if not isinstance(f, dict):
            continue
        filename = f.get("filename", "")
        name = f.get("name", "")
        # (not str() of a damaged field: a list nested 100k deep would recurse without end)
        filename = filename if isinstance(filename, str) else ""
        name = name if isinstance(name, str) else ""
        best = min(best, stack_rule_rank(filename, name))
        if best == 0:
            break
    return stack_category(best)


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
