"""Write a CUDA-snapshot-shaped pickle of a real FSDP2 harness run on CPU, for the snapshot tests.

This machine has no GPU, so `torch.cuda.memory._snapshot()` cannot run. What the CUDA allocator
would record can still be reproduced from a real run: a TorchDispatchMode sees every tensor an op
creates, with the Python stack at that moment (the frames the allocator records with
`_record_memory_history(stacks="python")`, innermost first). The run is the harness (FSDP2,
world size 1 on gloo, AdamW): one full step, then a second step stopped inside the forward of
block `--stop-layer`, as an out-of-memory error there would stop it. Stacks are recorded from the
first forward on, where `zdiag run --profile-memory` starts the allocator history: the model built
before is in the snapshot without frames, as on CUDA. The live tensors at that
moment become `active_allocated` blocks in the documented snapshot layout
(`torch.cuda.memory._snapshot` docstring), plus an `oom` trace entry.

    python tests/cpu_snapshot.py OUT.pickle [--stop-layer N] [--ac block] [--no-frames]
    python tests/cpu_snapshot.py OUT.pickle --history [--ac block]

`--history` records the allocator's event history as well (`device_traces`: `alloc` with the
stack, `free_completed` when the storage dies, with `time_us`), as `_record_memory_history()`
does, and runs both steps to the end (no stop): the peak is then found by replaying the events.
"""

from __future__ import annotations

import argparse
import pickle
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zdiag.harness.config import HarnessConfig
from zdiag.harness.train import build, init_process_group, synthetic_batch


class _Stopped(Exception):
    """Raised from a forward pre-hook where the out-of-memory error would be."""


def _where(ref: StorageWeakRef) -> int | None:
    """The storage's data address now; None once freed, or resized to 0 bytes as FSDP frees
    an unsharded parameter (its address can then be reused by another storage)."""
    if ref.expired():
        return None
    storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
    return storage.data_ptr() if storage.nbytes() else None


class AllocationRecorder(TorchDispatchMode):
    """Every new storage an op creates, with the Python stack at its creation."""

    def __init__(self, history: bool = False) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int, list[dict[str, Any]]]] = {}
        self.history = history
        self.events: list[dict[str, Any]] = []
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}

    def _event(self, action: str, addr: int, size: int, frames: list[dict[str, Any]]) -> None:
        self.events.append(
            {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": 0,
                "time_us": time.perf_counter_ns() // 1000,
                "frames": frames,
            }
        )

    def poll_frees(self) -> None:
        """Emit `free_completed` for every recorded storage that died since the last op."""
        dead = [a for a, (ref, _) in self._live.items() if _where(ref) != a]
        for a in dead:
            _, size = self._live.pop(a)
            self._event("free_completed", a, size, [])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self.history:
            self.poll_frees()
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, DTensor):
                t = t._local_tensor  # the storage the allocator would see
            if isinstance(t, torch.Tensor) and not t.is_meta:
                try:  # wrapper subclasses (DTensor) have no storage of their own
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                except RuntimeError:
                    continue
                known = self.storages.get(key)
                if key and (known is None or _where(known[0]) != key):  # new, or address reused
                    stack = traceback.extract_stack()[:-1]
                    frames = [
                        {"filename": f.filename, "line": f.lineno or 0, "name": f.name}
                        for f in reversed(stack)
                    ]
                    self.storages[key] = (StorageWeakRef(storage), storage.nbytes(), frames)
                    if self.history:
                        self._event("alloc", key, storage.nbytes(), frames)
                        self._live[key] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def adopt(self, t: torch.Tensor) -> None:
        """Track a tensor made before recording started (a block without frames)."""
        if isinstance(t, DTensor):
            t = t._local_tensor
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes(), [])

    def live_blocks(self, with_frames: bool) -> list[dict[str, Any]]:
        """The storages still alive, as snapshot blocks."""
        blocks = []
        for addr, (ref, _size, frames) in sorted(self.storages.items()):
            if _where(ref) != addr:
                continue  # freed
            size = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
            blocks.append(
                {
                    "address": addr,
                    "size": size,
                    "requested_size": size,
                    "state": "active_allocated",
                    "frames": frames if with_frames else [],
                }
            )
        return blocks


def capture(stop_layer: int, ac: str, with_frames: bool, history: bool = False) -> dict[str, Any]:
    """Run the harness until the forward of block `stop_layer` in step 2; the snapshot then.
    With `history`: both steps to the end, with the allocator's event history."""
    cfg = HarnessConfig(layers=4, dim=64, heads=4, seq=128, batch=8, vocab=512, ac=ac)
    device = torch.device("cpu")
    init_process_group(device)
    recorder = AllocationRecorder(history=history)
    blocks: list[dict[str, Any]] = []
    try:
        model, _units, optimizer = build(cfg, device)
        generator = torch.Generator().manual_seed(0)
        inputs, labels = synthetic_batch(cfg.batch, cfg.seq, cfg.vocab, generator, device)
        # zdiag starts the allocator history at the first module forward: what exists before
        # (the sharded parameters, the first batch) is in the snapshot without a stack.
        for t in [*model.parameters(), inputs, labels]:
            recorder.adopt(t)
        with recorder:
            for step in (1, 2):
                if step == 2 and history:
                    inputs, labels = synthetic_batch(
                        cfg.batch, cfg.seq, cfg.vocab, generator, device
                    )
                elif step == 2:
                    inputs, labels = synthetic_batch(
                        cfg.batch, cfg.seq, cfg.vocab, generator, device
                    )
                    layers = model.layers
                    target = layers[stop_layer]  # type: ignore[index]
                    target.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(_Stopped()))
                try:
                    logits = model(inputs)
                except _Stopped:
                    # As zdiag's OOM handler does: while the exception's traceback still holds
                    # the forward's frames, so the activations saved so far are alive.
                    blocks = recorder.live_blocks(with_frames)
                    break
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del logits, loss
            if history:
                recorder.poll_frees()
                blocks = recorder.live_blocks(with_frames)
    finally:
        dist.destroy_process_group()
    total = sum(b["size"] for b in blocks)
    if history:
        return _snapshot(blocks, total, recorder.events)
    request = max(b["size"] for b in blocks)
    oom_frames = blocks[-1]["frames"] if blocks else []
    oom = {
        "action": "oom",
        "addr": 0,
        "size": request,
        "stream": 0,
        "device_free": 0,
        "frames": oom_frames,
    }
    return _snapshot(blocks, total, [oom])


def _snapshot(
    blocks: list[dict[str, Any]], total: int, events: list[dict[str, Any]]
) -> dict[str, Any]:
    """The snapshot dict: one segment holding the live blocks, and the device's events."""
    return {
        "segments": [
            {
                "device": 0,
                "address": 0,
                "total_size": total,
                "allocated_size": total,
                "active_size": total,
                "requested_size": total,
                "stream": 0,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "blocks": blocks,
            }
        ],
        "device_traces": [events],
    }


def main() -> None:
    """Write the snapshot pickle."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--stop-layer", type=int, default=3)
    parser.add_argument("--ac", choices=("none", "block"), default="none")
    parser.add_argument("--no-frames", action="store_true")
    parser.add_argument("--history", action="store_true")
    args = parser.parse_args()
    snapshot = capture(args.stop_layer, args.ac, not args.no_frames, args.history)
    with open(args.out, "wb") as f:
        pickle.dump(snapshot, f)


if __name__ == "__main__":
    main()
