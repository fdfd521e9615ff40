"""Train the embedding-heavy recommender with FSDP2 (tables and cross towers as units).

torchrun --standalone --nproc-per-node 2 recsys_fsdp2.py [--units towers|towers-only|root|leaf]
    [--prefetch on|off] [--validate] [--ac]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from recsys import CrossUnit, Recommender, click_batch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.checkpoint import checkpoint
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--units", choices=("towers", "towers-only", "root", "leaf"), default="towers")
    p.add_argument("--prefetch", choices=("on", "off"), default="on")
    p.add_argument("--validate", action="store_true", help="check each tower's output")
    p.add_argument("--ac", action="store_true")
    p.add_argument("--sparse", type=int, default=6)
    p.add_argument("--cardinality", type=int, default=20000)
    p.add_argument("--emb-dim", type=int, default=32)
    p.add_argument("--depth", type=int, default=3)
    add_common_args(p, batch=512)
    add_fsdp2_args(p)
    args = p.parse_args()

    rank, _ = init_distributed(timeout_s=args.pg_timeout_s)
    torch.manual_seed(args.seed)
    model = Recommender(args.sparse, args.cardinality, args.emb_dim, depth=args.depth).to(device())
    towers = list(model.interaction.towers)
    for t in towers:
        t.validate = args.validate or args.nan_check
        if args.ac:
            fwd = t.forward
            t.forward = lambda x0, x, _f=fwd: checkpoint(_f, x0, x, use_reentrant=False)  # type: ignore[method-assign]

    def wrap(model: nn.Module) -> nn.Module:  # the script's own wrap (--paste may replace it)
        if args.units in ("towers", "towers-only"):
            if args.units == "towers":
                fully_shard(model.features)  # the embedding tables: one unit
            for t in towers:  # towers-only: the tables stay in the root unit
                fully_shard(t)
        elif args.units == "leaf":
            for m in list(model.modules()):
                if isinstance(m, (nn.Linear, nn.EmbeddingBag, nn.LayerNorm)):
                    fully_shard(m)
        fully_shard(model)
        units = [u for u in [model.features, *towers] if isinstance(u, FSDPModule)]
        if args.units in ("towers", "towers-only"):
            for i, u in enumerate(units):
                nxt, prev = units[i + 1 : i + 2], units[i - 1 : i] if i else []
                u.set_modules_to_forward_prefetch(nxt if args.prefetch == "on" else [u])
                u.set_modules_to_backward_prefetch(prev if args.prefetch == "on" else [u])
        assert all(isinstance(t, CrossUnit) for t in model.interaction.towers)

        set_unshard_async(model, args.unshard_async)
        return model

    model = wrap_or_paste(model, args.paste, wrap)

    opt = torch.optim.Adagrad(model.parameters(), lr=0.02)
    budget = ActivationBudget(model, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(11 + rank)
    for step in range(args.steps):
        faults.before_step(step)
        dense, ids, clicks = click_batch(args.batch, args.sparse, args.cardinality, gen)
        with budget.track():
            logit = model(dense.to(device()), ids.to(device()))
            loss = F.binary_cross_entropy_with_logits(logit, clicks.to(device()))
            loss.backward()
        opt.step()
        opt.zero_grad()
        log.step_done(step, loss.detach())
    log.summary(budget)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
