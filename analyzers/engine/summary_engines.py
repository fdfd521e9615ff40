"""Engines that run the map (`summary_map.map_trace`) over many traces.

- `LocalEngine`: in this process for one trace or little JSON (below PARALLEL_MIN_BYTES);
  otherwise a process pool with one process per core, each task decoding its trace in its own
  process.
- `RayEngine` (`zdiag analyze --engine ray`, the `zdiag[ray]` extra): each trace is a Ray task
  on an existing cluster (`address`, e.g. "ray://head:10001" or "auto") or on a local one
  started for the call; the tasks read the traces where they are (the paths must be readable on
  the workers: a shared filesystem) and return only the encoded summaries. The reduce stays in
  the driver.

Both yield `MapOutput`s in completion order; the caller sorts by rank. `on_fraction(path,
share)`, when given, hears how much of a trace's JSON has been decoded, batch by batch, for the
traces decoded in this process (LocalEngine without a pool; so one big trace moves a progress
line); traces decoded elsewhere are reported only when their output arrives.
"""

from __future__ import annotations

import gc
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Protocol

from zdiag.errors import ConfigError

from .summary_map import MapOutput, MapTask, map_trace

PARALLEL_MIN_BYTES = 32 * 1024 * 1024
"""Summarize in worker processes only when the traces hold this much JSON together: below
that, starting workers costs more than it saves."""

Progress = Callable[[int, int, str], None]
OnFraction = Callable[[str, float], None]
"""(trace path, share of its JSON decoded)"""


class Engine(Protocol):
    """Runs map tasks; yields their outputs (any order)."""

    name: str

    def run(
        self, tasks: Sequence[MapTask], total_bytes: int, on_fraction: OnFraction | None = None
    ) -> Iterator[MapOutput]:
        """The outputs of `tasks` (InputError from a bad trace propagates)."""
        ...


class LocalEngine:
    """This machine: in this process, or a process pool (see the module docstring)."""

    name = "local"

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or os.cpu_count() or 1

    def run(
        self, tasks: Sequence[MapTask], total_bytes: int, on_fraction: OnFraction | None = None
    ) -> Iterator[MapOutput]:
        if len(tasks) <= 1 or total_bytes < PARALLEL_MIN_BYTES or self.workers <= 1:
            for t in tasks:
                # alone, a big trace may decode in several processes (decode_workers=None)
                task = _with_decode_workers(t, None if len(tasks) == 1 else 1)
                yield map_trace(task, _for_path(on_fraction, t.path))
            return
        # a forked worker's inherited heap frozen out of its garbage collector (as
        # inputs/plain_pickle._child)
        workers = min(self.workers, len(tasks))
        with ProcessPoolExecutor(max_workers=workers, initializer=gc.freeze) as pool:
            futures = [pool.submit(map_trace, t) for t in tasks]
            for fut in as_completed(futures):
                yield fut.result()


def _for_path(on_fraction: OnFraction | None, path: str) -> Callable[[float], None] | None:
    if on_fraction is None:
        return None
    return lambda share: on_fraction(path, share)


def _with_decode_workers(task: MapTask, workers: int | None) -> MapTask:
    return MapTask(task.path, task.manifest_rank, task.contexts, workers)


class RayEngine:
    """Ray tasks on an existing cluster or a local one (see the module docstring)."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None) -> None:
        try:
            ray = importlib.import_module("ray")
        except ImportError:
            raise ConfigError(
                "--engine ray needs Ray; install it with: pip install 'zdiag[ray]'."
            ) from None
        self._ray: Any = ray
        self.address = address
        self.num_cpus = num_cpus

    def run(
        self, tasks: Sequence[MapTask], total_bytes: int, on_fraction: OnFraction | None = None
    ) -> Iterator[MapOutput]:
        ray = self._ray
        started = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"log_to_driver": False, "include_dashboard": False}
            if self.address:
                kwargs["address"] = self.address
            elif self.num_cpus:
                kwargs["num_cpus"] = self.num_cpus
            ray.init(**kwargs)
            started = True
        try:
            remote = ray.remote(num_cpus=1, max_retries=0)(map_trace)
            pending = [remote.remote(t) for t in tasks]
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    yield _unwrap(ray, ref)
        finally:
            if started:
                ray.shutdown()


def _unwrap(ray: Any, ref: Any) -> MapOutput:
    """A task's output; a task's own exception (InputError for a bad trace) is re-raised as is."""
    try:
        out: MapOutput = ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.as_instanceof_cause()
        inner = getattr(cause, "cause", None)
        raise (inner if isinstance(inner, BaseException) else cause) from None
    return out


def make_engine(name: str, address: str | None = None, workers: int | None = None) -> Engine:
    """The engine called `name` ("local" or "ray")."""
    if name == "local":
        return LocalEngine(workers)
    if name == "ray":
        return RayEngine(address, workers)
    raise ConfigError(f"--engine {name!r} is not known; use local or ray.")
