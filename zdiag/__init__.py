"""zdiag: why sharded PyTorch training (FSDP2, DeepSpeed ZeRO) is slow or out of memory.

The package root stays light (no torch, pandas or textual at import time) so that
`zdiag --version` and `zdiag analyze` start fast. `zdiag.profile` (the Python API for custom
training loops) is imported lazily because it needs torch.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "profile"]


def __getattr__(name: str) -> Any:
    if name == "profile":
        from zdiag.collectors.api import profile

        return profile
    raise AttributeError(f"module 'zdiag' has no attribute {name!r}")
