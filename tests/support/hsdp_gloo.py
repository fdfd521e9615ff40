"""A 4-rank HSDP job on gloo for the process-group tests: a (2, 2) DeviceMesh ("replicate",
"shard") with FSDP2 `fully_shard(block, mesh=mesh)`, so the shard groups are {0,1}, {2,3} and
the replicate groups {0,2}, {1,3}.

    python -m zdiag run --nproc-per-node 4 --out DIR tests/support/hsdp_gloo.py [--slow-rank R]

`--slow-rank R` makes rank R sleep `--slow-ms` before each step and each block's forward and
backward (a rank with slow compute: a straggler inside its shard group, late for most of its
collectives).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    """Train a few steps of a small MLP under HSDP on a (2, 2) mesh."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-ms", type=float, default=30.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)])
    if rank == args.slow_rank:
        for block in model:  # registered before FSDP's: each block's all-gather is issued late
            block.register_forward_pre_hook(lambda *_: time.sleep(args.slow_ms / 1000.0))
            block.register_full_backward_pre_hook(lambda *_: time.sleep(args.slow_ms / 1000.0))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(args.steps):
        if rank == args.slow_rank:
            time.sleep(args.slow_ms / 1000.0)
        x = torch.randn(32, 256)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print("done")


if __name__ == "__main__":
    main()
