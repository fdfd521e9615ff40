"""A small GPT cut into pipeline stages, one per rank (pure pipeline parallelism, no FSDP):
`torch.distributed.pipelining` PipelineStage + Schedule1F1B (or ScheduleGPipe), the blocks
split across the stages as `--split` says.

torchrun --standalone --nproc-per-node 2 examples/mesh/pipeline_gpt.py
zdiag run --nproc-per-node 2 examples/mesh/pipeline_gpt.py --split 6,2 [--microbatches 8]
zdiag run --nproc-per-node 4 examples/mesh/pipeline_gpt.py --split 3,1,1,1 --schedule gpipe

`--split A,B,...` gives each stage's number of transformer blocks (one entry per rank); stage 0
also runs the token embedding, the last stage the final norm, the LM head and the loss.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

VOCAB = 512


class GPT(nn.Module):
    """Token embedding -> pre-norm transformer blocks -> norm -> LM head; the parts a stage does
    not run are None (its forward skips them)."""

    def __init__(self, layers: int, width: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.tok: nn.Embedding | None = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleDict(
            {
                str(i): nn.TransformerEncoderLayer(
                    width, heads, 4 * width, batch_first=True, norm_first=True
                )
                for i in range(layers)
            }
        )
        self.norm: nn.LayerNorm | None = nn.LayerNorm(width)
        self.lm_head: nn.Linear | None = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) if self.tok is not None else x
        for block in self.blocks.values():
            h = block(h)
        if self.norm is None or self.lm_head is None:
            return h
        return self.lm_head(self.norm(h))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", default="4,4", help="blocks per stage, one entry per rank")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    split = [int(n) for n in args.split.split(",")]
    if len(split) != world:
        raise SystemExit(f"--split gives {len(split)} stages for {world} ranks")
    torch.manual_seed(0)
    model = GPT(layers=sum(split))
    first = sum(split[:rank])
    for key in list(model.blocks.keys()):  # keep this stage's blocks only
        if not first <= int(key) < first + split[rank]:
            del model.blocks[key]
    if rank != 0:
        model.tok = None
    if rank != world - 1:
        model.norm, model.lm_head = None, None
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = cls(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (16, 64), generator=gen)
        target = torch.randint(0, VOCAB, (16, 64), generator=gen)
        if rank == 0:
            schedule.step(tokens)
        elif rank == world - 1:
            losses: list[torch.Tensor] = []
            schedule.step(target=target, losses=losses)
            print(f"step {step} loss {torch.stack(losses).mean().item():.4f}", flush=True)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
