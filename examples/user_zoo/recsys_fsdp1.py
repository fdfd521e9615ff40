"""Train the recommender with FSDP1 (FULL_SHARD; the tables and each CrossUnit are units).

torchrun --standalone --nproc-per-node 2 recsys_fsdp1.py [--wrap cross|cross-only|whole|every-linear]
    [--strategy SHARD_GRAD_OP|FULL_SHARD] [--backward-prefetch pre|none] [--validate]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from recsys import CrossUnit, Recommender, SparseFeatures, click_batch
from torch import nn
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
        "--wrap", choices=("cross", "cross-only", "whole", "every-linear"), default="cross"
    )
    p.add_argument("--strategy", choices=("SHARD_GRAD_OP", "FULL_SHARD"), default="FULL_SHARD")
    p.add_argument("--backward-prefetch", choices=("pre", "none"), default="pre")
    p.add_argument("--validate", action="store_true")
    p.add_argument("--sparse", type=int, default=6)
    p.add_argument("--cardinality", type=int, default=20000)
    p.add_argument("--emb-dim", type=int, default=32)
    p.add_argument("--depth", type=int, default=3)
    add_common_args(p, batch=512)
    args = p.parse_args()

    rank, _ = init_distributed(timeout_s=args.pg_timeout_s)
    torch.manual_seed(args.seed)
    model = Recommender(args.sparse, args.cardinality, args.emb_dim, depth=args.depth)
    for t in model.interaction.towers:
        t.validate = args.validate or args.nan_check
    policy = {
        "cross": ModuleWrapPolicy({CrossUnit, SparseFeatures}),
        "cross-only": ModuleWrapPolicy({CrossUnit}),  # the tables stay in the root unit
        "whole": None,
        "every-linear": ModuleWrapPolicy({nn.Linear, nn.EmbeddingBag}),
    }[args.wrap]

    def wrap(model: nn.Module) -> nn.Module:  # the script's own wrap (--paste may replace it)
        model = FSDP(
            model,
            auto_wrap_policy=policy,
            sharding_strategy=ShardingStrategy[args.strategy],
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE
            if args.backward_prefetch == "pre"
            else None,
            device_id=device(),
        )
        return model

    model = wrap_or_paste(model, args.paste, wrap)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    budget = ActivationBudget(model, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(11 + rank)
    for step in range(args.steps):
        faults.before_step(step)
        dense, ids, clicks = click_batch(args.batch, args.sparse, args.cardinality, gen)
        with budget.track():
            loss = F.binary_cross_entropy_with_logits(
                model(dense.to(device()), ids.to(device())), clicks.to(device())
            )
            loss.backward()
        opt.step()
        opt.zero_grad()
        log.step_done(step, loss.detach())
    log.summary(budget)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
