"""`no-communication`: a multi-process launch whose ranks never exchanged a collective.

A script launched on N processes (torchrun, `zdiag run --nproc-per-node N`, an Accelerate script
started without a distributed configuration) that never initializes a process group, or never
shards or replicates its model over one, trains N separate copies: nothing averages their
gradients, so the processes cost N times the hardware for one model's progress each. Found from
the launch (the manifest's world size, else the number of rank traces) against what every rank
did: no collective in any step and no process group in any trace header.
"""

from __future__ import annotations

import dataclasses

from ..frameworks import fsdp2
from ..report import Finding
from .context import DetectorContext
from .rule import Rule


def _ranks_launched(ctx: DetectorContext) -> int:
    """Processes the run started: the manifest's world size, else the ranks analyzed."""
    world = ctx.manifest.world_size if ctx.manifest is not None else None
    return max(world or 0, len(ctx.breakdowns))


def _never_communicated(ctx: DetectorContext) -> bool:
    """No analyzed rank spent any time in a collective or declared a process group beyond
    itself."""
    for rank, steps in ctx.breakdowns.items():
        if any(s.comm_ms > 0 for s in steps):
            return False
        # (a trace's world size is the launch's, even when no group was made: not evidence)
        facts = ctx.facts.get(rank)
        if facts is not None and any((g.size or 1) > 1 for g in facts.process_groups):
            return False
    return True


def _code(ctx: DetectorContext) -> str:
    """A process group, then FSDP2 over it: the blocks the captured model names, else the root."""
    facts = dataclasses.replace(
        ctx.sheet.run_facts(), framework=fsdp2.NAME, blocks_are_units=False, mesh=None
    )
    remedy = fsdp2.wrap_blocks(facts)
    wrap = (
        remedy.code
        if remedy is not None and remedy.code
        else ("from torch.distributed.fsdp import fully_shard\nfully_shard(model)")
    )
    return (
        "import torch.distributed as dist\n"
        "# the launcher (torchrun, zdiag run) sets the rank and the rendezvous in the environment;\n"
        "# with no backend named, gloo runs the CPU tensors and NCCL the CUDA ones\n"
        "dist.init_process_group()\n" + wrap
    )


def detect(ctx: DetectorContext) -> list[Finding]:
    """The no-communication finding, or none."""
    launched = _ranks_launched(ctx)
    steps = {r: s for r, s in ctx.breakdowns.items() if s}
    if launched < 2 or not steps or not _never_communicated(ctx):
        return []
    ranks = sorted(steps)
    per_step = sorted(b.duration_ms for r in ranks for b in steps[r])
    return [
        Finding(
            id="no-communication",
            severity="critical",
            title=(
                f"{launched} processes were launched and none exchanged a collective: each "
                "trained its own copy of the model"
            ),
            ranks=ranks,
            steps=sorted({b.step for r in ranks for b in steps[r]}),
            evidence={
                "processes_launched": launched,
                "ranks_analyzed": len(ranks),
                "collectives": 0,
                "process_groups_declared": 0,
                "median_step_ms": round(per_step[len(per_step) // 2], 3),
            },
            recommendation=(
                "Initialize a process group in the script and shard (or replicate) the model "
                "over it, so the processes train one model on N shards of the data. With "
                "Hugging Face Accelerate, launch with a distributed configuration "
                f"(`accelerate launch --multi_gpu --num_processes {launched} train.py`, or "
                "`accelerate config`) and pass the model through `accelerator.prepare`."
            ),
            code=_code(ctx),
            gain_method=(
                "no time gain is claimed: today each process makes one model's progress; with a "
                "process group they make one model's progress together, on N shards of the data"
            ),
        )
    ]


RULE = Rule(
    id="no-communication",
    summary="a multi-process launch whose ranks never exchange a collective",
    detect=detect,
    what=(
        "Two or more processes were launched (the manifest's world size, else the rank traces) "
        "and no rank spent any time in a collective or declared a process group beyond itself."
    ),
    why=(
        "Each process trains its own copy of the model: no gradient is averaged, so N "
        "processes cost N times the hardware for one model's progress each. Typical causes: "
        "an Accelerate script launched without a distributed configuration, a script that never "
        "calls init_process_group or never wraps its model."
    ),
    example="2 processes were launched and none exchanged a collective.",
    fix="`dist.init_process_group()` and FSDP2 over the model's blocks (or Accelerate's "
    "`--multi_gpu` launch).",
    gain="None claimed: it is a correctness finding (one model trained instead of N copies).",
    scope="runs of two or more processes",
    fsdp_only=False,
    thresholds=(),
    markers=None,
)
