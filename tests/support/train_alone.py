"""A script that never initializes a process group: launched on N processes, each trains its own
copy (what an Accelerate script does when launched without a distributed configuration).

    python -m zdiag run --nproc-per-node 2 --out DIR tests/support/train_alone.py
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Linear -> GELU -> Linear with a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    """Three blocks and a head."""

    def __init__(self, width: int = 64, classes: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    """Six steps of AdamW on random data."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _step in range(6):
        x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("trained", flush=True)


if __name__ == "__main__":
    main()
