"""A mixture-of-experts sequence model: `body.mixers[i]` (MoEMixer), each with a top-1 router
over `experts[j]` (Expert) and a token-mixing attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from trainkit import checks_on_device, nan_check


class Expert(nn.Module):
    """One feed-forward expert."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, hidden)
        self.w_out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.gelu(self.w_in(x)))


class MoEMixer(nn.Module):
    """Self-attention then a top-1 routed mixture of experts (dense compute, masked combine)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, heads: int = 4) -> None:
        super().__init__()
        self.norm_a = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm_m = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(n_experts))
        self.log_balance = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_a(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        h = self.norm_m(x)
        probs = self.router(h).softmax(-1)
        top = probs.argmax(-1)
        out = torch.zeros_like(h)
        for j, expert in enumerate(self.experts):
            mask = (top == j).unsqueeze(-1).to(h.dtype)
            out = out + mask * probs[..., j : j + 1] * expert(h)
        if self.log_balance:  # "how balanced is the routing?" debugging, one sync per mixer
            nan_check(out)
            load = (top == 0).float().mean().detach()
            self.last_load = load if checks_on_device() else float(load.item())
        return x + out


class Body(nn.Module):
    """The mixers."""

    def __init__(self, dim: int, hidden: int, n_experts: int, depth: int) -> None:
        super().__init__()
        self.mixers = nn.ModuleList(MoEMixer(dim, hidden, n_experts) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mixer in self.mixers:
            x = mixer(x)
        return x


class MoEModel(nn.Module):
    """Token embedding, MoE body, tied-free output head."""

    def __init__(
        self,
        vocab: int = 1000,
        dim: int = 96,
        hidden: int = 256,
        n_experts: int = 4,
        depth: int = 3,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.body = Body(dim, hidden, n_experts, depth)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.body(self.tok(tokens))))


def token_batch(batch: int, seq: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Random tokens, one more than the sequence for next-token targets."""
    return torch.randint(0, vocab, (batch, seq + 1), generator=gen)
