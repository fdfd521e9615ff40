"""Train the tabular ResNet with FSDP1, wrapping by a policy chosen on the command line.

torchrun --standalone --nproc-per-node 2 tabular_fsdp1.py [--wrap-policy residual|root|linear]
    [--backward-prefetch pre|post|none] [--forward-prefetch] [--checkpoint-stages]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from tabular import ResidualMLP, TabularResNet, random_rows
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import (
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from trainkit import (
    ActivationBudget,
    Faults,
    StepLog,
    add_common_args,
    device,
    init_distributed,
    wrap_or_paste,
)

PREFETCH = {
    "pre": BackwardPrefetch.BACKWARD_PRE,
    "post": BackwardPrefetch.BACKWARD_POST,
    "none": None,
}


def wrap_policy(name: str):  # type: ignore[no-untyped-def]
    """The auto wrap policy: per ResidualMLP, none (root only), or every Linear."""
    if name == "residual":
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={ResidualMLP})
    if name == "linear":
        return functools.partial(
            lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)
        )
    if name == "size":
        return functools.partial(size_based_auto_wrap_policy, min_num_params=int(1e8))
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--wrap-policy", choices=("residual", "root", "linear", "size"), default="residual"
    )
    p.add_argument("--backward-prefetch", choices=tuple(PREFETCH), default="pre")
    p.add_argument("--forward-prefetch", action="store_true", default=True)
    p.add_argument("--no-forward-prefetch", dest="forward_prefetch", action="store_false")
    p.add_argument("--checkpoint-stages", action="store_true")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    add_common_args(p, batch=256)
    args = p.parse_args()

    rank, _ = init_distributed(timeout_s=args.pg_timeout_s)
    torch.manual_seed(args.seed)
    model = TabularResNet(args.features, args.width, args.hidden, args.depth)
    for stage in model.encoder.stages:
        stage.check_finite = args.nan_check

    def wrap(model: nn.Module) -> nn.Module:  # the script's own wrap (--paste may replace it)
        model = FSDP(
            model,
            auto_wrap_policy=wrap_policy(args.wrap_policy),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            backward_prefetch=PREFETCH[args.backward_prefetch],
            forward_prefetch=args.forward_prefetch,
            device_id=device(),
        )
        return model

    model = wrap_or_paste(model, args.paste, wrap)
    if args.checkpoint_stages:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, ResidualMLP))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95))
    budget = ActivationBudget(model, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(99 + rank)

    for step in range(args.steps):
        faults.before_step(step)
        x, y = random_rows(args.batch, args.features, gen)
        with budget.track():
            loss = F.cross_entropy(model(x.to(device())), y.to(device()))
            loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        log.step_done(step, loss.detach())
    log.summary(budget)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
