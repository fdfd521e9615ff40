"""The harness's options: argparse front end and one validated config dataclass.

`--misconfig NAME` is a shortcut that sets the knobs producing one misconfiguration; an option
given explicitly on the command line always wins over the shortcut's value.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from zdiag.analyzers.misconfigs import SCENARIOS
from zdiag.cli import OneLineParser
from zdiag.errors import ConfigError

WRAPS = ("block", "whole", "leaf")
PREFETCHES = ("explicit", "implicit", "off")
ZEROS = (3, 2)
ACS = ("none", "block")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "nccl", "gloo")

# The knobs each --misconfig shortcut sets (options given explicitly win).
MISCONFIG_PRESETS: dict[str, dict[str, Any]] = {
    "none": {},
    "whole-model-wrap": {"wrap": "whole"},
    "tiny-layer-wrap": {"wrap": "leaf"},
    "missing-overlap": {"prefetch": "off"},
    # Activations of a long sequence without checkpointing exceed the budget; the sharded
    # parameters, gradients and AdamW state (~60 MiB per rank at the default size) fit easily.
    "activation-oom": {"seq": 512, "batch": 8, "ac": "none", "memory_budget_gb": 0.25},
}


@dataclass(frozen=True)
class HarnessConfig:
    """Every harness option; `__post_init__` rejects bad values with a message naming the option."""

    layers: int = 4
    dim: int = 256
    heads: int = 8
    seq: int = 256
    batch: int = 4
    steps: int = 6
    vocab: int = 4096
    wrap: str = "block"
    prefetch: str = "explicit"
    zero: int = 3
    ac: str = "none"
    precision: str = "fp32"
    memory_budget_gb: float | None = None
    misconfig: str = "none"
    device: str = "auto"
    backend: str = "auto"
    seed: int = 0
    lr: float = 3e-4

    def __post_init__(self) -> None:
        for name in ("layers", "dim", "heads", "seq", "batch", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name} must be a positive integer, got {value!r}.")
        if self.vocab < 2:
            raise ConfigError(f"--vocab must be at least 2, got {self.vocab!r}.")
        if self.dim % self.heads:
            raise ConfigError(
                f"--dim {self.dim} must be divisible by --heads {self.heads}; "
                f"pick e.g. --dim {self.heads * max(1, round(self.dim / self.heads))}."
            )
        if (self.dim // self.heads) % 2:
            raise ConfigError(
                f"--dim / --heads (the head size, {self.dim // self.heads}) must be even."
            )
        choices: dict[str, Sequence[object]] = {
            "wrap": WRAPS,
            "prefetch": PREFETCHES,
            "zero": ZEROS,
            "ac": ACS,
            "precision": PRECISIONS,
            "device": DEVICES,
            "backend": BACKENDS,
            "misconfig": SCENARIOS,
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                shown = ", ".join(str(a) for a in allowed)
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be one of {shown}, got {value!r}."
                )
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise ConfigError(
                f"--memory-budget-gb must be a positive number of GiB, got {self.memory_budget_gb!r}."
            )
        if self.backend == "nccl" and self.device == "cpu":
            raise ConfigError("--backend nccl needs --device cuda (or auto with a GPU).")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr!r}.")

    def as_dict(self) -> dict[str, Any]:
        """The options as plain JSON-ready values (for the run manifest)."""
        return asdict(self)


def build_parser() -> argparse.ArgumentParser:
    """The harness's argument parser; every option defaults to None so presets can fill it."""
    d = HarnessConfig()
    p = OneLineParser(
        prog="python -m zdiag.harness",
        description=(
            "zdiag's built-in FSDP2 training harness: a decoder-only transformer on synthetic "
            "data. Run alone (1 rank) or under torchrun; --misconfig injects a known problem."
        ),
    )
    size = p.add_argument_group("model and data")
    size.add_argument("--layers", type=int, help=f"transformer blocks (default {d.layers})")
    size.add_argument("--dim", type=int, help=f"model width (default {d.dim})")
    size.add_argument("--heads", type=int, help=f"attention heads (default {d.heads})")
    size.add_argument("--seq", type=int, help=f"sequence length (default {d.seq})")
    size.add_argument("--batch", type=int, help=f"sequences per rank and step (default {d.batch})")
    size.add_argument("--steps", type=int, help=f"training steps (default {d.steps})")
    size.add_argument("--vocab", type=int, help=f"vocabulary size (default {d.vocab})")
    size.add_argument("--lr", type=float, help=f"AdamW learning rate (default {d.lr})")
    size.add_argument("--seed", type=int, help=f"random seed (default {d.seed})")
    fsdp = p.add_argument_group("sharding")
    fsdp.add_argument(
        "--wrap",
        choices=WRAPS,
        help="FSDP units: block = each transformer block + root (default); whole = root only "
        "(whole-model wrap); leaf = every Linear/Embedding/RMSNorm + root (tiny-layer wrap)",
    )
    fsdp.add_argument(
        "--prefetch",
        choices=PREFETCHES,
        help="explicit = next/previous block prefetch (default); implicit = FSDP2 defaults; "
        "off = each gather issued only when its compute needs it, with per-block host syncs",
    )
    fsdp.add_argument(
        "--zero",
        type=int,
        choices=ZEROS,
        help="3 = reshard parameters after forward (default); 2 = keep them gathered until backward",
    )
    fsdp.add_argument(
        "--ac", choices=ACS, help="activation checkpointing: none (default) or each block"
    )
    fsdp.add_argument(
        "--precision", choices=PRECISIONS, help="fp32 (default) or bf16 parameters/compute"
    )
    run = p.add_argument_group("device and memory")
    run.add_argument(
        "--device", choices=DEVICES, help="auto (default: cuda when available), cpu or cuda"
    )
    run.add_argument(
        "--backend",
        choices=BACKENDS,
        help="auto (default: nccl on cuda, gloo on cpu), nccl or gloo; gloo on cuda lets "
        "several ranks share one GPU (NCCL refuses two ranks on one device)",
    )
    run.add_argument(
        "--memory-budget-gb",
        type=float,
        metavar="GIB",
        help="device capacity to emulate per rank: on CPU exceeding it raises "
        "torch.OutOfMemoryError; on CUDA it caps the caching allocator",
    )
    run.add_argument(
        "--misconfig",
        choices=SCENARIOS,
        help="inject a known misconfiguration (sets the knobs above unless given explicitly)",
    )
    return p


def config_from_args(args: argparse.Namespace) -> HarnessConfig:
    """Resolve explicit options > --misconfig preset > defaults into a validated config."""
    misconfig = args.misconfig or "none"
    if misconfig not in MISCONFIG_PRESETS:
        raise ConfigError(f"--misconfig must be one of {', '.join(SCENARIOS)}, got {misconfig!r}.")
    values: dict[str, Any] = dict(MISCONFIG_PRESETS[misconfig])
    for field in fields(HarnessConfig):
        given = getattr(args, field.name, None)
        if given is not None:
            values[field.name] = given
    values["misconfig"] = misconfig
    return HarnessConfig(**values)


def parse_config(argv: Sequence[str] | None = None) -> HarnessConfig:
    """Parse command-line options into a validated HarnessConfig."""
    return config_from_args(build_parser().parse_args(argv))
