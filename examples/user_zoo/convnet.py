"""A small residual ConvNet for 32x32 images: `backbone.stem`, `backbone.stages[i]` (ConvUnit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from trainkit import nan_check


class ConvUnit(nn.Module):
    """Two 3x3 convolutions with GroupNorm and a residual connection."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(8, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(8, channels)
        self.debug_checks = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        out = F.relu(x + y)
        if self.debug_checks:
            nan_check(out)
        return out


class Backbone(nn.Module):
    """Stem convolution and a stack of ConvUnits."""

    def __init__(self, channels: int, depth: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.stages = nn.ModuleList(ConvUnit(channels) for _ in range(depth))
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for unit in self.stages:
            if self.grad_checkpointing and x.requires_grad:
                x = checkpoint(unit, x, use_reentrant=False)
            else:
                x = unit(x)
        return x


class ConvNet(nn.Module):
    """Backbone, global average pooling and a linear classifier."""

    def __init__(self, channels: int = 64, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.backbone = Backbone(channels, depth)
        self.classifier = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        feats = self.backbone(images)
        return self.classifier(feats.mean(dim=(2, 3)))


def random_images(
    batch: int, size: int, gen: torch.Generator, classes: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch of images and labels."""
    return torch.randn(batch, 3, size, size, generator=gen), torch.randint(
        0, classes, (batch,), generator=gen
    )
