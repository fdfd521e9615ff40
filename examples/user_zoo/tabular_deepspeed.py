"""Train the tabular ResNet with DeepSpeed ZeRO-3 (on CPU: `DS_ACCELERATOR=cpu`, gloo).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 tabular_deepspeed.py
        [--prefetch-bucket 0] [--no-overlap-comm] [--activation-checkpointing] [--nan-check]

Needs `pip install deepspeed` (no compiled op is used; the optimizer is torch's AdamW).
"""

from __future__ import annotations

import argparse
import os

import deepspeed  # type: ignore[import-not-found, unused-ignore]
import torch
import torch.nn.functional as F
from tabular import TabularResNet, random_rows
from trainkit import ActivationBudget, Faults, StepLog, add_common_args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--prefetch-bucket", type=int, default=500_000, help="stage3_prefetch_bucket_size"
    )
    p.add_argument("--no-overlap-comm", action="store_true")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    add_common_args(p, batch=256)
    args = p.parse_args()

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(args.seed)
    model = TabularResNet(args.features, args.width, args.hidden, args.depth)
    for stage in model.encoder.stages:
        stage.check_finite = args.nan_check
    if args.activation_checkpointing:
        for stage in model.encoder.stages:
            inner = stage.forward
            stage.forward = (  # type: ignore[method-assign]
                lambda x, _f=inner: deepspeed.checkpointing.checkpoint(_f, x)
            )
        deepspeed.checkpointing.configure(None, partition_activations=False)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": not args.no_overlap_comm,
            "stage3_prefetch_bucket_size": args.prefetch_bucket,
            "stage3_param_persistence_threshold": 10_000,
            "reduce_bucket_size": 500_000,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    budget = ActivationBudget(engine.module, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(31 + rank)

    for step in range(args.steps):
        faults.before_step(step)
        x, y = random_rows(args.batch, args.features, gen)
        with budget.track():
            loss = F.cross_entropy(engine(x.to(engine.device)), y.to(engine.device))
            engine.backward(loss)
        engine.step()
        log.step_done(step, loss.detach())
    log.summary(budget)


if __name__ == "__main__":
    main()
