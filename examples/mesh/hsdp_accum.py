"""HSDP with gradient accumulation: 4 micro-batches per optimizer step on a (2, 2) DeviceMesh
(FSDP2 `fully_shard(stage, mesh=mesh)`, dim 0 replicate, dim 1 shard). Each micro-batch's backward
all-reduces the gradients across the replicas, as FSDP2 does by default.

torchrun --standalone --nproc-per-node 4 examples/mesh/hsdp_accum.py [--steps 6]
zdiag run --nproc-per-node 4 examples/mesh/hsdp_accum.py
"""

from __future__ import annotations

import argparse
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard


class ResidualMLP(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear, with a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Encoder(nn.Module):
    """A stack of residual stages (`encoder.stages[i]`)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.stages = nn.ModuleList(ResidualMLP(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x


class TabResNet(nn.Module):
    """Tabular features -> stem -> residual encoder -> class logits."""

    def __init__(self, features: int = 32, width: int = 128, depth: int = 4, classes: int = 8):
        super().__init__()
        self.stem = nn.Linear(features, width)
        self.encoder = Encoder(width, depth)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.stem(x)))


def wrap(model: nn.Module, mesh: DeviceMesh) -> None:
    for stage in cast(TabResNet, model).encoder.stages:
        fully_shard(stage, mesh=mesh)
    fully_shard(model, mesh=mesh)


def before_backward(model: nn.Module, i: int) -> None:
    """Called before micro-batch i's backward (i = 0 .. MICRO_BATCHES - 1)."""


MICRO_BATCHES = 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=256)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = TabResNet()
    wrap(model, mesh)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        for i in range(MICRO_BATCHES):
            x = torch.randn(args.batch // MICRO_BATCHES, 32, generator=gen)
            y = torch.randint(0, 8, (args.batch // MICRO_BATCHES,), generator=gen)
            loss = F.cross_entropy(model(x), y) / MICRO_BATCHES
            before_backward(model, i)
            loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
