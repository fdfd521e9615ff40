"""A small decoder-only transformer whose module names follow torchtitan's Llama.

FSDP2 labels its profiler ranges with module fqns, so the names here are what a trace shows:
`tok_embeddings`, `layers.0` ... `layers.N-1` (each with `attention`, `feed_forward`,
`attention_norm`, `ffn_norm`), `norm`, `output`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class ModelArgs:
    """Shape of the transformer."""

    layers: int
    dim: int
    heads: int
    vocab: int
    seq: int

    @property
    def ffn_hidden(self) -> int:
        """SwiGLU hidden width: 8/3 * dim rounded up to a multiple of 64, as in Llama."""
        hidden = int(8 * self.dim / 3)
        return 64 * ((hidden + 63) // 64)


class Attention(nn.Module):
    """Causal multi-head self-attention (`wq`, `wk`, `wv`, `wo`)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.heads = args.heads
        self.head_dim = args.dim // args.heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, dim) -> (batch, seq, dim)."""
        batch, seq, dim = x.shape
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, dim))


class FeedForward(nn.Module):
    """SwiGLU feed-forward (`w1`, `w2`, `w3`)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, dim) -> (batch, seq, dim)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + feed_forward(norm(.)).

    With `checkpointed` set, the block's activations are recomputed in backward
    (`torch.utils.checkpoint`, non-reentrant): only the block input is kept.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.checkpointed = False

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, dim) -> (batch, seq, dim)."""
        if self.checkpointed and torch.is_grad_enabled():
            out = checkpoint(self._block, x, use_reentrant=False)
            assert isinstance(out, torch.Tensor)
            return out
        return self._block(x)


class Transformer(nn.Module):
    """Token embedding, `layers` blocks, final norm and output projection to the vocabulary."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.output = nn.Linear(args.dim, args.vocab, bias=False)
        self.reset_parameters()

    def blocks(self) -> list[TransformerBlock]:
        """The transformer blocks, typed."""
        return [cast(TransformerBlock, block) for block in self.layers]

    def reset_parameters(self) -> None:
        """Small normal init (std 0.02, output layers scaled by depth) so the loss starts sane."""
        for name, param in self.named_parameters():
            if param.dim() < 2:
                nn.init.ones_(param)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(param, std=0.02 / (2 * self.args.layers) ** 0.5)
            else:
                nn.init.normal_(param, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, seq) token ids -> (batch, seq, vocab) logits."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def synthetic_batch(
    batch: int, seq: int, vocab: int, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable synthetic sequences: each row counts up from a random start by a random stride.

    Returns (inputs, labels), both (batch, seq) int64, labels shifted by one position.
    """
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 8, (batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]
