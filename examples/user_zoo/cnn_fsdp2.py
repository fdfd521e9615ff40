"""Train the residual ConvNet with FSDP2 (`fully_shard`) on synthetic images.

torchrun --standalone --nproc-per-node 2 cnn_fsdp2.py [--wrap stage|whole|leaf]
    [--prefetch explicit|default|off] [--checkpointing] [--nan-check] [--slow-rank 1]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from convnet import ConvNet, ConvUnit, random_images
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from trainkit import (
    ActivationBudget,
    Faults,
    StepLog,
    add_common_args,
    add_fsdp2_args,
    device,
    init_distributed,
    set_unshard_async,
    wrap_or_paste,
)


def shard_model(model: ConvNet, wrap: str, prefetch: str) -> None:
    """fully_shard the units the `wrap` choice names, then the root; set up prefetching."""
    mesh = init_device_mesh(device().type, (torch.distributed.get_world_size(),))
    units: list[nn.Module]
    if wrap == "stage":
        units = list(model.backbone.stages)
    elif wrap == "leaf":
        units = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    else:
        units = []
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fsdp_units = [u for u in units if isinstance(u, FSDPModule)]
    if prefetch == "explicit":
        for i, unit in enumerate(fsdp_units):
            if i + 1 < len(fsdp_units):
                unit.set_modules_to_forward_prefetch([fsdp_units[i + 1]])
            if i > 0:
                unit.set_modules_to_backward_prefetch([fsdp_units[i - 1]])
    elif prefetch == "off":
        # meant to be "the next unit"; an off-by-one names the unit itself, which also turns
        # off FSDP2's implicit backward prefetch
        for unit in fsdp_units:
            unit.set_modules_to_forward_prefetch([unit])
            unit.set_modules_to_backward_prefetch([unit])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wrap", choices=("stage", "whole", "leaf"), default="stage")
    p.add_argument("--prefetch", choices=("explicit", "default", "off"), default="explicit")
    p.add_argument("--checkpointing", action="store_true", help="recompute each ConvUnit")
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--image-size", type=int, default=16)
    add_common_args(p, batch=16)
    add_fsdp2_args(p)
    args = p.parse_args()

    rank, _world = init_distributed(timeout_s=args.pg_timeout_s)
    torch.manual_seed(args.seed)
    model = ConvNet(args.channels, args.depth).to(device())
    model.backbone.grad_checkpointing = args.checkpointing
    for unit in model.modules():
        if isinstance(unit, ConvUnit):
            unit.debug_checks = args.nan_check

    def wrap(model: nn.Module) -> nn.Module:  # the script's own wrap (--paste may replace it)
        shard_model(model, args.wrap, args.prefetch)
        set_unshard_async(model, args.unshard_async)
        return model

    model = wrap_or_paste(model, args.paste, wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    budget = ActivationBudget(model, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(100 + rank)

    model.train()
    for step in range(args.steps):
        faults.before_step(step)
        images, labels = random_images(args.batch, args.image_size, gen)
        images, labels = images.to(device()), labels.to(device())
        with budget.track():
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.step_done(step, loss.detach())
    log.summary(budget)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
