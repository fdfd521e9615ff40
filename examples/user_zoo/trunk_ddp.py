"""Train the gated MLP trunk with DDP (static graph, gradients as bucket views).

torchrun --standalone --nproc-per-node 2 trunk_ddp.py [--checkpoint-cells] [--sanity-checks]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from tabular import MLPTrunkNet
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint_sequential
from trainkit import ActivationBudget, Faults, StepLog, add_common_args, device, init_distributed


class CheckpointedTrunk(torch.nn.Module):
    """The trunk's cells run with checkpoint_sequential (2 segments)."""

    def __init__(self, cells: torch.nn.ModuleList) -> None:
        super().__init__()
        self.cells = cells

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.cells, len(self.cells), x, use_reentrant=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-cells", action="store_true")
    p.add_argument("--sanity-checks", action="store_true")
    p.add_argument("--features", type=int, default=48)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--depth", type=int, default=6)
    add_common_args(p, batch=256)
    args = p.parse_args()

    rank, _ = init_distributed(timeout_s=args.pg_timeout_s)
    torch.manual_seed(args.seed)
    net = MLPTrunkNet(args.features, args.width, args.hidden, args.depth).to(device())
    for cell in net.trunk.cells:
        cell.sanity = args.sanity_checks or args.nan_check
    if args.checkpoint_cells:
        net.trunk = CheckpointedTrunk(net.trunk.cells)  # type: ignore[assignment]
    model = DistributedDataParallel(net, gradient_as_bucket_view=True, static_graph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    budget = ActivationBudget(model, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(5 + rank)
    w_true = torch.randn(args.features, generator=torch.Generator().manual_seed(0))

    for step in range(args.steps):
        faults.before_step(step)
        x = torch.randn(args.batch, args.features, generator=gen)
        with budget.track():
            loss = F.mse_loss(model(x.to(device())), (x @ w_true).to(device()))
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.step_done(step, loss.detach())
    log.summary(budget)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
