"""NVTX ranges around training steps, for Nsight Systems timelines.

Active only when CUDA is available and NVTX is on; otherwise `StepRanges` is a no-op object whose
methods return at once (no torch.cuda call). FSDP2's own phases already appear in Nsight as the
`FSDP::...` record_function labels when Nsight captures them with `--pytorch=autograd-nvtx`, so
zdiag adds only one range per step (`zdiag step N`), pushed and popped from the step hook, which
runs outside any compiled region (it is excluded from torch.compile tracing).
"""

from __future__ import annotations

import torch


class StepRanges:
    """One NVTX range per step: `begin(n)` opens `zdiag step n`, `end()` closes the open one."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = bool(enabled) and torch.cuda.is_available()
        self._open = False

    def begin(self, step: int) -> None:
        """Open the range of step `step`."""
        if self.enabled:
            torch.cuda.nvtx.range_push(f"zdiag step {step}")
            self._open = True

    def end(self) -> None:
        """Close the open range, if any."""
        if self.enabled and self._open:
            torch.cuda.nvtx.range_pop()
            self._open = False
