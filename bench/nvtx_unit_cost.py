"""Host time the per-FSDP-unit NVTX ranges add to a training step (measured on CPU).

The ranges' hooks run on the host, so their cost can be measured without a GPU: the harness's
FSDP2 model (world size 1, gloo) trains with and without `UnitRanges` attached, the NVTX calls
replaced by no-ops (as they are when no tool listens), alternating rounds, median of each.

    .venv/bin/python bench/nvtx_unit_cost.py [--layers 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from zdiag.collectors.nvtx import UnitRanges
from zdiag.harness.config import HarnessConfig
from zdiag.harness.train import build, synthetic_batch


def seconds_per_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    cfg: HarnessConfig,
    ranges: UnitRanges | None,
    steps: int,
) -> float:
    """Mean wall time of `steps` training steps."""
    generator = torch.Generator().manual_seed(0)
    inputs, labels = synthetic_batch(cfg.batch, cfg.seq, cfg.vocab, generator, torch.device("cpu"))
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model(inputs)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ranges is not None:
            ranges.step_end()
    return (time.perf_counter() - t0) / steps


def main() -> int:
    """Print bare and hooked step times and the difference per step and per unit."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Pretend a GPU and an NVTX tool are there; the NVTX calls themselves do nothing.
    os.environ["NVTX_INJECTION64_PATH"] = "/nsight/libToolsInjection64.so"
    torch.cuda.is_available = lambda: True
    torch.cuda.nvtx.range_start = lambda msg: 0
    torch.cuda.nvtx.range_end = lambda range_id: None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = HarnessConfig(layers=args.layers, dim=64, heads=4, seq=32, batch=2, vocab=256)
    model, units, opt = build(cfg, torch.device("cpu"))
    bare_times, hooked_times = [], []
    seconds_per_step(model, opt, cfg, None, 3)  # warm up
    for _ in range(args.rounds):
        bare_times.append(seconds_per_step(model, opt, cfg, None, args.steps))
        hooked = UnitRanges(enabled=True, report=print)
        hooked.attach(model)
        hooked_times.append(seconds_per_step(model, opt, cfg, hooked, args.steps))
        hooked.close()
    dist.destroy_process_group()
    bare, with_ranges = statistics.median(bare_times), statistics.median(hooked_times)
    extra = with_ranges - bare
    print(
        f"# NVTX unit ranges, {len(units)} units, {args.rounds} rounds x {args.steps} steps, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, torch "
        f"{torch.__version__}\n"
        f"bare {bare * 1e3:.2f} ms/step, with ranges {with_ranges * 1e3:.2f} ms/step: "
        f"+{extra * 1e3:.2f} ms per step, {extra / len(units) * 1e6:.0f} µs per unit"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
