"""One rank's collection session: step detection, and the parts it drives at each step.

`RankSession` is what both `zdiag run` (through the bootstrap) and `zdiag.profile(...)` drive.
Steps are counted either by a global optimizer step post-hook (`auto_step=True`: the first
optimizer that steps is the *step driver*; other optimizers' steps are ignored, so a loop with two
optimizers counts one step per iteration) or by explicit `step()` calls (which switch the session
to manual stepping for good).

Per step the hook does O(1) work: a clock reading, one step-log line, an optional live record, an
optional NVTX push/pop (with CUDA, also closing FSDP unit ranges left open, see `nvtx.py`) and,
while the profiler window is open, `profiler.step()`. Once the window
is written the profiler is stopped. Any collector error is reported once on stderr, collection
stops on that rank, and training continues.

The session composes parts with one owner each: `ProfilerWindow` (the profiler, its trace and
memory files), `StepLog` (one line per step), `LiveFeed` (records for `zdiag monitor`),
`FailureWrites` (signals and the hang watchdog), `ModelCapture` (the model description),
`ErrorLog` (collector errors, contained), `rank_part.py` (the manifest part, the OOM record). The
session itself owns step detection, the order of start and finish, and fork safety.

A forked child (`os.fork`, multiprocessing's "fork" start method, DataLoader workers) inherits the
session but none of its threads: `os.register_at_fork` disarms it in the child at once (hooks
removed, signal handler and wakeup fd put back, step log descriptor closed, no profiler call), and
every path that writes checks the process id, so a child never writes the parent's files, runs
its teardown, or waits on a thread that exists only in the parent. `exit_forked_child` ends such
a child without C `exit()` (see there why).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import memory, rundir, runinfo
from .capture_window import CaptureWindow
from .compile_safe import eager_or_opaque
from .config import CollectorConfig
from .error_log import ErrorLog
from .failure_writes import FailureWrites
from .group_threads import GroupThreads
from .hang import raised_at
from .live_feed import LiveFeed
from .model_capture import ModelCapture
from .model_schema import PipelineInfo
from .nvtx import StepRanges, UnitRanges
from .pipeline_capture import PipelineRecorder
from .profiler_window import ProfilerWindow
from .rank_part import RankIdentity, capture_out_of_memory, write_rank_part
from .run_records import SourceLine
from .step_clock import StepClock
from .steplog import StepLog

_ACTIVE: RankSession | None = None
_SESSIONS: weakref.WeakSet[RankSession] = weakref.WeakSet()
"""Started sessions of this process (and, in a forked child, of its parent: disarmed)."""


def active_session() -> RankSession | None:
    """The session collecting in this process, if any (in a forked child: the parent's,
    disarmed, so `zdiag.profile` there drives nothing)."""
    return _ACTIVE


def _after_fork_in_child() -> None:
    """`os.register_at_fork(after_in_child=...)`: the sessions now in memory are the parent's."""
    for session in list(_SESSIONS):
        try:
            session.disarm_in_forked_child()
        except Exception:  # nothing may stop the child: the pid checks still hold
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def exit_forked_child(code: int) -> NoReturn:
    """End a forked child of a collecting process as Python's exit would, without C `exit()`.

    Python's own duties come first: wait for the child's non-daemon threads, run its atexit
    handlers, flush stdout and stderr. Then `os._exit(code)`, skipping the C++ static
    destructors: torch's profiler (kineto) keeps a thread waiting on a condition variable in the
    parent; in the child that thread does not exist, and the destructor of kineto's
    `ConfigLoader` waits in `pthread_cond_destroy` for it forever (a child that returned or
    called `sys.exit()` hung in every try here). multiprocessing ends its forked children with
    `os._exit` too."""
    for duty in (threading._shutdown, atexit._run_exitfuncs):  # type: ignore[attr-defined]
        try:
            duty()
        except BaseException:  # as Python: a failing atexit handler does not change the code
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except BaseException:
            pass
    os._exit(code)


class RankSession:
    """Collects one rank's data into `run_dir` (see `zdiag.collectors.rundir` for the layout)."""

    def __init__(
        self,
        run_dir: str | Path,
        config: CollectorConfig,
        *,
        auto_step: bool = True,
        command: list[str] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.config = config
        self.auto_step = auto_step
        self.who = RankIdentity.of_this_process(command)
        self.rank = self.who.rank
        self.manual = not auto_step
        self.oom = False
        self.oom_record_written = False
        self.backend: str | None = None
        self.error_source: SourceLine | None = None
        self._broken = False
        self._finished = False
        self._driver: int | None = None  # id() of the optimizer whose steps are counted
        self._hook: Any = None
        self._remove_listener: Any = None
        self._model: ModelCapture | None = None  # the model description's one-shot hooks
        self._group_threads: GroupThreads | None = None  # each gloo group's threads (profiled)
        self._pipeline: PipelineRecorder | None = None  # the pipeline stages the script builds
        self._pid = os.getpid()  # the process that owns the run directory's files for this rank
        self.forked_child = False  # set in a forked child by `disarm_in_forked_child`
        self._inherited: tuple[Any, ...] = ()  # the parent's objects, kept alive, never touched
        self._cuda = torch.cuda.is_available()
        self._dist = dist.is_available()
        self._clock = StepClock()
        self._errors = ErrorLog(self.rank)
        self._step_log = StepLog(
            self.run_dir / rundir.step_log_relpath(self.rank), config.max_step_log_lines
        )
        self._step_log_failed = False
        self._nvtx = StepRanges(config.nvtx)
        self._unit_ranges = UnitRanges(config.nvtx, self._errors.report)
        self._window = ProfilerWindow(
            self.run_dir,
            self.rank,
            self.who.world_size,
            config,
            self._errors,
            current_step=lambda: self._clock.step_index,
            on_written=lambda: self._write_part(None, None),
            owned_here=self.owned_here,
        )
        self._feed = LiveFeed(self.rank, self.who.host, self._errors)
        self._captures = CaptureWindow(
            self.run_dir, self.rank, self._errors, busy=lambda: self._window.busy
        )
        self._failures = FailureWrites(
            self.run_dir,
            self.rank,
            self._clock,
            self._window,
            self._feed,
            self._errors,
            write_part=self._write_part_contained,
            owned_here=self.owned_here,
        )

    @property
    def step_index(self) -> int:
        """Steps finished so far."""
        return self._clock.step_index

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> RankSession:
        """Create the run directory, write this rank's part, arm the hook and the profiler."""
        global _ACTIVE
        rundir.make_run_dir(self.run_dir)
        self._write_part(exit_code=None, error=None)
        _ACTIVE = self
        _SESSIONS.add(self)
        self._remove_listener = runinfo.add_listener(self._on_run_info)
        self._on_run_info(runinfo.current_run_info())
        self._errors.guard("live publisher", self._feed.start)
        if self._dist:
            self._pipeline = self._errors.guard("pipeline stages", PipelineRecorder().install)
        self._model = self._errors.guard(
            "model description",
            ModelCapture(
                self.run_dir,
                self.rank,
                self._errors.report,
                self._pipeline_info,
                probe_activations=self.config.profile_memory,
            ).arm,
        )
        if self.config.profile:
            if self._dist:
                self._group_threads = self._errors.guard(
                    "process-group threads", GroupThreads().install
                )
            self._window.arm()
        if self.auto_step:
            self._hook = register_optimizer_step_post_hook(eager_or_opaque(self._on_optimizer_step))
        self._unit_ranges.watch()
        self._nvtx.begin(0)
        self._failures.install(self.config.hang_timeout_s)
        self._clock.restart()
        return self

    def finish(
        self, exit_code: int | None, error: str | None = None, exc: BaseException | None = None
    ) -> None:
        """Close everything, write the last profiler window if open, and the final manifest part.

        `exc`, the exception the script raised, gives the user's line it came from."""
        global _ACTIVE
        if self._finished or not self.owned_here():
            return
        self._finished = True
        self._failures.begin_finish()  # a SIGTERM now waits for this method's writes
        self._remove_step_hooks()
        self._errors.guard("NVTX", self._unit_ranges.close)
        self._errors.guard("NVTX", self._nvtx.end)
        self._window.finish()
        self._captures.close()
        self._errors.guard("step log", self._step_log.close)
        ended = "finished" if exit_code == 0 and error is None else "failed"
        self._feed.finish(max(0, self.step_index - 1), ended)
        if exc is not None:
            self.error_source = self._errors.guard("traceback", raised_at, exc)
        # Never let zdiag's own output (a full disk, say) replace the training's outcome.
        self._errors.guard("manifest part", self._write_part, exit_code, error)
        if _ACTIVE is self:
            _ACTIVE = None
        _SESSIONS.discard(self)
        self._failures.end_finish()

    def owned_here(self) -> bool:
        """Whether this process is the one that started the session (False in a forked child)."""
        return not self.forked_child and os.getpid() == self._pid

    def disarm_in_forked_child(self) -> None:
        """In a forked child, right after the fork: the session is the parent's. Switch it off
        without touching what the parent owns: no file written, no profiler call (kineto's state
        belongs to the parent's threads), no thread joined, no lock taken that one of the
        parent's threads may have held at the fork. Hooks are removed (plain dict removals), the
        signal handler and wakeup fd are put back, the child's copy of the step log descriptor
        is closed. Training in the child goes on untouched; it is just not recorded."""
        if self.forked_child:
            return
        self.forked_child = True
        self._finished = True  # finish(), step() and the hooks do nothing from now on
        self._broken = True
        # Kept alive, never called: dropping the last reference would run their destructors.
        self._inherited = (
            *self._window.disarm_in_forked_child(),
            *self._feed.disarm_in_forked_child(),
            *self._failures.release_in_forked_child(),
        )
        for undo in (
            self._failures.disarm_signals_in_forked_child,
            self._step_log.detach,
            self._remove_hooks,
        ):
            try:
                undo()
            except Exception:
                pass

    def _remove_step_hooks(self) -> None:
        """Remove the optimizer, forward and model hooks and the run-info listener."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._remove_listener is not None:
            self._remove_listener()
            self._remove_listener = None
        self._window.remove_forward_hook()
        if self._model is not None:
            self._model.disarm()
        if self._group_threads is not None:
            self._group_threads.uninstall()
        if self._pipeline is not None:
            self._pipeline.uninstall()

    def _remove_hooks(self) -> None:
        """Every hook, and the comm split's (in a forked child)."""
        self._remove_step_hooks()
        self._feed.remove_comm_timer()

    # ----------------------------------------------------------------- steps
    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.manual or self._broken:
            return
        if self._driver is None:
            self._driver = id(optimizer)
        elif id(optimizer) != self._driver:
            return
        self._end_step()

    def step(self) -> None:
        """Mark the end of a training step by hand (switches off the optimizer-hook detection)."""
        self.manual = True
        if not self._broken and not self._finished and self.owned_here():
            self._end_step()

    def _end_step(self) -> None:
        try:
            step, start, now = self._clock.tick()
            self._failures.beat(now - start)
            self._unit_ranges.step_end()
            self._nvtx.end()
            reading = (
                self._errors.guard("memory reader", memory.read_device_memory, self._cuda)
                or memory.NO_READING
            )
            self._log_step(step, (now - start) * 1000.0, reading)
            if self._feed.on:
                self._feed.publish_step(
                    step, start, now, reading, self._cuda, self._captures.status
                )
            if self.backend is None and self._dist and dist.is_initialized():
                self.backend = str(dist.get_backend())
                self._window.forget_fallback_rank()
            self._window.step(self._clock.step_index)
            if self._feed.on:  # a capture the monitor asked for (off: this one test)
                self._captures.step(self._clock.step_index, self._feed.capture_request())
            self._nvtx.begin(self._clock.step_index)
        except Exception as exc:
            self._fail("step hook", exc)

    def _log_step(self, step: int, duration_ms: float, reading: memory.MemoryReading) -> None:
        log = self._step_log
        if not log.write_step(
            step,
            time.time(),
            duration_ms,
            *reading,
            cpu_ms=self._clock.cpu_ms,
            children_cpu_ms=self._clock.children_cpu_ms,
        ):
            if log.error is not None and not self._step_log_failed:
                self._step_log_failed = True  # only the step log stops; the rest goes on
                self._errors.report(f"step log write failed ({log.error}); the step log stops here")

    def _fail(self, where: str, exc: Exception) -> None:
        """A collector error inside the step path: report once, stop collecting, keep training."""
        self._broken = True
        self._errors.report(
            f"{where} failed: {type(exc).__name__}: {exc}; zdiag stops collecting on this rank"
        )
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._unit_ranges.close()
        self._window.abandon()

    # ----------------------------------------------------------------- OOM and the manifest part
    def on_out_of_memory(self, exc: BaseException) -> None:
        """Write the memory data first (profiler window, snapshot, OOM record), then mark the rank."""
        if not self.owned_here():
            return
        self.oom = True
        self.oom_record_written = capture_out_of_memory(
            exc,
            self.run_dir,
            self.who,
            self.step_index,
            self._window,
            self._errors,
            self._model.model_id if self._model is not None else None,
        )
        error = f"{type(exc).__name__}: {str(exc)[:500]}"
        self._errors.guard("manifest part", self._write_part, None, error)

    def _on_run_info(self, info: dict[str, Any]) -> None:
        self._feed.on_run_info(info)
        if info and not self._finished:
            self._write_part_contained()

    def _write_part_contained(self) -> None:
        self._errors.guard("manifest part", self._write_part, None, None)

    def _write_part(self, exit_code: int | None, error: str | None) -> None:
        if not self.owned_here():  # a forked child never writes the parent's part
            return
        ended = self._finished
        write_rank_part(
            self.run_dir,
            self.who,
            self.config,
            backend=self.backend,
            ended=ended,
            **self._window.files(),
            oom_record=rundir.oom_relpath(self.rank) if self.oom_record_written else None,
            step_log=rundir.step_log_relpath(self.rank) if self._step_log.written else None,
            steps=self.step_index,
            step_log_truncated=self._step_log.truncated,
            exit_code=exit_code if ended else None,
            oom=self.oom,
            error=error,
            error_source=self.error_source,
            group_threads=self._recorded_group_threads(),
            collector_errors=tuple(self._errors.messages),
            **self._failures.entry_fields(),
        )

    def _pipeline_info(self) -> PipelineInfo | None:
        """The pipeline stages and schedules recorded so far (its failure reported once)."""
        recorder = self._pipeline
        if recorder is None:
            return None
        if recorder.error is not None:
            self._errors.report(f"pipeline stages not recorded: {recorder.error}")
            recorder.uninstall()
            self._pipeline = None
            return None
        return recorder.recorded()

    def _recorded_group_threads(self) -> dict[str, list[int]] | None:
        """{group name: thread ids} of the gloo groups seen so far (its failure reported once)."""
        recorder = self._group_threads
        if recorder is None:
            return None
        if recorder.error is not None:
            self._errors.report(f"process-group threads stopped: {recorder.error}")
            self._group_threads = None
            return None
        return recorder.recorded()
