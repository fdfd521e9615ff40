"""A Hugging Face ViT (tiny config) with FSDP2 on each encoder layer, then the root, and the
prefetch lists set by hand (needs `transformers`):

- `--lists explicit`: the recipe of PyTorch's FSDP2 docs, each layer prefetching its neighbour;
- `--lists self`: the off-by-one that names the layer itself, which turns prefetching off;
- `--lists none`: FSDP2's defaults.

torchrun --standalone --nproc-per-node 2 examples/library/vit_prefetch_lists.py --lists self
zdiag run --nproc-per-node 2 examples/library/vit_prefetch_lists.py --lists explicit
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import ViTConfig, ViTForImageClassification


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lists", choices=("explicit", "self", "none"), default="explicit")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = ViTConfig(
        image_size=64,
        patch_size=8,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_labels=10,
    )
    torch.manual_seed(0)
    model = ViTForImageClassification(cfg)
    blocks = model.vit.layers
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    n = len(blocks)
    if args.lists == "explicit":
        for i in range(n - 1):
            blocks[i].set_modules_to_forward_prefetch([blocks[i + 1]])
        for i in range(1, n):
            blocks[i].set_modules_to_backward_prefetch([blocks[i - 1]])
    elif args.lists == "self":
        for i in range(n):
            blocks[i].set_modules_to_forward_prefetch([blocks[i]])
            blocks[i].set_modules_to_backward_prefetch([blocks[i]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        images = torch.randn(args.batch, 3, 64, 64, generator=g)
        labels = torch.randint(0, 10, (args.batch,), generator=g)
        out = model(pixel_values=images, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print("step", step, f"{out.loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
