"""A small DeepSpeed ZeRO training script, written as a user would: its own loop, no zdiag.

It trains a 4-block pre-norm transformer on synthetic tokens with DeepSpeed ZeRO (stage 3 by
default, `--stage 2` for ZeRO-2) and is used to record the DeepSpeed traces zdiag is tested
on (docs/fsdp-patterns.md, "DeepSpeed ZeRO"). On a CPU-only machine:

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 examples/deepspeed_train.py
    DS_ACCELERATOR=cpu zdiag run --nproc-per-node 2 --record-shapes \\
        examples/deepspeed_train.py --stage 3

Needs `pip install deepspeed` (DS_BUILD_OPS=0 is enough: no compiled op is used; the optimizer
is torch's AdamW). On CPU DeepSpeed's accelerator talks gloo; on GPUs it uses NCCL.
"""

from __future__ import annotations

import argparse
import os

import deepspeed  # type: ignore[import-not-found, unused-ignore]
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim, bias=False)
        self.fc2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))


class TinyLM(nn.Module):
    """Token embedding, `layers` blocks, final norm and output head."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=3, choices=(1, 2, 3), help="ZeRO stage")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    args = p.parse_args()

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.heads, args.layers)
    zero: dict[str, object] = {"stage": args.stage}
    if args.stage == 3:
        # small buckets so that a 4-block model is fetched and reduced in several pieces
        zero.update(
            stage3_prefetch_bucket_size=200_000,
            stage3_param_persistence_threshold=10_000,
            reduce_bucket_size=500_000,
        )
    else:
        zero.update(reduce_bucket_size=500_000, allgather_bucket_size=500_000)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        logits = engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step} | loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
