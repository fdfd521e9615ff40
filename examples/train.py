"""A plain PyTorch training script with its own loop: no zdiag import, no profiler calls.

    python examples/train.py --steps 8
    zdiag run examples/train.py --steps 8                       # one process
    zdiag run --nproc-per-node 2 examples/train.py --steps 8    # 2 ranks (gloo, DDP)

Under torchrun (RANK/WORLD_SIZE set) it joins a gloo process group and averages gradients with
`all_reduce` after `backward()`; otherwise it trains alone. (Not DDP: with torch 2.13 on gloo,
DDP's in-backward collectives can deadlock `destroy_process_group` at exit, independently of
zdiag.) `zdiag run` finds its steps through the optimizer, with no change here.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def build_model(dim: int, layers: int) -> nn.Module:
    """A small MLP: `layers` blocks of Linear + GELU, then a Linear head."""
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(dim, dim), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(dim, 1))


def main() -> None:
    """Train on random data for --steps steps and print the final loss."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    distributed = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    model: nn.Module = build_model(args.dim, args.layers)
    world = dist.get_world_size() if distributed else 1
    if distributed:  # same initial weights everywhere
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(rank)
    started = time.perf_counter()
    loss = torch.zeros(())
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.dim, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if distributed:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - started
    if rank == 0:
        print(f"trained {args.steps} steps in {elapsed:.2f} s, final loss {loss.item():.4f}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
