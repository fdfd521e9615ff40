"""Realistic CUDA memory snapshots in torch's format, at any size, from real harness stacks.

No real GPU snapshot can ship with the repository, so tests and benchmarks use snapshots made
here: the dict `torch.cuda.memory._snapshot()` returns (`segments` with `blocks` and their
`frames`, `device_traces` with `alloc` / `free_requested` / `free_completed` / `segment_alloc`
events and `time_us`), built by simulating FSDP2 training steps through a small caching
allocator (first fit in cached segments, block splitting and merging, new segments rounded to
2 MiB with a 20 MiB minimum: the allocator's large-pool behaviour), so reserved memory,
fragmentation and the peak arise the way they do on a GPU.

The allocation stacks are real: `tests/data/snapshot_stacks.json` holds the stacks (Python
frames, innermost first) and sizes of one FSDP2 harness step recorded on CPU by
`tests/cpu_snapshot.py --history` (`python tests/support/snapshots.py` refreshes it),
with the checkout's path replaced by `/workspace/zdiag`. Per category: the activations of one
block call in order, the ones outside the blocks, the gathered parameters, gradients, autograd
temporaries and optimizer state. `scale` multiplies every size (MiB on CPU -> GiB on a GPU),
`cpp_frames` appends C++ frames to each stack as `_record_memory_history(stacks="all")` does.

    snap = generate_snapshot(layers=8, steps=3, scale=64)
    snap = snapshot_of_size(100 * 1024**2)          # a ~100 MB pickle
"""

from __future__ import annotations

import json
import pickle
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data" / "snapshot_stacks.json"
MIB = 1024**2
SEGMENT_ROUND = 2 * MIB
SEGMENT_MIN = 20 * MIB

Frames = list[dict[str, Any]]


def load_stacks(path: Path = DATA) -> dict[str, list[tuple[Frames, int]]]:
    """The recorded stack library: category -> [(frames, size)]."""
    raw = json.loads(path.read_text())
    return {k: [(e["frames"], int(e["size"])) for e in v] for k, v in raw.items()}


_DEFAULT: dict[str, list[tuple[Frames, int]]] = {}


def _default_stacks() -> dict[str, list[tuple[Frames, int]]]:
    if not _DEFAULT:
        _DEFAULT.update(load_stacks())
    return _DEFAULT


# --- a small caching allocator ----------------------------------------------------------------


@dataclass
class _Block:
    addr: int
    size: int
    state: str = "inactive"
    frames: Frames = field(default_factory=list)


@dataclass
class _Segment:
    addr: int
    size: int
    blocks: list[_Block]


class _Allocator:
    """First fit over cached segments, splitting blocks; freed neighbours merge."""

    def __init__(self, device: int, t0_us: int) -> None:
        self.device = device
        self.segments: list[_Segment] = []
        self.events: list[dict[str, Any]] = []
        self.live: dict[int, tuple[_Segment, _Block]] = {}
        self.next_addr = 0x7F0000000000
        self.t = t0_us

    def _event(self, action: str, addr: int, size: int, frames: Frames) -> None:
        self.t += 3
        self.events.append(
            {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": 0,
                "time_us": self.t,
                "frames": frames,
            }
        )

    def alloc(self, size: int, frames: Frames) -> int:
        size = max(512, (size + 511) // 512 * 512)
        for seg in self.segments:
            for i, b in enumerate(seg.blocks):
                if b.state == "inactive" and b.size >= size:
                    if b.size > size:
                        seg.blocks.insert(i + 1, _Block(b.addr + size, b.size - size))
                        b.size = size
                    b.state, b.frames = "active_allocated", frames
                    self.live[b.addr] = (seg, b)
                    self._event("alloc", b.addr, size, frames)
                    return b.addr
        seg_size = max(SEGMENT_MIN, (size + SEGMENT_ROUND - 1) // SEGMENT_ROUND * SEGMENT_ROUND)
        seg = _Segment(self.next_addr, seg_size, [_Block(self.next_addr, seg_size)])
        self.next_addr += seg_size + SEGMENT_ROUND
        self.segments.append(seg)
        self._event("segment_alloc", seg.addr, seg_size, frames)
        return self.alloc(size, frames)

    def free(self, addr: int) -> None:
        seg, b = self.live.pop(addr)
        self._event("free_requested", addr, b.size, [])
        self._event("free_completed", addr, b.size, [])
        b.state, b.frames = "inactive", []
        i = seg.blocks.index(b)
        if i + 1 < len(seg.blocks) and seg.blocks[i + 1].state == "inactive":
            b.size += seg.blocks.pop(i + 1).size
        if i > 0 and seg.blocks[i - 1].state == "inactive":
            prev = seg.blocks[i - 1]
            prev.size += seg.blocks.pop(i).size

    def snapshot_segments(self) -> list[dict[str, Any]]:
        out = []
        for seg in self.segments:
            blocks = [
                {
                    "address": b.addr,
                    "size": b.size,
                    "requested_size": b.size,
                    "state": b.state,
                    "frames": b.frames,
                }
                for b in seg.blocks
            ]
            used = sum(b.size for b in seg.blocks if b.state != "inactive")
            out.append(
                {
                    "device": self.device,
                    "address": seg.addr,
                    "total_size": seg.size,
                    "allocated_size": used,
                    "active_size": used,
                    "requested_size": used,
                    "stream": 0,
                    "segment_type": "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": [],
                    "blocks": blocks,
                }
            )
        return out


# --- the training simulation -------------------------------------------------------------------


_CPP_FRAMES: list[dict[str, Any]] = [
    {
        "filename": "/pytorch/c10/cuda/CUDACachingAllocator.cpp",
        "line": 1100 + i,
        "name": f"c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc#{i}",
    }
    for i in range(64)
]


def _cpp(frames: Frames, n: int) -> Frames:
    """A new stack list over shared frame dicts, as torch's snapshot builds them (each stack is
    a list of indices into one table of frames, so a pickle stores each frame once)."""
    return _CPP_FRAMES[:n] + frames


def generate_snapshot(
    *,
    layers: int = 4,
    steps: int = 2,
    scale: float = 1.0,
    activation_scale: float = 1.0,
    cpp_frames: int = 0,
    stop_in_forward: int | None = None,
    reshard_after_forward: bool = True,
    stacks: dict[str, list[tuple[Frames, int]]] | None = None,
    device: int = 0,
) -> dict[str, Any]:
    """A snapshot of `steps` FSDP2 training steps of a `layers`-block model.

    `stop_in_forward=k`: the last step fails with an `oom` event in the forward of block k
    (the snapshot is taken there, as at an out-of-memory error). `reshard_after_forward=False`
    keeps every block's gathered parameters from its forward to its backward.
    `activation_scale` multiplies the activations only (per-rank imbalance).
    """
    lib = stacks or _default_stacks()

    def sz(s: int, act: bool = False) -> int:
        return max(512, int(s * scale * (activation_scale if act else 1.0)))

    a = _Allocator(device, 1_700_000_000_000_000)
    # The sharded parameters and the first batch, made before the history started: live at
    # the end without frames, and not in the event history.
    pre: list[int] = []
    for _frames, s in lib["model_state"]:
        for _ in range(max(1, layers // 4)):
            pre.append(a.alloc(sz(s), []))
    opt: list[int] = []
    a.events.clear()
    block_acts = lib["activation_block"]
    other_acts = lib["activation_other"]
    gathered = lib["unsharded"][0]
    grad = lib["gradient"][0]
    temps = lib["autograd"]
    for step in range(steps):
        last = step == steps - 1
        acts: list[list[int]] = []
        held: list[int] = []
        for layer in range(layers):
            g = a.alloc(sz(gathered[1]), _cpp(gathered[0], cpp_frames))
            if last and stop_in_forward == layer:
                a._event("oom", 0, sz(block_acts[0][1], True), block_acts[0][0])
                return {"segments": a.snapshot_segments(), "device_traces": [a.events]}
            acts.append([a.alloc(sz(s, True), _cpp(f, cpp_frames)) for f, s in block_acts])
            if reshard_after_forward:
                a.free(g)
            else:
                held.append(g)
        outs = [a.alloc(sz(s, True), _cpp(f, cpp_frames)) for f, s in other_acts]
        for x in outs:
            a.free(x)
        grads = []
        for _layer in range(layers):
            g = held.pop() if held else a.alloc(sz(gathered[1]), _cpp(gathered[0], cpp_frames))
            tmp = [a.alloc(sz(s, True), _cpp(f, cpp_frames)) for f, s in temps]
            for x in acts.pop():
                a.free(x)
            grads.append(a.alloc(sz(grad[1]), _cpp(grad[0], cpp_frames)))
            for x in tmp:
                a.free(x)
            a.free(g)
        if not opt:
            for _ in range(max(1, layers // 4)):
                opt += [a.alloc(sz(s), _cpp(f, cpp_frames)) for f, s in lib["optimizer"]]
        for x in grads:
            a.free(x)
    return {"segments": a.snapshot_segments(), "device_traces": [a.events]}


def snapshot_of_size(target_bytes: int, **kw: Any) -> dict[str, Any]:
    """A snapshot whose pickle is about `target_bytes` (more steps until it is; 16 C++ frames
    per stack and 32 blocks, as a real `stacks="all"` history of a mid-size model)."""
    kw.setdefault("cpp_frames", 16)
    kw.setdefault("layers", 32)
    kw.setdefault("scale", 64.0)
    one = len(pickle.dumps(generate_snapshot(steps=1, **kw), protocol=pickle.HIGHEST_PROTOCOL))
    two = len(pickle.dumps(generate_snapshot(steps=2, **kw), protocol=pickle.HIGHEST_PROTOCOL))
    per_step = max(1, two - one)
    steps = max(1, 1 + round((target_bytes - one) / per_step))
    return generate_snapshot(steps=steps, **kw)


def write_snapshot(path: Path, snapshot: dict[str, Any]) -> Path:
    """Pickle `snapshot` as `torch.cuda.memory._dump_snapshot` does."""
    with path.open("wb") as f:
        pickle.dump(snapshot, f)
    return path


# --- recording the stack library ---------------------------------------------------------------


def library_from_history(
    snapshot: dict[str, Any], repo_root: str
) -> dict[str, list[dict[str, Any]]]:
    """The stack library of a `cpu_snapshot.py --history` snapshot (its first full step)."""
    from zdiag.analyzers.memory.stack_categorizer import Categorizer

    cat = Categorizer()
    events = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"]

    def clean(frames: Frames) -> Frames:
        return [
            {
                "filename": str(f["filename"]).replace(repo_root, "/workspace/zdiag"),
                "line": f["line"],
                "name": f["name"],
            }
            for f in frames
        ]

    lib: dict[str, list[dict[str, Any]]] = {
        k: []
        for k in (
            "model_state",
            "activation_block",
            "activation_other",
            "unsharded",
            "gradient",
            "autograd",
            "optimizer",
        )
    }
    block: list[tuple[tuple[str, str, int], dict[str, Any]]] = []
    in_first_forward = True
    for e in events:
        c = cat.category(e["frames"])
        entry = {"frames": clean(e["frames"]), "size": e["size"]}
        in_first_forward = in_first_forward and c not in ("AUTOGRAD_DETAIL", "GRADIENT")
        if c == "ACTIVATION":
            path = cat.module_path(e["frames"])
            if " > " in path:  # under a block's call
                if in_first_forward:
                    block.append(((path, cat.site(e["frames"]), e["size"]), entry))
            elif len(lib["activation_other"]) < 8:
                lib["activation_other"].append(entry)
        elif c == "PARAMETER_UNSHARDED" and not lib["unsharded"]:
            lib["unsharded"].append(entry)
        elif c in ("GRADIENT",) and not lib["gradient"]:
            lib["gradient"].append(entry)
        elif c == "AUTOGRAD_DETAIL" and len(lib["autograd"]) < 4:
            lib["autograd"].append(entry)
        elif c == "OPTIMIZER_STATE" and len(lib["optimizer"]) < 64:
            lib["optimizer"].append(entry)
    # One block call: the first forward's block allocations split into n equal calls, n being
    # how often the typical (call path, line, size) signature occurs.
    counts = Counter(Counter(sig for sig, _ in block).values())
    n = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0] if counts else 1
    lib["activation_block"] = [entry for _, entry in block[: len(block) // max(1, n)]]
    for b in snapshot["segments"][0]["blocks"]:
        if not b["frames"]:
            lib["model_state"].append({"frames": [], "size": b["size"]})
    if not lib["gradient"]:
        lib["gradient"] = lib["autograd"][:1]
    return lib


if __name__ == "__main__":
    import subprocess
    import sys
    import tempfile

    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "h.pickle"
        subprocess.run(
            [sys.executable, str(root / "tests" / "cpu_snapshot.py"), str(out), "--history"],
            check=True,
        )
        snap = pickle.loads(out.read_bytes())
    DATA.write_text(json.dumps(library_from_history(snap, str(root)), indent=0) + "\n")
    print(f"wrote {DATA}")
