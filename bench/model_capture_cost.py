"""What the model description costs: once per run, and (it should be) nothing per step.

1. One-time cost: `describe_model` plus writing `model/rank-0.json` through `ModelCapture` (the
   path `zdiag run` takes at the first forward), on a ~100M-parameter model, on a model with ~2000
   modules, and on that model under FSDP2 (`fully_shard` per block, world size 1, gloo).
2. Per step: a tiny MLP trains for `--steps` steps with and without a `ModelCapture` armed
   (alternating rounds, median step time over steps 2..N of each round; step 0 pays the capture
   and step 1 removes the hooks), and the number of global forward pre-hooks and optimizer step
   hooks left after the first iteration is checked to be what it was before.

    .venv/bin/python bench/model_capture_cost.py [--steps 300] [--rounds 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as module_mod
from torch.optim import optimizer as optimizer_mod

from zdiag.collectors.model_capture import ModelCapture


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, dim)
        self.trunk = nn.ModuleDict(
            {"cells": nn.ModuleList(Block(dim, hidden) for _ in range(blocks))}
        )
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        cells = self.trunk["cells"]
        assert isinstance(cells, nn.ModuleList)
        for cell in cells:
            x = cell(x)
        out: torch.Tensor = self.head(x)
        return out


def big_model() -> Net:
    """~100M parameters: 12 blocks of 1024 -> 4096 -> 1024."""
    return Net(1024, 4096, 12)


def many_modules_model() -> Net:
    """~2000 modules: 500 blocks of 4 modules."""
    return Net(16, 32, 500)


def one_time_ms(model: nn.Module, repeats: int) -> tuple[float, int, int]:
    """Median ms from the model's first forward entering the hook to the file written."""
    times = []
    size = 0
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            errors: list[str] = []
            capture = ModelCapture(tmp, 0, errors.append)
            t0 = time.perf_counter()
            capture._on_forward(model, ())  # what the global pre-hook calls
            times.append((time.perf_counter() - t0) * 1000.0)
            assert capture.written and not errors, errors
            size = capture.path.stat().st_size
    modules = sum(1 for _ in model.modules())
    return statistics.median(times), size, modules


def step_times_ms(capture_armed: bool, steps: int) -> list[float]:
    """Per-step wall times of a tiny MLP, with or without the capture armed at the start."""
    torch.manual_seed(0)
    model = Net(32, 64, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 32)
    pre_hooks = len(module_mod._global_forward_pre_hooks)
    step_hooks = len(optimizer_mod._global_optimizer_post_hooks)
    with tempfile.TemporaryDirectory() as tmp:
        capture = ModelCapture(tmp, 0, print).arm() if capture_armed else None
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            times.append((time.perf_counter() - t0) * 1000.0)
        # the hooks removed themselves at step 1's forward: nothing of the capture is left
        assert len(module_mod._global_forward_pre_hooks) == pre_hooks
        assert len(optimizer_mod._global_optimizer_post_hooks) == step_hooks
        assert capture is None or capture.written
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )

    print("\n| model | parameters | modules | one-time cost (median) | file size |")
    print("| --- | --- | --- | --- | --- |")
    for name, build in (
        ("~100M params, 12 blocks", big_model),
        ("~2000 modules", many_modules_model),
    ):
        model = build()
        params = sum(p.numel() for p in model.parameters())
        ms, size, modules = one_time_ms(model, args.repeats)
        print(
            f"| {name} | {params / 1e6:.1f} M | {modules} | {ms:.1f} ms | {size / 1024:.0f} KiB |"
        )
        del model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.fsdp import fully_shard

    model = many_modules_model()
    cells = model.trunk["cells"]
    assert isinstance(cells, nn.ModuleList)
    for cell in cells:
        fully_shard(cell)
    fully_shard(model)
    params = sum(p.numel() for p in model.parameters())
    ms, size, modules = one_time_ms(model, args.repeats)
    print(
        f"| ~2000 modules, FSDP2 (501 units, ws 1) | {params / 1e6:.1f} M | {modules} | {ms:.1f} ms | {size / 1024:.0f} KiB |"
    )
    dist.destroy_process_group()

    medians: dict[bool, list[float]] = {False: [], True: []}
    first: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for armed in (False, True):
            times = step_times_ms(armed, args.steps)
            medians[armed].append(statistics.median(times[2:]))
            first[armed].append(times[0])
    off, on = statistics.median(medians[False]), statistics.median(medians[True])
    print(
        f"\nper step, tiny MLP, {args.steps} steps x {args.rounds} rounds (median of round medians, steps 2..N):"
    )
    print(
        f"  without capture {off * 1000:.1f} us, with capture armed {on * 1000:.1f} us "
        f"({(on - off) * 1000:+.1f} us, {(on / off - 1) * 100:+.1f} %)"
    )
    print(
        f"  step 0: {statistics.median(first[False]):.2f} ms without, "
        f"{statistics.median(first[True]):.2f} ms with (the capture itself)"
    )
    print("  hooks left after the first iteration: none added (checked)")


if __name__ == "__main__":
    main()
