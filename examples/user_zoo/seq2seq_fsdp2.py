"""Train the encoder-decoder (`encoder.towers`, `decoder.towers`) with FSDP2 on a copy task.

torchrun --standalone --nproc-per-node 2 seq2seq_fsdp2.py [--fsdp-wrap towers|root|leaf]
    [--prefetch chain|off] [--checkpoint] [--nan-check] [--seq 32] [--grad-accum 1]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from seq2seq import DecoderTower, EncoderTower, Seq2Seq, copy_task
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fsdp-wrap", choices=("towers", "root", "leaf"), default="towers")
    p.add_argument("--prefetch", choices=("chain", "off"), default="chain")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing per tower")
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add_common_args(p, batch=16)
    add_fsdp2_args(p)
    args = p.parse_args()

    rank, _ = init_distributed(timeout_s=args.pg_timeout_s)
    torch.manual_seed(args.seed)
    model = Seq2Seq(args.vocab, args.dim, 4, args.depth).to(device())
    towers = [*model.encoder.towers, *model.decoder.towers]
    for t in towers:
        t.assert_finite = args.nan_check
    if args.checkpoint:
        apply_activation_checkpointing(
            model, check_fn=lambda m: isinstance(m, (EncoderTower, DecoderTower))
        )

    def wrap(model: nn.Module) -> nn.Module:  # the script's own wrap (--paste may replace it)
        mesh = fsdp_mesh(args)
        if args.fsdp_wrap == "towers":
            for t in towers:
                fully_shard(t, reshard_after_forward=True, mesh=mesh)
        elif args.fsdp_wrap == "leaf":
            # every layer with weights (MultiheadAttention reads its out_proj weight directly, so
            # the attention module is one unit and its out_proj is left inside it)
            for m in list(model.modules()):
                if type(m) in (nn.Linear, nn.Embedding, nn.LayerNorm, nn.MultiheadAttention):
                    fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        units = [t for t in towers if isinstance(t, FSDPModule)]
        if args.prefetch == "chain":
            for a, b in itertools.pairwise(units):
                a.set_modules_to_forward_prefetch([b])
                b.set_modules_to_backward_prefetch([a])
        else:
            for u in units:
                u.set_modules_to_forward_prefetch([u])
                u.set_modules_to_backward_prefetch([u])

        set_unshard_async(model, args.unshard_async)
        return model

    model = wrap_or_paste(model, args.paste, wrap)

    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    budget = ActivationBudget(model, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        faults.before_step(step)
        for micro in range(args.grad_accum):  # the last micro-batch reduces the gradients
            if args.grad_accum > 1:
                model.set_requires_gradient_sync(micro == args.grad_accum - 1)
            src, dec_in, tgt = (
                t.to(device()) for t in copy_task(args.batch, args.seq, args.vocab, gen)
            )
            with budget.track():
                logits = model(src, dec_in)
                loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), label_smoothing=0.1)
                loss.backward()
        opt.step()
        opt.zero_grad()
        log.step_done(step, loss.detach())
    log.summary(budget)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
