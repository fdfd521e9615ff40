"""A 2-stage pipeline with data parallelism on a (2, 2) DeviceMesh ("dp", "pp"): stage 0 holds the
stem and the first half of the residual stages, stage 1 the rest and the head
(`torch.distributed.pipelining`: PipelineStage + ScheduleGPipe over 4 micro-batches); each stage's
blocks are FSDP2 units over "dp".

torchrun --standalone --nproc-per-node 4 examples/mesh/pipeline.py [--steps 6]
zdiag run --nproc-per-node 4 examples/mesh/pipeline.py [--stage-blocks 3,1] [--microbatches 8]

`--stage-blocks A,B` splits the encoder's blocks A to stage 0 and B to stage 1 (default 2,2: a
balanced split); 3,1 makes stage 0 the slow stage the other one waits for.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--stage-blocks", default="2,2", help="encoder blocks of stage 0 and 1")
    args = p.parse_args()
    first, second = (int(n) for n in args.stage_blocks.split(","))

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "pp"))
    stage_index, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    torch.manual_seed(0)
    model = TabResNet(depth=first + second)
    half = first
    if stage_index == 0:  # the stem and the first `first` blocks of the encoder
        del model.encoder.stages[half:]
        model.head = nn.Identity()  # type: ignore[assignment]
    else:  # the rest of the encoder and the head
        del model.encoder.stages[:half]
        model.stem = nn.Identity()  # type: ignore[assignment]
    for block in model.encoder.stages:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    stage = PipelineStage(
        model, stage_index, stages, torch.device("cpu"), group=mesh["pp"].get_group()
    )
    schedule = ScheduleGPipe(stage, n_microbatches=args.microbatches, loss_fn=F.cross_entropy)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + mesh["dp"].get_local_rank())  # same batch per pipe
    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=gen)
        y = torch.randint(0, 8, (args.batch,), generator=gen)
        if stage_index == 0:
            schedule.step(x)
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
            if mesh["dp"].get_local_rank() == 0:
                print(f"step {step} loss {torch.stack(losses).mean().item():.4f}", flush=True)
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
