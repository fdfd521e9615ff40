"""`zdiag.profile`: the Python API for training loops that want to mark steps themselves.

    import zdiag

    with zdiag.profile(out="runs/exp1", wait=1, warmup=1, active=3) as prof:
        for batch in loader:
            loss = model(batch).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step()          # one call per training step

It writes the same run directory as `zdiag run` (traces/, steps/, memory/, manifest.json). Under
`zdiag run` the options are ignored: the handle drives the session `zdiag run` already started, and
the first `prof.step()` switches it from optimizer-hook step detection to your explicit steps.
An out-of-memory error inside the block writes memory data, marks the manifest, and propagates.
A child forked inside the block records nothing and never writes the parent's files; it should
end with `os._exit` (as multiprocessing's children do): torch's profiler makes a forked child's
normal exit hang in C++ static destructors (docs/run.md, "Forked children").
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import TracebackType

from zdiag.errors import ConfigError

from . import memory
from .config import CollectorConfig
from .manifest import merge_manifest
from .rundir import MANIFEST
from .session import RankSession, active_session


def default_out_dir() -> Path:
    """./zdiag_runs/profile-<id>: the torchrun job id when there is one (same for all ranks).

    torchrun's default id, "none" (a rendezvous endpoint without --rdzv-id), names no job: every
    such run would share one folder, so the timestamp is used instead.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or run_id == "none":
        run_id = time.strftime("%Y%m%d-%H%M%S")
    return Path("zdiag_runs") / f"profile-{run_id}"


class Profile:
    """The handle returned by `zdiag.profile`; use it as a context manager and call `step()`."""

    def __init__(self, out: str | Path | None, config: CollectorConfig, auto_step: bool) -> None:
        self._out = out
        self._config = config
        self._auto_step = auto_step
        self._session: RankSession | None = None
        self._owned = False

    @property
    def run_dir(self) -> Path | None:
        """The run directory being written (None before the block starts)."""
        return self._session.run_dir if self._session else None

    @property
    def step_num(self) -> int:
        """Steps completed so far."""
        return self._session.step_index if self._session else 0

    def step(self) -> None:
        """Mark the end of one training step."""
        if self._session is not None:
            self._session.step()

    def __enter__(self) -> Profile:
        existing = active_session()
        if existing is not None:  # under `zdiag run`: drive its session
            self._session = existing
            return self
        out = Path(self._out) if self._out is not None else default_out_dir()
        if (out / MANIFEST).exists():
            # A second run there would overwrite some files and leave the first run's others.
            raise ConfigError(
                f"out {str(out)!r} already holds a finished run; choose a new folder."
            )
        try:
            self._session = RankSession(out, self._config, auto_step=self._auto_step).start()
        except OSError as exc:
            raise ConfigError(
                f"out {str(out)!r} cannot be written ({exc.strerror or exc}); choose a folder "
                "you can write to."
            ) from None
        self._owned = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session = self._session
        if session is None or not session.owned_here():
            return None  # (a forked child leaves the block: the session is its parent's)
        if exc is not None and memory.is_out_of_memory(exc):
            session.on_out_of_memory(exc)
        if not self._owned:
            return None  # zdiag run's bootstrap finishes its own session
        if exc is None:
            session.finish(0)
        elif isinstance(exc, SystemExit):
            session.finish(
                exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            )
        else:
            session.finish(1, f"{type(exc).__name__}: {str(exc)[:500]}", exc)
        try:
            merge_manifest(session.run_dir)
        except Exception:
            pass  # never hide the training's own outcome behind a manifest problem
        return None


def profile(
    out: str | Path | None = None,
    *,
    wait: int = 1,
    warmup: int = 1,
    active: int = 3,
    record_shapes: bool = False,
    profile_memory: bool = False,
    with_stack: bool = False,
    nvtx: bool = True,
    enabled: bool = True,
    auto_step: bool = False,
) -> Profile:
    """Profile a custom training loop into a zdiag run directory; call `.step()` once per step.

    out: run directory (default ./zdiag_runs/profile-<torchrun id or timestamp>).
    wait, warmup, active: the profiler schedule in steps (one window, like `--profile-steps`).
    record_shapes, profile_memory, with_stack: as torch.profiler (profile_memory also records
    shapes and stacks, which the memory timeline needs). nvtx: NVTX step ranges on CUDA.
    enabled=False: no profiler; steps are still logged. auto_step=True: count optimizer steps
    instead of (or in addition to, until the first) `.step()` calls.
    Raises zdiag.errors.ConfigError for bad schedule values, and on entering the block when
    `out` already holds a finished run or cannot be written.
    """
    config = CollectorConfig(
        profile=enabled,
        wait=wait,
        warmup=warmup,
        active=active,
        record_shapes=record_shapes,
        profile_memory=profile_memory,
        with_stack=with_stack,
        nvtx=nvtx,
    )
    return Profile(out, config, auto_step)
