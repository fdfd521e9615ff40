"""A small FSDP2 job on gloo in which one rank becomes slower part-way through.

    torchrun --nproc-per-node 4 tests/scripts/late_straggler.py --steps 60 --slow-rank 2 \
        --slow-from 30 --slow-ms 300

Without --slow-rank every rank does the same work (the healthy twin). No zdiag import: it is a
user's script, run under `zdiag run --monitor`.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-from", type=int, default=30)
    p.add_argument("--slow-ms", type=float, default=300.0)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=512)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*(torch.nn.Linear(args.dim, args.dim) for _ in range(4)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rank = dist.get_rank()
    x = torch.randn(args.batch, args.dim)
    for step in range(args.steps):
        if rank == args.slow_rank and step >= args.slow_from:
            time.sleep(args.slow_ms / 1000.0)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    if rank == 0:
        print(f"done {args.steps} steps on {os.environ.get('WORLD_SIZE')} ranks")


if __name__ == "__main__":
    main()
