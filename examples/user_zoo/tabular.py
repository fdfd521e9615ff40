"""Tabular models: a ResNet for tabular data (`encoder.stages[i]`, ResidualMLP) and a gated MLP
trunk (`trunk.cells[i]`, GatedCell)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from trainkit import nan_check


class ResidualMLP(nn.Module):
    """LayerNorm -> Linear -> ReLU -> Dropout -> Linear, added back to the input."""

    def __init__(self, width: int, hidden: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.dropout = nn.Dropout(dropout)
        self.check_finite = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + self.down(self.dropout(F.relu(self.up(self.norm(x)))))
        if self.check_finite:
            nan_check(out)
        return out


class Encoder(nn.Module):
    """Feature projection and the residual stages."""

    def __init__(self, features: int, width: int, hidden: int, depth: int) -> None:
        super().__init__()
        self.project = nn.Linear(features, width)
        self.stages = nn.ModuleList(ResidualMLP(width, hidden) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.project(x)
        for stage in self.stages:
            x = stage(x)
        return x


class TabularResNet(nn.Module):
    """Encoder plus a regression/classification head."""

    def __init__(
        self, features: int = 64, width: int = 256, hidden: int = 1024, depth: int = 4, out: int = 2
    ) -> None:
        super().__init__()
        self.encoder = Encoder(features, width, hidden, depth)
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


class GatedCell(nn.Module):
    """A gated linear unit with a skip connection (SwiGLU style)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.value = nn.Linear(width, hidden, bias=False)
        self.out = nn.Linear(hidden, width, bias=False)
        self.sanity = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        y = x + self.out(F.silu(self.gate(h)) * self.value(h))
        if self.sanity:
            nan_check(y)
        return y


class Trunk(nn.Module):
    """The cells, applied in order."""

    def __init__(self, width: int, hidden: int, depth: int) -> None:
        super().__init__()
        self.cells = nn.ModuleList(GatedCell(width, hidden) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for cell in self.cells:
            x = cell(x)
        return x


class MLPTrunkNet(nn.Module):
    """Input projection, trunk, output projection."""

    def __init__(self, features: int = 48, width: int = 192, hidden: int = 768, depth: int = 6):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.trunk = Trunk(width, hidden, depth)
        self.readout = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.readout(self.trunk(self.inp(x))).squeeze(-1)


def random_rows(
    batch: int, features: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch of feature rows and binary labels."""
    x = torch.randn(batch, features, generator=gen)
    return x, (x[:, 0] > 0).long()
