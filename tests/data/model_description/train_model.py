"""A user's own training script (not the harness) for the model-description tests.

MODE: none | fsdp2 | fsdp1 | ddp | profile | broken. Writes the facts the test checks against to
argv[2] (rank 0), computed from the model itself."""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn


class ResidualMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Encoder(nn.Module):
    def __init__(self, dim: int, n: int) -> None:
        super().__init__()
        self.stages = nn.ModuleList(ResidualMLP(dim) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x


class TabularResNet(nn.Module):
    def __init__(self, features: int = 12, dim: int = 32, n: int = 6) -> None:
        super().__init__()
        self.stem = nn.Linear(features, dim)
        self.encoder = Encoder(dim, n)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.stem(x)))


def main() -> None:
    mode, facts_path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    if mode in ("fsdp2", "fsdp1", "ddp"):
        dist.init_process_group("gloo")
    model = TabularResNet()
    block_bytes = sum(p.numel() * p.element_size() for p in model.encoder.stages[0].parameters())
    facts = {
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "block_bytes": block_bytes,
        "stages": len(model.encoder.stages),
    }
    if mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for stage in model.encoder.stages:
            fully_shard(stage, reshard_after_forward=False, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        stages = model.encoder.stages
        stages[0].set_modules_to_forward_prefetch([stages[1], stages[2]])
        stages[3].set_modules_to_backward_prefetch([stages[2]])
    elif mode == "fsdp1":
        from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({ResidualMLP}),
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            forward_prefetch=True,
            limit_all_gathers=False,
            device_id=torch.device("cpu"),
        )
    elif mode == "ddp":
        model = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=1, gradient_as_bucket_view=True
        )
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif mode == "broken":
        import zdiag.collectors.model_capture as capture

        def fail(*args: object, **kwargs: object) -> None:
            raise RuntimeError("planted failure")

        capture.describe_model = fail  # type: ignore[assignment]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 12)

    def train_step() -> None:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    if mode == "profile":
        import zdiag

        with zdiag.profile(out=sys.argv[3], wait=0, warmup=0, active=1) as prof:
            for _ in range(3):
                train_step()
                prof.step()
    else:
        for _ in range(3):
            train_step()
    facts["forward_pre_hooks_left"] = len(torch.nn.modules.module._global_forward_pre_hooks)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(facts_path, "w") as f:
            json.dump(facts, f)
    if dist.is_initialized() and mode != "ddp":
        # DDP on gloo: destroy_process_group hangs now and then under `zdiag run` (with or
        # without the model description; to be investigated apart), so that mode skips it.
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
