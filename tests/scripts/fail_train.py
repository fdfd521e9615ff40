"""A small FSDP2 training script that fails on purpose: a crash, a hang or a slow step.

    torchrun --nproc-per-node 2 fail_train.py --steps 8 [--crash-at-step 3 [--crash-rank 1]]
        [--hang-at-step 4 --hang-rank 1] [--step-sleep 0.2]

Written as a user writes a script (argparse, its own model and loop, no zdiag import); the tests
run it under `zdiag run` to check that a failed, killed or hung run leaves an analyzable run dir.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


class Cell(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Trunk(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.cells = nn.ModuleList(Cell(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for cell in self.cells:
            x = cell(x)
        return self.head(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--crash-at-step", type=int, default=None)
    p.add_argument("--crash-rank", type=int, default=-1, help="-1: every rank")
    p.add_argument("--hang-at-step", type=int, default=None)
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of data loading a step")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Trunk(args.width, depth=3)
    for cell in model.cells:
        fully_shard(cell)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        if args.hang_at_step == step and rank == args.hang_rank:
            while True:  # stuck before its forward: the peers wait in the next all-gather
                time.sleep(0.5)
        time.sleep(args.step_sleep)
        x = torch.randn(32, args.width)
        loss = model(x).pow(2).mean()
        loss.backward()
        if args.crash_at_step == step and args.crash_rank in (-1, rank):
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        opt.step()
        opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()
    if os.environ.get("FAIL_TRAIN_SAY_DONE"):
        print(f"rank {rank} done")


if __name__ == "__main__":
    main()
