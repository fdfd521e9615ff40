"""A custom training loop that marks its own steps with the `zdiag.profile` API.

    python examples/custom_loop.py --out runs/custom --steps 6

Use this when steps are not one `optimizer.step()` each (no optimizer, several per step, or you
want to cut steps yourself). It writes the same run directory as `zdiag run`; under `zdiag run`
the handle drives `zdiag run`'s session instead and the options below are ignored.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import zdiag


def main() -> None:
    """Train a small MLP with hand-written SGD (no torch.optim) and mark steps explicitly."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=None, help="run directory (default: ./zdiag_runs/profile-<timestamp>)"
    )
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    with zdiag.profile(out=args.out, wait=1, warmup=1, active=2) as prof:
        for _ in range(args.steps):
            x = torch.randn(16, 64)
            loss = (model(x) - x.mean(dim=1, keepdim=True)).pow(2).mean()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(0.01 * p.grad)
                        p.grad = None
            prof.step()
    print(f"wrote {prof.run_dir} ({prof.step_num} steps)")


if __name__ == "__main__":
    main()
