"""A Hugging Face Llama (tiny config) with FSDP2 on each decoder layer, then the root (the
recipe of PyTorch's FSDP2 docs), trained the way packed-sequence training feeds it: explicit
`position_ids`, no attention mask, no KV cache. transformers then checks each batch for packed
sequences (`masking_utils.find_packed_sequence_indices`), a host sync inside the library's own
code once per forward (needs `transformers`).

torchrun --standalone --nproc-per-node 2 examples/library/llama_position_ids.py [--steps 6]
zdiag run --with-stack --nproc-per-node 2 examples/library/llama_position_ids.py
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1)
    for step in range(args.steps):
        idx = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
        out = model(input_ids=idx, position_ids=positions, labels=idx)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print("step", step, f"{out.loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
