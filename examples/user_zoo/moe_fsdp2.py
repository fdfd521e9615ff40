"""Train the mixture-of-experts model (`body.mixers[i]` with `experts[j]`) with FSDP2.

torchrun --standalone --nproc-per-node 2 moe_fsdp2.py [--granularity mixer|none|linear]
    [--prefetch on|off] [--ckpt] [--log-balance]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from moe import MoEModel, token_batch
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
    p.add_argument(
        "--granularity",
        choices=("mixer", "none", "linear"),
        default="mixer",
        help="FSDP units: each MoEMixer, only the root, or every Linear of the mixers",
    )
    p.add_argument("--prefetch", choices=("on", "off"), default="on")
    p.add_argument("--ckpt", action="store_true", help="checkpoint every mixer")
    p.add_argument("--log-balance", action="store_true", help="log router balance per mixer")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--dim", type=int, default=96)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--seq", type=int, default=32)
    add_common_args(p, batch=8)
    add_fsdp2_args(p)
    args = p.parse_args()

    rank, _ = init_distributed(timeout_s=args.pg_timeout_s)
    torch.manual_seed(args.seed)
    model = MoEModel(args.vocab, args.dim, 4 * args.dim, args.experts, args.depth).to(device())
    mixers = list(model.body.mixers)
    for mixer in mixers:
        mixer.log_balance = args.log_balance or args.nan_check
        if args.ckpt:
            fwd = mixer.forward
            mixer.forward = lambda x, _f=fwd: checkpoint(_f, x, use_reentrant=False)  # type: ignore[method-assign]

    def wrap(model: nn.Module) -> nn.Module:  # the script's own wrap (--paste may replace it)
        if args.granularity == "mixer":
            for mixer in mixers:
                fully_shard(mixer)
        elif args.granularity == "linear":
            for mixer in mixers:
                for m in list(mixer.modules()):
                    if type(m) is nn.Linear:  # not attention's out_proj: MHA reads it directly
                        fully_shard(m)
        fully_shard(model)
        units = [m for m in mixers if isinstance(m, FSDPModule)]
        for i, unit in enumerate(units):
            if args.prefetch == "on":
                unit.set_modules_to_forward_prefetch(units[i + 1 : i + 2])
                unit.set_modules_to_backward_prefetch(units[max(0, i - 1) : i])
            else:
                unit.set_modules_to_forward_prefetch([unit])
                unit.set_modules_to_backward_prefetch([unit])

        set_unshard_async(model, args.unshard_async)
        return model

    model = wrap_or_paste(model, args.paste, wrap)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=False)
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
        opt.step()
        opt.zero_grad()
        log.step_done(step, loss.detach())
    log.summary(budget)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
