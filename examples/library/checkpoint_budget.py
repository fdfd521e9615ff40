"""A Hugging Face model (GPT-2 or ViT, small configs) with FSDP2 on each block, then the root, as
PyTorch's FSDP2 docs wrap it; `--paste FILE` runs code a tool printed (a `zdiag plan`), as a user
pasting it would: the lines up to its `# before fully_shard` note (activation checkpointing)
before the wrap, the rest after it. Needs `transformers`.

Each rank prints its median step (the first two left out) and its peak resident memory over the
steps after the first (`VmHWM`, reset after step 0 through /proc/self/clear_refs; run with
`MALLOC_MMAP_THRESHOLD_=65536` so that freed tensors leave the resident set).

torchrun --standalone --nproc-per-node 2 examples/library/checkpoint_budget.py --model gpt2
zdiag run --nproc-per-node 2 --profile-memory examples/library/checkpoint_budget.py --model vit
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel, ViTConfig, ViTForImageClassification


def _model(name: str, dim: int, layers: int, seq: int) -> tuple[nn.Module, nn.ModuleList]:
    if name == "gpt2":
        cfg = GPT2Config(n_layer=layers, n_embd=dim, n_head=4, vocab_size=2048, n_positions=seq)
        gpt = GPT2LMHeadModel(cfg)
        return gpt, gpt.transformer.h
    vit = ViTForImageClassification(
        ViTConfig(
            image_size=64,
            patch_size=4,
            hidden_size=dim,
            intermediate_size=4 * dim,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_labels=10,
        )
    )
    return vit, vit.vit.layers


def _peak_rss_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt2", "vit"), default="gpt2")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128, help="GPT-2's sequence length")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1, metavar="K",
                   help="each batch as K micro-batches, gradients reduced in the last only")  # fmt: skip
    p.add_argument("--paste", type=Path, help="code to run on the model (a tool's plan)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, blocks = _model(args.model, args.dim, args.layers, args.seq)
    code = args.paste.read_text() if args.paste else ""
    # the code's own note says which part goes before the wrap: the checkpointing
    before, note, after = code.partition("# before fully_shard")
    scope = {"model": model, "torch": torch}
    if note:
        exec(before, scope)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    if code:
        exec(after if note else code, scope)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    times: list[float] = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        k = args.grad_accum
        if args.model == "gpt2":
            ids = torch.randint(0, 2048, (args.batch, args.seq), generator=g)
            batches = [{"input_ids": x, "labels": x} for x in ids.chunk(k)]
        else:
            images = torch.randn(args.batch, 3, 64, 64, generator=g)
            labels = torch.randint(0, 10, (args.batch,), generator=g)
            batches = [
                {"pixel_values": x, "labels": y}
                for x, y in zip(images.chunk(k), labels.chunk(k), strict=True)
            ]
        for i, inputs in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)
            loss = model(**inputs).loss / len(batches)
            loss.backward()
        opt.step()
        opt.zero_grad()
        times.append((time.perf_counter() - t0) * 1e3)
        if step == 0:
            _reset_peak_rss()
    peak = _peak_rss_mib()
    print(
        f"rank {rank}: median step {statistics.median(times[2:]):.1f} ms, "
        f"peak rss {peak if peak is not None else float('nan'):.1f} MiB",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
