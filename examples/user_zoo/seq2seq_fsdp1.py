"""Train the encoder-decoder with FSDP1 (one FSDP instance per tower class by default).

torchrun --standalone --nproc-per-node 2 seq2seq_fsdp1.py [--auto-wrap towers|off|linear]
    [--backward-prefetch BACKWARD_PRE|BACKWARD_POST|NONE] [--no-limit-all-gathers]
    [--checkpoint-towers] [--nan-check]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from seq2seq import DecoderTower, EncoderTower, Seq2Seq, copy_task
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.fsdp import BackwardPrefetch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy
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
    p.add_argument("--auto-wrap", choices=("towers", "off", "linear"), default="towers")
    p.add_argument(
        "--backward-prefetch",
        default="BACKWARD_PRE",
        choices=("BACKWARD_PRE", "BACKWARD_POST", "NONE"),
    )
    p.add_argument("--forward-prefetch", action="store_true", default=True)
    p.add_argument("--no-forward-prefetch", dest="forward_prefetch", action="store_false")
    p.add_argument("--no-limit-all-gathers", action="store_true")
    p.add_argument("--checkpoint-towers", action="store_true")
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    add_common_args(p, batch=16)
    args = p.parse_args()

    rank, _ = init_distributed(timeout_s=args.pg_timeout_s)
    torch.manual_seed(args.seed)
    model = Seq2Seq(args.vocab, args.dim, 4, args.depth)
    for t in [*model.encoder.towers, *model.decoder.towers]:
        t.assert_finite = args.nan_check
    policy = None
    if args.auto_wrap == "towers":
        policy = ModuleWrapPolicy({EncoderTower, DecoderTower})
    elif args.auto_wrap == "linear":
        policy = functools.partial(
            lambda_auto_wrap_policy,
            lambda_fn=lambda m: type(m) in (nn.Linear, nn.Embedding, nn.MultiheadAttention),
        )
    bwd = None if args.backward_prefetch == "NONE" else BackwardPrefetch[args.backward_prefetch]

    def wrap(model: nn.Module) -> nn.Module:  # the script's own wrap (--paste may replace it)
        model = FSDP(
            model,
            auto_wrap_policy=policy,
            backward_prefetch=bwd,
            forward_prefetch=args.forward_prefetch,
            limit_all_gathers=not args.no_limit_all_gathers,
            device_id=device(),
            use_orig_params=True,
        )
        return model

    model = wrap_or_paste(model, args.paste, wrap)
    if args.checkpoint_towers:
        apply_activation_checkpointing(
            model, check_fn=lambda m: isinstance(m, (EncoderTower, DecoderTower))
        )
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    budget = ActivationBudget(model, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        faults.before_step(step)
        src, dec_in, tgt = (
            t.to(device()) for t in copy_task(args.batch, args.seq, args.vocab, gen)
        )
        with budget.track():
            loss = F.cross_entropy(model(src, dec_in).flatten(0, 1), tgt.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        log.step_done(step, loss.detach())
    log.summary(budget)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
