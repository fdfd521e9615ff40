"""ResNet-18 under FSDP1 on CPU/gloo, wrapped whole (no auto wrap policy), as a new user would.

torchrun --nproc-per-node 2 resnet18_fsdp1.py [--paste CODE_FILE] [--steps N]

The model is torchvision's `resnet18` (its BasicBlock layout, `layer1`..`layer4` of two blocks
each), written out here when torchvision is not importable with the pinned CPU torch. With
`--paste`, the given code (zdiag's printed FSDP1 remedy) wraps the model instead of the plain
`FSDP(model, device_id=...)`: it runs with `model` (the bare ResNet) and the block class in scope.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

try:  # the library's own model when it loads against this torch
    from torchvision.models import resnet18  # type: ignore[import-not-found,unused-ignore]
    from torchvision.models.resnet import BasicBlock  # type: ignore[import-not-found,unused-ignore]
except Exception:  # a CUDA-only torchvision wheel fails at import on a CPU torch

    class BasicBlock(nn.Module):  # type: ignore[no-redef]
        """torchvision.models.resnet.BasicBlock."""

        expansion = 1

        def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.downsample: nn.Module | None = None
            if stride != 1 or inplanes != planes:
                self.downsample = nn.Sequential(
                    nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
                )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(out)) + identity)

    class ResNet(nn.Module):
        """torchvision.models.resnet.ResNet with BasicBlock, layers [2, 2, 2, 2]."""

        def __init__(self, num_classes: int = 1000) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            widths, inplanes = (64, 128, 256, 512), 64
            for i, planes in enumerate(widths, 1):
                stride = 1 if i == 1 else 2
                layer = nn.Sequential(
                    BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes)
                )
                setattr(self, f"layer{i}", layer)
                inplanes = planes
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(512, num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            for i in range(1, 5):
                x = getattr(self, f"layer{i}")(x)
            return self.fc(torch.flatten(self.avgpool(x), 1))

    def resnet18() -> nn.Module:
        return ResNet()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paste", type=Path, help="FSDP1 code to wrap the model with")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = resnet18()
    if args.paste is not None:
        scope = {"model": model, "torch": torch, "BasicBlock": BasicBlock}
        exec(compile(args.paste.read_text(), str(args.paste), "exec"), scope)
        model = scope["model"]
    else:
        model = FSDP(model, device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        images = torch.randn(2, 3, 32, 32, generator=gen)
        labels = torch.randint(0, 1000, (2,), generator=gen)
        loss = F.cross_entropy(model(images), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    units = sum(1 for m in model.modules() if isinstance(m, FSDP))
    print(f"rank {dist.get_rank()} units {units} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
