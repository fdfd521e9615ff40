"""Train the mixture-of-experts model with DDP (unused experts allowed).

torchrun --standalone --nproc-per-node 2 moe_ddp.py [--log-balance] [--checkpoint-mixers]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from moe import MoEModel, token_batch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from trainkit import ActivationBudget, Faults, StepLog, add_common_args, device, init_distributed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log-balance", action="store_true")
    p.add_argument("--checkpoint-mixers", action="store_true")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--dim", type=int, default=96)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--seq", type=int, default=32)
    add_common_args(p, batch=8)
    args = p.parse_args()

    rank, _world = init_distributed(timeout_s=args.pg_timeout_s)
    torch.manual_seed(args.seed)
    net = MoEModel(args.vocab, args.dim, 4 * args.dim, args.experts, args.depth).to(device())
    for mixer in net.body.mixers:
        mixer.log_balance = args.log_balance or args.nan_check
        if args.checkpoint_mixers:
            fwd = mixer.forward
            mixer.forward = lambda x, _f=fwd: checkpoint(_f, x, use_reentrant=False)  # type: ignore[method-assign]
    model = DDP(net, find_unused_parameters=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    budget = ActivationBudget(model, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(42 + rank)
    for step in range(args.steps):
        faults.before_step(step)
        tokens = token_batch(args.batch, args.seq, args.vocab, gen).to(device())
        with budget.track():
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        log.step_done(step, loss.detach())
    log.summary(budget)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
