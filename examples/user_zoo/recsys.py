"""An embedding-heavy recommender: sparse features in `features.tables[i]` (EmbeddingBag),
dense features through `bottom`, interaction through `interaction.towers[i]` (CrossUnit)."""

from __future__ import annotations

import torch
from torch import nn
from trainkit import nan_check


class SparseFeatures(nn.Module):
    """One EmbeddingBag per categorical feature (mean pooling over a bag)."""

    def __init__(self, cardinalities: list[int], dim: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="mean") for n in cardinalities)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [batch, n_features, bag]
        return torch.cat([t(ids[:, i]) for i, t in enumerate(self.tables)], dim=-1)


class CrossUnit(nn.Module):
    """DCN-style cross layer plus an MLP with a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.cross = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width)
        )
        self.norm = nn.LayerNorm(width)
        self.validate = False

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x0 * self.cross(x) + x + self.mlp(x))
        if self.validate:
            nan_check(y)
        return y


class Interaction(nn.Module):
    """The cross towers."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.towers = nn.ModuleList(CrossUnit(width) for _ in range(depth))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for tower in self.towers:
            x = tower(x0, x)
        return x


class Recommender(nn.Module):
    """Embeddings + dense bottom MLP -> interaction towers -> click logit."""

    def __init__(
        self,
        n_sparse: int = 6,
        cardinality: int = 20000,
        emb_dim: int = 32,
        n_dense: int = 13,
        depth: int = 3,
    ) -> None:
        super().__init__()
        self.features = SparseFeatures([cardinality] * n_sparse, emb_dim)
        self.bottom = nn.Sequential(nn.Linear(n_dense, emb_dim), nn.ReLU())
        width = emb_dim * (n_sparse + 1)
        self.interaction = Interaction(width, depth)
        self.top = nn.Linear(width, 1)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([self.bottom(dense), self.features(ids)], dim=-1)
        return self.top(self.interaction(x0)).squeeze(-1)


def click_batch(
    batch: int, n_sparse: int, cardinality: int, gen: torch.Generator, bag: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense features, sparse id bags and click labels."""
    dense = torch.randn(batch, 13, generator=gen)
    ids = torch.randint(0, cardinality, (batch, n_sparse, bag), generator=gen)
    return dense, ids, (dense[:, 0] > 0).float()
