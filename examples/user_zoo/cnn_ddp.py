"""Train the residual ConvNet with DistributedDataParallel and gradient accumulation.

torchrun --standalone --nproc-per-node 2 cnn_ddp.py [--accum 2] [--grad-ckpt] [--nan-check]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
from convnet import ConvNet, ConvUnit, random_images
from torch.nn.parallel import DistributedDataParallel as DDP
from trainkit import ActivationBudget, Faults, StepLog, add_common_args, device, init_distributed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--grad-ckpt", action="store_true", help="recompute ConvUnits in backward")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--channels", type=int, default=48)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--image-size", type=int, default=16)
    add_common_args(p, batch=8)
    args = p.parse_args()

    rank, _ = init_distributed(timeout_s=args.pg_timeout_s)
    torch.manual_seed(args.seed)
    net = ConvNet(args.channels, args.depth).to(device())
    net.backbone.grad_checkpointing = args.grad_ckpt
    for m in net.modules():
        if isinstance(m, ConvUnit):
            m.debug_checks = args.nan_check
    model = DDP(net, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    budget = ActivationBudget(model, int(args.mem_budget_mib * 2**20))
    faults, log = Faults(args, rank), StepLog(rank)
    gen = torch.Generator().manual_seed(rank)

    for step in range(args.steps):
        faults.before_step(step)
        total = torch.zeros(())
        for micro in range(args.accum):
            images, labels = random_images(args.batch, args.image_size, gen)
            sync = micro == args.accum - 1
            with budget.track(), contextlib.nullcontext() if sync else model.no_sync():
                loss = F.cross_entropy(model(images.to(device())), labels.to(device()))
                (loss / args.accum).backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.step_done(step, total / args.accum)
    log.summary(budget)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
