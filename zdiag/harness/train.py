"""The training loop: process group, model, FSDP2, AdamW, and one line per step on rank 0.

A plain script from the outside: it never starts a profiler. Steps are ordinary
`forward, backward, optimizer.step(), zero_grad` iterations, which zdiag's collectors detect with a
global optimizer step hook.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from zdiag.collectors import runinfo
from zdiag.errors import ConfigError
from zdiag.harness.config import HarnessConfig
from zdiag.harness.memory_budget import GIB, MemoryBudget, cap_cuda_memory
from zdiag.harness.model import ModelArgs, Transformer, synthetic_batch
from zdiag.harness.sharding import FSDPUnit, apply_fsdp, enable_async_cpu_reduce_scatter


def choose_device(cfg: HarnessConfig) -> torch.device:
    """cuda:<LOCAL_RANK> when CUDA is asked for (or auto and available), else cpu."""
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda was given but this torch sees no CUDA device; use --device cpu or auto."
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.backend == "gloo":  # ranks may share GPUs: gloo has no one-rank-per-device rule
        local_rank %= torch.cuda.device_count()
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK {local_rank} has no GPU (only {torch.cuda.device_count()} visible); "
            "start fewer processes per node (--nproc-per-node), or share GPUs with --backend gloo."
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_process_group(device: torch.device, backend: str = "auto") -> None:
    """env:// under torchrun (WORLD_SIZE set), else a 1-process group on an in-memory store.

    `backend` auto is NCCL on CUDA and gloo on CPU.
    """
    if dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(minutes=10)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    else:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)


def build(
    cfg: HarnessConfig, device: torch.device
) -> tuple[Transformer, list[FSDPUnit], torch.optim.Optimizer]:
    """The sharded model (same init on every rank), its FSDP units, and AdamW."""
    torch.manual_seed(cfg.seed)
    args = ModelArgs(layers=cfg.layers, dim=cfg.dim, heads=cfg.heads, vocab=cfg.vocab, seq=cfg.seq)
    with torch.device(device):
        model = Transformer(args)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    units = apply_fsdp(model, cfg, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    if cfg.prefetch == "explicit" and device.type == "cpu" and dist.get_world_size() > 1:
        enable_async_cpu_reduce_scatter(model, optimizer)
    return model, units, optimizer


def record_run_info(cfg: HarnessConfig, units: list[FSDPUnit], budget: MemoryBudget | None) -> None:
    """Hand options, FSDP units and the emulated budget to zdiag's collectors.

    A no-op when not under `zdiag run` (the collectors' hook ignores it).
    """
    budget_bytes = int(cfg.memory_budget_gb * GIB) if cfg.memory_budget_gb is not None else None
    runinfo.record_run_info(
        harness=cfg.as_dict(),
        fsdp_units=[u.as_dict() for u in units],
        memory_budget_bytes=budget_bytes,
        samples_per_step=cfg.batch,
    )
    if budget is not None:
        runinfo.set_memory_reader(lambda: (budget.in_use_bytes(), None, budget.peak_bytes))


def train(cfg: HarnessConfig) -> int:
    """Run the configured training; returns 0. OutOfMemoryError propagates (non-zero exit)."""
    device = choose_device(cfg)
    init_process_group(device, cfg.backend)
    try:
        code = _train(cfg, device)
        # Every rank finishes its collectives before the group is torn down: with gloo,
        # destroy_process_group can deadlock while a peer is still inside a collective.
        # Only on success: after an error the peers may never arrive (torchrun stops them).
        dist.barrier()
        return code
    finally:
        dist.destroy_process_group()


def _train(cfg: HarnessConfig, device: torch.device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, units, optimizer = build(cfg, device)

    budget: MemoryBudget | None = None
    if cfg.memory_budget_gb is not None:
        if device.type == "cuda":
            cap_cuda_memory(cfg.memory_budget_gb, device)
        else:
            budget = MemoryBudget(int(cfg.memory_budget_gb * GIB), model, label=f" on rank {rank}")
            budget.install_checkpoint_accounting(model.layers)
    record_run_info(cfg, units, budget)

    if rank == 0:
        total = sum(u.param_count for u in units)
        print(
            f"zdiag harness: {world} rank(s) on {device.type}, {total / 1e6:.2f}M params, "
            f"{len(units)} FSDP units (wrap={cfg.wrap}, prefetch={cfg.prefetch}, "
            f"zero={cfg.zero}, ac={cfg.ac}, precision={cfg.precision}, misconfig={cfg.misconfig})",
            flush=True,
        )
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + rank + 1)
    model.train()
    for step in range(cfg.steps):  # 0-based, as the profiler numbers ProfilerStep#N
        inputs, labels = synthetic_batch(cfg.batch, cfg.seq, cfg.vocab, generator, device)
        start = time.perf_counter()
        with budget.track() if budget is not None else contextlib.nullcontext():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        if rank == 0:
            print(f"step {step} | {elapsed_ms:8.1f} ms | loss {loss_value:.4f}", flush=True)
    if rank == 0 and budget is not None:
        print(
            f"emulated memory peak {budget.peak_bytes / GIB:.3f} GiB of "
            f"{budget.budget_bytes / GIB:.3f} GiB budget",
            file=sys.stdout,
            flush=True,
        )
    return 0
