"""Train a tabular ResNet (`encoder.stages[i]`, ResidualMLP) with FSDP2 and a warm-up schedule.

torchrun --standalone --nproc-per-node 2 tabular_fsdp2.py [--wrap block|whole|leaf]
    [--prefetch explicit|off] [--ac] [--finite-checks] [--mem-budget-mib 40] [--grad-accum 1]
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from tabular import ResidualMLP, TabularResNet, random_rows
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from trainkit import (
    ActivationBudget,
    Faults,
    StepLog,
    add_common_args,
    add_fsdp2_args,
    device,
    fsdp_mesh,
    init_distributed,
    set_unshard_async,
    wrap_or_paste,
)


def apply_fsdp(model: TabularResNet, wrap: str, prefetch: str, mesh: Any = None) -> None:
    """Shard per residual stage (or as `wrap` says) over `mesh` and chain the prefetches."""
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    if wrap == "block":
        for stage in model.encoder.stages:
            fully_shard(stage, mp_policy=mp, mesh=mesh)
    elif wrap == "leaf":
        for module in list(model.modules()):
            if isinstance(module, (nn.Linear, nn.LayerNorm)):
                fully_shard(module, mp_policy=mp, mesh=mesh)
    fully_shard(model, mp_policy=mp, mesh=mesh)
    stages = [s for s in model.encoder.stages if isinstance(s, FSDPModule)]
    if prefetch == "explicit" and stages:
        for prev, nxt in itertools.pairwise(stages):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])
    elif prefetch == "off":
        for stage in stages:  # "prefetch nothing": but an empty list means FSDP2's default
            stage.set_modules_to_forward_prefetch([stage])
            stage.set_modules_to_backward_prefetch([stage])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wrap", choices=("block", "whole", "leaf"), default="block")
    p.add_argument("--prefetch", choices=("explicit", "off"), default="explicit")
    p.add_argument("--ac", action="store_true", help="activation checkpointing per stage")
    p.add_argument("--finite-checks", action="store_true", help="assert finite stage outputs")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add_common_args(p, batch=256)
    add_fsdp2_args(p)
    args = p.parse_args()

    rank, world = init_distributed(timeout_s=args.pg_timeout_s)
    torch.manual_seed(args.seed)
    model = TabularResNet(args.features, args.width, args.hidden, args.depth).to(device())
    for stage in model.encoder.stages:
        stage.check_finite = args.finite_checks or args.nan_check
    if args.ac:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, ResidualMLP))

    def wrap(model: nn.Module) -> nn.Module:  # the script's own wrap (--paste may replace it)
        apply_fsdp(model, args.wrap, args.prefetch, fsdp_mesh(args))
        set_unshard_async(model, args.unshard_async)
        return model

    model = wrap_or_paste(model, args.paste, wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    budget = ActivationBudget(model, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(1234 + rank)

    for step in range(args.steps):
        faults.before_step(step)
        for micro in range(args.grad_accum):  # the last micro-batch reduces the gradients
            if args.grad_accum > 1:
                model.set_requires_gradient_sync(micro == args.grad_accum - 1)
            x, y = random_rows(args.batch, args.features, gen)
            with budget.track():
                logits = model(x.to(device()))
                loss = F.cross_entropy(logits, y.to(device()))
                loss.backward()
        opt.step()
        warmup.step()
        opt.zero_grad()
        log.step_done(step, loss.detach())
    if rank == 0:
        print(f"trained on {world} ranks", flush=True)
    log.summary(budget)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
