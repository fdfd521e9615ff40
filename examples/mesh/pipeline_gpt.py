"""A small GPT cut into pipeline stages (pure pipeline parallelism, no FSDP):
`torch.distributed.pipelining` PipelineStage + Schedule1F1B (or ScheduleGPipe), one stage per
rank, or ScheduleInterleaved1F1B (`interleaved`; `bfs`: ScheduleLoopedBFS; `zb`:
ScheduleInterleavedZeroBubble), a loop of stages per rank (stage s on rank s % world), or
ScheduleZBVZeroBubble (`zbv`), two stages per rank in a V (rank r runs stages r and
2 world - 1 - r), the blocks split across the stages as `--split` says.

torchrun --standalone --nproc-per-node 2 examples/mesh/pipeline_gpt.py
zdiag run --nproc-per-node 2 examples/mesh/pipeline_gpt.py --split 6,2 [--microbatches 8]
zdiag run --nproc-per-node 4 examples/mesh/pipeline_gpt.py --split 3,1,1,1 --schedule gpipe
zdiag run --nproc-per-node 2 examples/mesh/pipeline_gpt.py --split 2,2,2,2 --schedule interleaved

`--split A,B,...` gives each stage's number of transformer blocks (one entry per stage: as many
as ranks, or a multiple of them for the schedules of several stages per rank, twice as many for
zbv); stage 0 also runs the token embedding, the last stage the final norm, the LM head and the
loss.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

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


MULTI_STAGE: dict[str, Any] = {
    "interleaved": ScheduleInterleaved1F1B,
    "bfs": ScheduleLoopedBFS,
    "zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
"""The schedules that run several stages per rank."""


def stage_indices(schedule: str, rank: int, world: int, n_stages: int) -> list[int]:
    """The stages `rank` runs: a loop (stage s on rank s % world), or for zbv a V (rank r runs
    stages r and 2 world - 1 - r)."""
    if schedule == "zbv":
        return [rank, 2 * world - 1 - rank]
    return list(range(rank, n_stages, world))


def stage_model(split: list[int], index: int) -> GPT:
    """Stage `index`'s part of the GPT: its blocks, the embedding on the first stage, the norm
    and head on the last."""
    model = GPT(layers=sum(split))
    first = sum(split[:index])
    for key in list(model.blocks.keys()):  # keep this stage's blocks only
        if not first <= int(key) < first + split[index]:
            del model.blocks[key]
    if index != 0:
        model.tok = None
    if index != len(split) - 1:
        model.norm, model.lm_head = None, None
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--split", default="4,4", help="blocks per stage, one entry per stage (module docstring)"
    )
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--schedule", choices=("1f1b", "gpipe", *MULTI_STAGE), default="1f1b")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    split = [int(n) for n in args.split.split(",")]
    looped = args.schedule in MULTI_STAGE
    if len(split) != world and not (looped and len(split) % world == 0):
        raise SystemExit(
            f"--split gives {len(split)} stages for {world} ranks (one per rank"
            + (", or a multiple of them)" if looped else ")")
        )
    if args.schedule == "zbv" and len(split) != 2 * world:
        raise SystemExit(f"zbv runs 2 stages per rank: --split needs {2 * world} entries")
    torch.manual_seed(0)
    stages: list[Any] = []  # torch types the list by its private stage base class
    params: list[nn.Parameter] = []
    for index in stage_indices(args.schedule, rank, world, len(split)):
        model = stage_model(split, index)
        params += list(model.parameters())
        stages.append(PipelineStage(model, index, len(split), torch.device("cpu")))
    schedule: Any
    if looped:
        schedule = MULTI_STAGE[args.schedule](
            stages, n_microbatches=args.microbatches, loss_fn=loss_fn
        )
    else:
        stage = stages[0]
        cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
        schedule = cls(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    last = next(
        r
        for r in range(world)
        if len(split) - 1 in stage_indices(args.schedule, r, world, len(split))
    )

    opt = torch.optim.SGD(params, lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (16, 64), generator=gen)
        target = torch.randint(0, VOCAB, (16, 64), generator=gen)
        inputs = (tokens,) if rank == 0 else ()  # the first stage's rank feeds the batch
        if rank == last:  # the last stage's rank takes the targets (zbv: rank 0 runs both)
            losses: list[torch.Tensor] = []
            schedule.step(*inputs, target=target, losses=losses)
            print(f"step {step} loss {torch.stack(losses).mean().item():.4f}", flush=True)
        else:
            schedule.step(*inputs)
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
