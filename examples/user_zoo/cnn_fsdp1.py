"""Train the residual ConvNet with FSDP1 (`FullyShardedDataParallel` + an auto wrap policy).

torchrun --standalone --nproc-per-node 2 cnn_fsdp1.py [--policy unit|none|leaf]
    [--no-backward-prefetch] [--no-forward-prefetch] [--act-ckpt]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from convnet import ConvNet, ConvUnit, random_images
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from trainkit import (
    ActivationBudget,
    Faults,
    StepLog,
    add_common_args,
    device,
    init_distributed,
    wrap_or_paste,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--policy",
        choices=("unit", "none", "leaf"),
        default="unit",
        help="auto wrap: each ConvUnit, nothing (one flat unit), or every conv/linear",
    )
    p.add_argument("--no-backward-prefetch", action="store_true")
    p.add_argument("--no-forward-prefetch", action="store_true")
    p.add_argument("--act-ckpt", action="store_true", help="activation checkpointing per ConvUnit")
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--image-size", type=int, default=16)
    add_common_args(p, batch=16)
    args = p.parse_args()

    rank, _ = init_distributed(timeout_s=args.pg_timeout_s)
    torch.manual_seed(args.seed)
    model = ConvNet(args.channels, args.depth)
    for m in model.modules():
        if isinstance(m, ConvUnit):
            m.debug_checks = args.nan_check
    policy = {
        "unit": ModuleWrapPolicy({ConvUnit}),
        "leaf": ModuleWrapPolicy({nn.Conv2d, nn.Linear}),
        "none": None,
    }[args.policy]

    def wrap(model: nn.Module) -> nn.Module:  # the script's own wrap (--paste may replace it)
        model = FSDP(
            model,
            auto_wrap_policy=policy,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            backward_prefetch=None if args.no_backward_prefetch else BackwardPrefetch.BACKWARD_PRE,
            forward_prefetch=not args.no_forward_prefetch,
            limit_all_gathers=True,
            device_id=device(),
            use_orig_params=True,
        )
        return model

    model = wrap_or_paste(model, args.paste, wrap)
    if args.act_ckpt:
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(
                torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper
            ),
            check_fn=lambda m: isinstance(m, ConvUnit),
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps))
    budget = ActivationBudget(model, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(7 + rank)

    for step in range(args.steps):
        faults.before_step(step)
        images, labels = random_images(args.batch, args.image_size, gen)
        with budget.track():
            loss = F.cross_entropy(model(images.to(device())), labels.to(device()))
            loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        log.step_done(step, loss.detach())
    log.summary(budget)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
