"""The rank's one profiler window: armed at the first forward, exported once, then stopped.

The profiler (and, with `profile_memory`, the CUDA allocator history) starts at the first module
forward, or at the first step end if no module runs forward before it: after the script's own
set-up (device selection, process group, model build), which stays out of the trace. The trace is
written by the profiler's own callback when the active steps end; the memory timeline waits for
the end of the run (it takes seconds). A window cut short (a crash, a signal, a hang, an OOM) is
still exported with the steps recorded so far.

Failure paths (signals, the hang watchdog) may close the window from another thread: one lock
guards the profiler's state; the step hook takes it uncontended (~0.1 µs).
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.profiler import ProfilerAction

from . import memory, memtimeline, rundir, summary_job
from .compile_safe import eager_or_opaque
from .config import CollectorConfig
from .error_log import ErrorLog
from .fsio import write_atomically


def profiler_activities() -> list[Any]:
    """The CPU, and CUDA when this process sees a GPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def align_step(prof: Any, at_step: int) -> None:
    """Set a profiler started at step `at_step` to that step, so ProfilerStep#n names step n of
    the step log (torch counts from 0 at `start()`)."""
    action = prof.schedule(at_step)
    prof.step_num = at_step
    prof.current_action = action
    if hasattr(prof, "_prev_schedule_action"):
        prof._prev_schedule_action = action


class ProfilerWindow:
    """Rank `rank`'s profiler window and the files it leaves (trace, memory timeline and
    snapshot). `on_written` is called after the trace is written (the manifest part then names
    it); `current_step` says the step the rank is in (the window starts there)."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world_size: int,
        config: CollectorConfig,
        errors: ErrorLog,
        *,
        current_step: Callable[[], int],
        on_written: Callable[[], None],
        owned_here: Callable[[], bool],
    ) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.errors = errors
        self._current_step = current_step
        self._on_written = on_written
        self._owned_here = owned_here
        self.lock = threading.RLock()
        self.trace_written = False
        self.timeline_written = False
        self.timeline_categorized: bool | None = None
        self.snapshot_written = False
        self._prof: Any = None
        self._pending = False  # armed: starts at the first forward (or step end)
        self._done = False  # the window was exported: stop at the next step end
        self._all_threads = False  # whether another thread may stop the profiler
        self._cuda_history = False
        self._timeline_pending: Any = None  # the closed window's profiler, timeline not written
        self._forward_hook: Any = None
        self._main_thread = threading.get_ident()

    # ----------------------------------------------------------------- arming and stepping
    def arm(self) -> None:
        """Start the window at the first module forward (or the first step end)."""
        self._pending = True
        self._forward_hook = register_module_forward_pre_hook(
            eager_or_opaque(self._on_first_forward)
        )

    def _on_first_forward(self, module: Any, args: Any) -> None:
        self.remove_forward_hook()
        if self._pending:
            self._start_now(self._current_step())

    def remove_forward_hook(self) -> None:
        """Remove the first-forward hook (a plain dict removal: safe in a forked child)."""
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def step(self, step_index: int) -> None:
        """At a step end (`step_index`: the step now starting): advance the profiler, stop it
        once its window is exported, or start a window still pending."""
        with self.lock:
            if self._prof is not None:
                self._prof.step()
                if self._done:
                    self._stop()
            elif self._pending:
                self._start_now(step_index)

    @property
    def busy(self) -> bool:
        """Whether the window is armed or recording (no other profiler may start)."""
        return self._pending or self._prof is not None

    def forget_fallback_rank(self) -> None:
        """torch.distributed is initialized: torch writes the real distributedInfo."""
        if self._prof is not None:
            self._prof.preset_metadata.pop("distributedInfo", None)

    def _start_now(self, at_step: int) -> None:
        """Start the profiler (and the CUDA allocator history) as of step `at_step`."""
        self._pending = False
        self.remove_forward_hook()
        if torch.autograd._profiler_enabled():
            # Only one profiler can run: the script's own torch.profiler has it.
            self.errors.report("the script runs torch.profiler itself, so zdiag records no trace")
            return
        self.errors.guard("profiler", self._start_profiler, at_step)
        if self.config.profile_memory:
            self._cuda_history = bool(
                self.errors.guard(
                    "CUDA memory history",
                    memory.start_cuda_history,
                    self.config.max_snapshot_entries,
                )
            )

    def _start_profiler(self, at_step: int = 0) -> None:
        cfg = self.config
        # The memory timeline needs shapes and stacks as well (torch.profiler's requirement).
        need_mem = cfg.profile_memory
        self._prof = torch.profiler.profile(
            activities=profiler_activities(),
            schedule=torch.profiler.schedule(
                wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1
            ),
            on_trace_ready=self._on_trace_ready,
            record_shapes=cfg.record_shapes or need_mem,
            profile_memory=need_mem,
            with_stack=cfg.with_stack or need_mem,
            **self._all_threads_option(),
        )
        # Until torch.distributed is initialized, say which rank this is (torch adds the real
        # distributedInfo, with process groups, when the trace starts after init_process_group).
        fallback = {"backend": None, "rank": self.rank, "world_size": self.world_size}
        if not (dist.is_available() and dist.is_initialized()):
            self._prof.preset_metadata_json("distributedInfo", json.dumps(fallback))
        if at_step > 0:
            # Started after step 0 (no module forward before it ended)
            align_step(self._prof, at_step)
        self._prof.start()

    def _all_threads_option(self) -> dict[str, Any]:
        """`profile_all_threads` (torch >= 2.7): the profiler's state is then process-wide, so the
        hang watchdog and the signal watcher can stop it and export the window from their own
        thread while the training thread is blocked in a collective (with the default,
        thread-local state, stopping it from another thread finds no session and can crash)."""
        try:
            from torch._C._profiler import _ExperimentalConfig

            config = _ExperimentalConfig(profile_all_threads=True)
        except (ImportError, TypeError):
            self._all_threads = False
            return {}
        self._all_threads = True
        return {"experimental_config": config}

    # ----------------------------------------------------------------- stopping and exporting
    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prof.stop()

    def _close(self) -> None:
        """Stop the profiler keeping what it recorded: an active window is exported by the
        profiler's own callback; a window stopped in warmup (a crash, a signal, a hang before the
        active steps) is exported here, so the steps recorded so far are not lost."""
        prof = self._prof
        if prof is None:
            return
        recording = prof.current_action != ProfilerAction.NONE
        self._stop()
        if recording and not self.trace_written:
            self._on_trace_ready(prof)

    def close_from_any_thread(self, why: str) -> None:
        """Close the window from the thread a signal or hang runs on, when torch allows it."""
        with self.lock:
            if self._prof is None:
                return
            if threading.get_ident() == self._main_thread or self._all_threads:
                self.errors.guard("profiler", self._close)
            else:
                self.errors.report(
                    f"{why}: the profiler window could not be written from another thread "
                    "(this torch has no profile_all_threads)"
                )

    def _on_trace_ready(self, prof: Any) -> None:
        if not self._owned_here():
            return
        try:
            trace = self.run_dir / rundir.trace_relpath(self.rank)
            write_atomically(trace, prof.export_chrome_trace, suffix=".json.gz")
            self.trace_written = True
            self.errors.guard("in-job summary", summary_job.start_summary, trace)
            if self.config.profile_memory:
                # The timeline export takes seconds (11 s for a 2-rank harness window): it waits
                # for the end of the run (or an OOM) instead of stalling a training step.
                self._timeline_pending = prof
                self._dump_window_snapshot()
            self._on_written()
        except Exception as exc:
            # Only the profiler's output is lost: steps are still detected and logged.
            self.errors.report(
                f"trace export failed: {type(exc).__name__}: {exc}; no trace on this rank"
            )
        finally:
            self._done = True

    def export_pending_timeline(self) -> None:
        """Write the memory timeline of the closed window, if one waits (see `_on_trace_ready`)."""
        prof, self._timeline_pending = self._timeline_pending, None
        if prof is None:
            return
        timeline = self.run_dir / rundir.memory_timeline_relpath(self.rank)
        device = memory.device_in_use()
        failure = self.errors.guard(
            "memory timeline", memtimeline.export_timeline, prof, timeline, device
        )
        self.timeline_written = timeline.is_file()
        if self.timeline_written:
            self.timeline_categorized = failure is None
            if failure is not None:
                self.errors.report(
                    f"torch's memory profiler could not sort this rank's memory into categories "
                    f"({failure}); its memory timeline holds total bytes only (docs/run.md)"
                )

    def _dump_window_snapshot(self) -> None:
        if self._cuda_history:
            self.dump_snapshot()

    def dump_snapshot(self) -> None:
        """Write the CUDA memory snapshot now (a failure keeps an earlier one)."""
        snap = self.run_dir / rundir.memory_snapshot_relpath(self.rank)
        dumped = bool(self.errors.guard("memory snapshot", memory.dump_cuda_snapshot, snap))
        self.snapshot_written = dumped or self.snapshot_written

    def stop_for_oom(self) -> bool:
        """At an out-of-memory error: close the window (exporting its trace and timeline);
        whether it was recording (warmup or active, not merely armed) when the error came."""
        window_open = self._prof is not None and self._prof.current_action != ProfilerAction.NONE
        if self._prof is not None:
            self.errors.guard("profiler", self._stop)
        self.export_pending_timeline()
        return window_open

    def finish(self) -> None:
        """At the end of the run: close the window, write the timeline, stop the CUDA history."""
        with self.lock:
            self.errors.guard("profiler", self._close)
        self.export_pending_timeline()
        if self._cuda_history:
            self.errors.guard("CUDA memory history", memory.stop_cuda_history)

    def abandon(self) -> None:
        """After a collector error in the step path: stop without exporting anything."""
        self.remove_forward_hook()
        self._pending = False
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                prof.on_trace_ready = None
                prof.stop()
            except Exception:
                pass

    def disarm_in_forked_child(self) -> tuple[Any, ...]:
        """In a forked child: drop the parent's profiler without calling it (kineto's state
        belongs to the parent's threads); the objects to keep alive, never touched."""
        self._pending = False
        self.lock = threading.RLock()  # the parent's may be held by a thread that is not here
        inherited = (self._prof, self._timeline_pending)
        self._prof = self._timeline_pending = None
        return inherited

    def files(self) -> dict[str, Any]:
        """The manifest entry's fields naming this window's files (None: not written)."""
        written = {
            "trace": (self.trace_written, rundir.trace_relpath),
            "memory_timeline": (self.timeline_written, rundir.memory_timeline_relpath),
            "memory_snapshot": (self.snapshot_written, rundir.memory_snapshot_relpath),
        }
        files: dict[str, Any] = {
            k: path(self.rank) if done else None for k, (done, path) in written.items()
        }
        return {**files, "memory_timeline_categorized": self.timeline_categorized}
