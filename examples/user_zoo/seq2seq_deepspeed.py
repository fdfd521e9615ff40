"""Train the encoder-decoder with DeepSpeed ZeRO-3 from a JSON-like config built in code.

DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 seq2seq_deepspeed.py
    [--no-prefetch] [--max-live-params N] [--nan-check]
"""

from __future__ import annotations

import argparse
import os

import deepspeed  # type: ignore[import-not-found, unused-ignore]
import torch
import torch.nn.functional as F
from seq2seq import Seq2Seq, copy_task
from trainkit import ActivationBudget, Faults, StepLog, add_common_args


def ds_config(args: argparse.Namespace) -> dict[str, object]:
    """ZeRO-3 with small buckets (the model is small); --no-prefetch turns prefetching off."""
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 0 if args.no_prefetch else 300_000,
            "stage3_max_live_parameters": args.max_live_params,
            "stage3_param_persistence_threshold": 5_000,
            "reduce_bucket_size": 400_000,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-prefetch", action="store_true")
    p.add_argument("--max-live-params", type=int, default=10**9)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    add_common_args(p, batch=16)
    args = p.parse_args()

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(args.seed)
    model = Seq2Seq(args.vocab, args.dim, 4, args.depth)
    for t in [*model.encoder.towers, *model.decoder.towers]:
        t.assert_finite = args.nan_check
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(args))
    budget = ActivationBudget(engine.module, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        faults.before_step(step)
        src, dec_in, tgt = (
            t.to(engine.device) for t in copy_task(args.batch, args.seq, args.vocab, gen)
        )
        with budget.track():
            loss = F.cross_entropy(engine(src, dec_in).flatten(0, 1), tgt.flatten())
            engine.backward(loss)
        engine.step()
        log.step_done(step, loss.detach())
    log.summary(budget)


if __name__ == "__main__":
    main()
