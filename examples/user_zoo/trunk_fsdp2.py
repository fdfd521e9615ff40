"""Train a gated MLP trunk (`trunk.cells[i]`, GatedCell) with FSDP2 on a regression target.

torchrun --standalone --nproc-per-node 2 trunk_fsdp2.py [--shard-granularity cell|model|linear]
    [--no-prefetch] [--recompute] [--sanity-checks] [--grad-accum 1]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from tabular import GatedCell, MLPTrunkNet
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
    fsdp_mesh,
    init_distributed,
    set_unshard_async,
    wrap_or_paste,
)


class Recompute(nn.Module):
    """Runs a cell under activation checkpointing."""

    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.cell = cell

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.cell, x, use_reentrant=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shard-granularity", choices=("cell", "model", "linear"), default="cell")
    p.add_argument("--no-prefetch", action="store_true", help="no explicit prefetch chain")
    p.add_argument("--recompute", action="store_true", help="activation checkpointing per cell")
    p.add_argument("--sanity-checks", action="store_true")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--features", type=int, default=48)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--depth", type=int, default=6)
    add_common_args(p, batch=256)
    add_fsdp2_args(p)
    args = p.parse_args()

    rank, _ = init_distributed(timeout_s=args.pg_timeout_s)
    torch.manual_seed(args.seed)
    model = MLPTrunkNet(args.features, args.width, args.hidden, args.depth).to(device())
    for cell in model.trunk.cells:
        cell.sanity = args.sanity_checks or args.nan_check
    if args.recompute:
        model.trunk.cells = nn.ModuleList(Recompute(c) for c in model.trunk.cells)

    def wrap(model: nn.Module) -> nn.Module:  # the script's own wrap (--paste may replace it)
        mesh = fsdp_mesh(args)
        if args.shard_granularity == "cell":
            for cell in model.trunk.cells:
                fully_shard(cell, mesh=mesh)
        elif args.shard_granularity == "linear":
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        cells = [c for c in model.trunk.cells if isinstance(c, FSDPModule)]
        if args.no_prefetch:
            for c in cells:
                c.set_modules_to_forward_prefetch([c])
                c.set_modules_to_backward_prefetch([c])
        else:
            for i, c in enumerate(cells):
                c.set_modules_to_forward_prefetch(cells[i + 1 : i + 2])
                c.set_modules_to_backward_prefetch(cells[i - 1 : i] if i else [])
        assert all(isinstance(m, GatedCell) or isinstance(m, Recompute) for m in model.trunk.cells)

        set_unshard_async(model, args.unshard_async)
        return model

    model = wrap_or_paste(model, args.paste, wrap)

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    budget = ActivationBudget(model, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(5 + rank)
    w_true = torch.randn(args.features, generator=torch.Generator().manual_seed(0))

    for step in range(args.steps):
        faults.before_step(step)
        for micro in range(args.grad_accum):
            model.set_requires_gradient_sync(micro == args.grad_accum - 1)
            x = torch.randn(args.batch, args.features, generator=gen)
            y = x @ w_true
            with budget.track():
                loss = F.mse_loss(model(x.to(device())), y.to(device()))
                loss.backward()
        opt.step()
        opt.zero_grad()
        log.step_done(step, loss.detach())
    log.summary(budget)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
