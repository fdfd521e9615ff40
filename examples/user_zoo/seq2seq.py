"""An encoder-decoder transformer: `encoder.towers[i]` (EncoderTower), `decoder.towers[i]`
(DecoderTower, with cross-attention), shared token embedding and an output projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from trainkit import nan_check


class EncoderTower(nn.Module):
    """Post-norm self-attention and feed-forward."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln1 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln2 = nn.LayerNorm(dim)
        self.assert_finite = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x, x, x, need_weights=False)[0])
        x = self.ln2(x + self.ff(x))
        if self.assert_finite:
            nan_check(x)
        return x


class DecoderTower(nn.Module):
    """Causal self-attention, cross-attention to the memory, feed-forward."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln1 = nn.LayerNorm(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln3 = nn.LayerNorm(dim)
        self.assert_finite = False

    def forward(self, y: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        n = y.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=y.device), diagonal=1)
        y = self.ln1(y + self.self_attn(y, y, y, attn_mask=mask, need_weights=False)[0])
        y = self.ln2(y + self.cross_attn(y, memory, memory, need_weights=False)[0])
        y = self.ln3(y + self.ff(y))
        if self.assert_finite:
            nan_check(y)
        return y


class Encoder(nn.Module):
    """The encoder towers."""

    def __init__(self, dim: int, heads: int, depth: int) -> None:
        super().__init__()
        self.towers = nn.ModuleList(EncoderTower(dim, heads) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for tower in self.towers:
            x = tower(x)
        return x


class Decoder(nn.Module):
    """The decoder towers."""

    def __init__(self, dim: int, heads: int, depth: int) -> None:
        super().__init__()
        self.towers = nn.ModuleList(DecoderTower(dim, heads) for _ in range(depth))

    def forward(self, y: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        for tower in self.towers:
            y = tower(y, memory)
        return y


class Seq2Seq(nn.Module):
    """Token embedding (shared), encoder, decoder, output projection."""

    def __init__(self, vocab: int = 2000, dim: int = 128, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = Encoder(dim, heads, depth)
        self.decoder = Decoder(dim, heads, depth)
        self.proj = nn.Linear(dim, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(self.embed(src))
        return self.proj(self.decoder(self.embed(tgt), memory))


def copy_task(
    batch: int, length: int, vocab: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source, decoder input and target for a reversed-copy task."""
    src = torch.randint(1, vocab, (batch, length), generator=gen)
    tgt = src.flip(1)
    dec_in = F.pad(tgt[:, :-1], (1, 0))
    return src, dec_in, tgt
