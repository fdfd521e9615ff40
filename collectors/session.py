"""One rank's collection session: step detection, the profiler, the step log, memory and OOM data.

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

A forked child (`os.fork`, multiprocessing's "fork" start method, DataLoader workers) inherits the
session but none of its threads: `os.register_at_fork` disarms it in the child at once (hooks
removed, signal handler and wakeup fd put back, step log descriptor closed, no profiler call), and
every path that writes checks the process id, so a child never writes the parent's files, runs
its teardown, or waits on a thread that exists only in the parent. `exit_forked_child` ends such
a child without C `exit()` (see there why).
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerAction

from . import memory, memtimeline, run_records, rundir, runinfo, summary_job
from .compile_safe import eager_or_opaque
from .config import CollectorConfig
from .fsio import write_atomically, write_json_atomically
from .hang import (
    HangWatchdog,
    describe_hang,
    hang_line,
    hang_record,
    raised_at,
)
from .live_wire import ENV_MONITOR
from .manifest import hostname, process_env_info, utc_now_iso
from .model_capture import ModelCapture
from .nvtx import StepRanges, UnitRanges
from .signals import SignalFlush
from .steplog import StepLog

MAX_COLLECTOR_ERRORS = 10

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


def torch_versions() -> dict[str, str | None]:
    """Python, torch, CUDA and NCCL versions (None where not present)."""
    nccl: str | None = None
    try:
        if torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception:
        nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
    }


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
        env = process_env_info()
        self.rank: int = env["rank"]
        self.local_rank: int = env["local_rank"]
        self.node_rank: int = env["node_rank"]
        self.world_size: int = env["world_size"]
        self.host = hostname()
        self.command = command if command is not None else [sys.executable, *sys.argv]
        self.started_at = utc_now_iso()
        self.step_index = 0
        self.manual = not auto_step
        self.oom = False
        self.backend: str | None = None
        self.collector_errors: list[str] = []
        self.trace_written = False
        self.timeline_written = False
        self.timeline_categorized: bool | None = None
        self._timeline_pending: Any = None  # the closed window's profiler, timeline not written
        self.snapshot_written = False
        self.oom_record_written = False
        self._broken = False
        self._finished = False
        self._driver: int | None = None
        self._hook: Any = None
        self._remove_listener: Any = None
        self._prof: Any = None
        self._cuda_history = False
        self._profiler_pending = False
        self._window_done = False
        self._forward_hook: Any = None
        self._model: ModelCapture | None = None  # the model description's one-shot hooks
        self._publisher: Any = None
        self._comm_timer: Any = None  # the comm split's timer, only while publishing
        self._samples_per_step: float | None = None
        self._step_log = StepLog(
            self.run_dir / rundir.step_log_relpath(self.rank), config.max_step_log_lines
        )
        self._nvtx = StepRanges(config.nvtx)
        self._unit_ranges = UnitRanges(config.nvtx, self._report)
        self._cuda = torch.cuda.is_available()
        self._dist = dist.is_available()
        self._step_start = time.perf_counter()
        # Failure paths (signals, the hang watchdog) may write from another thread: one lock
        # around the profiler's state; the step hook takes it uncontended (~0.1 µs).
        self._lock = threading.RLock()
        self._main_thread = threading.get_ident()
        self._prof_all_threads = False  # whether another thread may stop the profiler
        self.ended_by: str | None = None
        self.hang: run_records.HangRecord | None = None
        self.stopped_in: run_records.HangRecord | None = None
        self.error_source: run_records.SourceLine | None = None
        self._signals = SignalFlush(self._flush_on_signal)
        self._watchdog: HangWatchdog | None = None
        self._step_log_failed = False
        self._pid = os.getpid()  # the process that owns the run directory's files for this rank
        self.forked_child = False  # set in a forked child by `disarm_in_forked_child`
        self._inherited: tuple[Any, ...] = ()  # the parent's objects, kept alive, never touched

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
        self._guard("live publisher", self._start_publisher)
        self._model = self._guard(
            "model description", ModelCapture(self.run_dir, self.rank, self._report).arm
        )
        if self.config.profile:
            # The profiler (and CUDA history) start at the first module forward, or at the first
            # step end if no module runs forward before it: after the script's own set-up
            # (device selection, process group, model build), which stays out of the trace.
            self._profiler_pending = True
            self._forward_hook = register_module_forward_pre_hook(
                eager_or_opaque(self._on_first_forward)
            )
        if self.auto_step:
            self._hook = register_optimizer_step_post_hook(eager_or_opaque(self._on_optimizer_step))
        self._unit_ranges.watch()
        self._nvtx.begin(0)
        self._guard("signal handler", self._signals.install)
        if self.config.hang_timeout_s != 0:
            self._watchdog = HangWatchdog(self._on_hang, self.config.hang_timeout_s).start()
        self._step_start = time.perf_counter()
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
        if self._watchdog is not None:
            self._watchdog.stop()
        self._signals.defer()  # a SIGTERM now waits for this method's writes, then ends the rank
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._remove_listener is not None:
            self._remove_listener()
        self._remove_forward_hook()
        if self._model is not None:
            self._model.disarm()
        self._guard("NVTX", self._unit_ranges.close)
        self._guard("NVTX", self._nvtx.end)
        with self._lock:
            self._guard("profiler", self._close_window)
        self._export_pending_timeline()
        if self._cuda_history:
            self._guard("CUDA memory history", memory.stop_cuda_history)
        self._guard("step log", self._step_log.close)
        if self._comm_timer is not None:
            self._guard("comm split", self._comm_timer.uninstall)
            self._comm_timer = None
        if self._publisher is not None:
            ended = "finished" if exit_code == 0 and error is None else "failed"
            self._guard("live publisher", self._publish_end, ended)
            self._guard("live publisher", self._publisher.close)
            self._publisher = None
        if exc is not None:
            self.error_source = self._guard("traceback", raised_at, exc)
        # Never let zdiag's own output (a full disk, say) replace the training's outcome.
        self._guard("manifest part", self._write_part, exit_code, error)
        if _ACTIVE is self:
            _ACTIVE = None
        _SESSIONS.discard(self)
        self._signals.end_deferral()

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
        self._profiler_pending = False
        self._lock = threading.RLock()  # the parent's may be held by a thread that is not here
        # Kept alive, never called: dropping the last reference would run their destructors.
        self._inherited = (self._prof, self._timeline_pending, self._publisher, self._watchdog)
        self._prof = self._timeline_pending = self._publisher = self._watchdog = None
        for undo in (
            self._signals.disarm_in_forked_child,
            self._step_log.detach,
            self._remove_hooks,
        ):
            try:
                undo()
            except Exception:
                pass

    def _remove_hooks(self) -> None:
        """Remove the optimizer, forward and model hooks, the comm split and the run-info
        listener (in a forked child)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._remove_forward_hook()
        if self._model is not None:
            self._model.disarm()
        if self._remove_listener is not None:
            self._remove_listener()
            self._remove_listener = None
        if self._comm_timer is not None:
            self._comm_timer.uninstall()
            self._comm_timer = None

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
            now = time.perf_counter()
            duration_ms = (now - self._step_start) * 1000.0
            self._step_start = now
            step = self.step_index
            self.step_index += 1
            if self._watchdog is not None:
                self._watchdog.beat(duration_ms / 1000.0)
            self._unit_ranges.step_end()
            self._nvtx.end()
            allocated, reserved, peak = (
                self._guard("memory reader", memory.read_device_memory, self._cuda)
                or memory.NO_READING
            )
            log = self._step_log
            if not log.write_step(step, time.time(), duration_ms, allocated, reserved, peak):
                if log.error is not None and not self._step_log_failed:
                    self._step_log_failed = True  # only the step log stops; the rest goes on
                    self._report(f"step log write failed ({log.error}); the step log stops here")
            if self._publisher is not None:
                self._publish(step, now - duration_ms / 1000.0, now, allocated, reserved, peak)
            if self.backend is None and self._dist and dist.is_initialized():
                self.backend = str(dist.get_backend())
                if self._prof is not None:
                    self._prof.preset_metadata.pop("distributedInfo", None)
            with self._lock:
                if self._prof is not None:
                    self._prof.step()
                    if self._window_done:
                        self._stop_profiler()
                elif self._profiler_pending:
                    self._arm_profiler(self.step_index)
            self._nvtx.begin(self.step_index)
        except Exception as exc:
            self._fail("step hook", exc)

    def _publish(
        self,
        step: int,
        start: float,
        end: float,
        allocated: int | None,
        reserved: int | None,
        peak: int | None,
    ) -> None:
        """The step's live record (`start`, `end`: perf_counter seconds), with its comm split."""
        duration_ms = (end - start) * 1000.0
        samples_per_s = None
        if self._samples_per_step and duration_ms > 0:
            samples_per_s = self._samples_per_step / (duration_ms / 1000.0)
        record = {
            "rank": self.rank,
            "host": self.host,
            "step": step,
            "step_time_ms": duration_ms,
            "mem_allocated_bytes": allocated,
            "mem_reserved_bytes": reserved,
            "mem_peak_bytes": peak,
            "mem_source": memory.memory_source(self._cuda),
            "samples_per_s": samples_per_s,
        }
        split = self._comm_timer.take(start, end) if self._comm_timer is not None else None
        if split is not None:
            record.update(split._asdict())
        elif self._comm_timer is not None:  # it switched itself off: say why, once
            self._report(f"comm split stopped: {self._comm_timer.error}")
            self._comm_timer = None
        self._publisher.publish(record)

    def _publish_end(self, ended: str) -> None:
        """The end-of-run record: the monitor shows the rank "finished" (or "failed")."""
        self._publisher.publish(
            {
                "rank": self.rank,
                "host": self.host,
                "step": max(0, self.step_index - 1),
                "ended": ended,
            }
        )

    # ----------------------------------------------------------------- profiler
    def _on_first_forward(self, module: Any, args: Any) -> None:
        self._remove_forward_hook()
        if self._profiler_pending and not self._broken:
            self._arm_profiler(self.step_index)

    def _remove_forward_hook(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def _arm_profiler(self, at_step: int) -> None:
        """Start the profiler (and the CUDA allocator history) as of step `at_step`."""
        self._profiler_pending = False
        self._remove_forward_hook()
        if torch.autograd._profiler_enabled():
            # Only one profiler can run: the script's own torch.profiler has it.
            self._report("the script runs torch.profiler itself, so zdiag records no trace")
            return
        self._guard("profiler", self._start_profiler, at_step)
        if self.config.profile_memory:
            self._cuda_history = bool(
                self._guard(
                    "CUDA memory history",
                    memory.start_cuda_history,
                    self.config.max_snapshot_entries,
                )
            )

    def _start_profiler(self, at_step: int = 0) -> None:
        cfg = self.config
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # The memory timeline needs shapes and stacks as well (torch.profiler's requirement).
        need_mem = cfg.profile_memory
        self._prof = torch.profiler.profile(
            activities=activities,
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
        if not (self._dist and dist.is_initialized()):
            self._prof.preset_metadata_json("distributedInfo", json.dumps(fallback))
        if at_step > 0:
            # Started after step 0 (no module forward before it ended): align the profiler's step
            # counter, so ProfilerStep#n still names step n of the step log.
            action = self._prof.schedule(at_step)
            self._prof.step_num = at_step
            self._prof.current_action = action
            if hasattr(self._prof, "_prev_schedule_action"):
                self._prof._prev_schedule_action = action
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
            self._prof_all_threads = False
            return {}
        self._prof_all_threads = True
        return {"experimental_config": config}

    def _stop_profiler(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prof.stop()

    def _close_window(self) -> None:
        """Stop the profiler keeping what it recorded: an active window is exported by the
        profiler's own callback; a window stopped in warmup (a crash, a signal, a hang before the
        active steps) is exported here, so the steps recorded so far are not lost."""
        prof = self._prof
        if prof is None:
            return
        recording = prof.current_action != ProfilerAction.NONE
        self._stop_profiler()
        if recording and not self.trace_written:
            self._on_trace_ready(prof)

    def _can_stop_profiler_here(self) -> bool:
        return threading.get_ident() == self._main_thread or self._prof_all_threads

    def _on_trace_ready(self, prof: Any) -> None:
        if not self.owned_here():
            return
        try:
            trace = self.run_dir / rundir.trace_relpath(self.rank)
            write_atomically(trace, prof.export_chrome_trace, suffix=".json.gz")
            self.trace_written = True
            self._guard("in-job summary", summary_job.start_summary, trace)
            if self.config.profile_memory:
                # The timeline export takes seconds (11 s for a 2-rank harness window): it waits
                # for the end of the run (or an OOM) instead of stalling a training step.
                self._timeline_pending = prof
                self._dump_window_snapshot()
            self._write_part(exit_code=None, error=None)
        except Exception as exc:
            # Only the profiler's output is lost: steps are still detected and logged.
            self._report(f"trace export failed: {type(exc).__name__}: {exc}; no trace on this rank")
        finally:
            self._window_done = True

    def _export_pending_timeline(self) -> None:
        prof, self._timeline_pending = self._timeline_pending, None
        if prof is None:
            return
        timeline = self.run_dir / rundir.memory_timeline_relpath(self.rank)
        device = memory.device_in_use()
        failure = self._guard(
            "memory timeline", memtimeline.export_timeline, prof, timeline, device
        )
        self.timeline_written = timeline.is_file()
        if self.timeline_written:
            self.timeline_categorized = failure is None
            if failure is not None:
                self._report(
                    f"torch's memory profiler could not sort this rank's memory into categories "
                    f"({failure}); its memory timeline holds total bytes only (docs/run.md)"
                )

    def _dump_window_snapshot(self) -> None:
        if self._cuda_history:
            snap = self.run_dir / rundir.memory_snapshot_relpath(self.rank)
            self.snapshot_written = bool(
                self._guard("memory snapshot", memory.dump_cuda_snapshot, snap)
            )

    # ----------------------------------------------------------------- OOM
    def on_out_of_memory(self, exc: BaseException) -> None:
        """Write the memory data first (profiler window, snapshot, OOM record), then mark the rank."""
        if not self.owned_here():
            return
        self.oom = True
        allocated, reserved, peak = (
            self._guard("memory reading", memory.read_device_memory, self._cuda)
            or memory.NO_READING
        )
        # Recording (warmup or active), not merely armed and waiting: then the trace covers it.
        window_open = self._prof is not None and self._prof.current_action != ProfilerAction.NONE
        if self._prof is not None:
            # Closing the window exports the trace and, with --profile-memory, the memory timeline.
            self._guard("profiler", self._stop_profiler)
        self._export_pending_timeline()
        if memory.cuda_in_use():  # replaces the window's snapshot: the state at the failure
            snap = self.run_dir / rundir.memory_snapshot_relpath(self.rank)
            dumped = bool(self._guard("memory snapshot", memory.dump_cuda_snapshot, snap))
            self.snapshot_written = dumped or self.snapshot_written
        record = run_records.OomRecord(
            rank=self.rank,
            host=self.host,
            step=self.step_index,
            time_unix=time.time(),
            error_type=type(exc).__name__,
            error=str(exc)[:4000],
            mem_allocated_bytes=allocated,
            mem_reserved_bytes=reserved,
            mem_peak_bytes=peak,
            memory_budget_bytes=runinfo.memory_budget_bytes(runinfo.current_run_info()),
            profiler_window_open=window_open,
        )
        path = self.run_dir / rundir.oom_relpath(self.rank)
        self._guard("OOM record", memory.write_oom_record, path, record)
        self.oom_record_written = path.is_file()
        error = f"{type(exc).__name__}: {str(exc)[:500]}"
        self._guard("manifest part", self._write_part, None, error)

    # ----------------------------------------------------------------- signals and hangs
    def _flush_on_signal(self, reason: str) -> None:
        """SIGTERM/SIGINT (from any thread): note where the training thread was (a rank torn down
        while stuck outside any collective is how a hang ends when a collective timeout fires
        first), then write the partial window, the step log and the manifest part now, before
        torchrun's SIGKILL (docs/run.md gives the time budget)."""
        if not self.owned_here():
            return
        self.ended_by = reason
        self._guard("stack at the signal", self._note_where_stopped)
        self._write_what_was_recorded(f"ended by {reason}")

    def _note_where_stopped(self) -> None:
        dump = describe_hang(self._main_thread)
        rel = rundir.hang_relpath(self.rank)
        since_step = time.perf_counter() - self._step_start
        self.stopped_in = hang_record(dump, self.step_index, since_step, 0.0, rel)
        if self.hang is None:  # keep the watchdog's dump when there is one
            write_json_atomically(self.run_dir / rel, {**self.stopped_in.to_json(), **dump})

    def _on_hang(self, stalled_s: float, timeout_s: float) -> None:
        """The watchdog's callback (its own thread): dump the stacks, the collective and the
        flight recorder, then write the partial window, the step log and the manifest part."""
        if not self.owned_here():
            return
        dump = describe_hang(self._main_thread)
        path = self.run_dir / rundir.hang_relpath(self.rank)
        self.hang = hang_record(
            dump, self.step_index, stalled_s, timeout_s, rundir.hang_relpath(self.rank)
        )
        self._guard("hang dump", write_json_atomically, path, {**self.hang.to_json(), **dump})
        if self._publisher is not None:
            self._guard("live publisher", self._publish_hang, self.hang)
        print(
            f"zdiag (rank {self.rank}): no step finished for {stalled_s:.0f} s (hang timeout "
            f"{timeout_s:.0f} s); stacks written to {path}",
            file=sys.stderr,
            flush=True,
        )
        self._write_what_was_recorded("hang")

    def _publish_hang(self, hang: run_records.HangRecord) -> None:
        """One live record saying where the rank is stuck (the monitor shows "hung in ...")."""
        self._publisher.publish(
            {"rank": self.rank, "host": self.host, "step": hang.step, "hung_in": hang_line(hang)}
        )

    def _write_what_was_recorded(self, why: str) -> None:
        with self._lock:
            if self._prof is not None:
                if self._can_stop_profiler_here():
                    self._guard("profiler", self._close_window)
                else:
                    self._report(
                        f"{why}: the profiler window could not be written from another thread "
                        "(this torch has no profile_all_threads)"
                    )
        self._guard("manifest part", self._write_part, None, None)

    # ----------------------------------------------------------------- helpers
    def _start_publisher(self) -> None:
        if not os.environ.get(ENV_MONITOR):
            return
        try:
            from .live import publisher_from_env
        except ImportError as exc:
            self._report(f"live metrics are off: {exc}")
            return
        self._publisher = publisher_from_env(self.rank, self.host)
        if self._publisher is not None:
            from .comm_split import CommTimer

            self._comm_timer = CommTimer().install()

    def _on_run_info(self, info: dict[str, Any]) -> None:
        sps = info.get("samples_per_step")
        harness = info.get("harness")
        if sps is None and isinstance(harness, dict):
            sps = harness.get("batch")  # the harness: sequences per rank and step
        self._samples_per_step = float(sps) if isinstance(sps, (int, float)) and sps > 0 else None
        if info and not self._finished:
            self._guard("manifest part", self._write_part, None, None)

    def _memory_files(self) -> dict[str, str | None]:
        """The run-dir paths of this rank's memory timeline and snapshot (None: not written)."""
        return {
            "memory_timeline": rundir.memory_timeline_relpath(self.rank)
            if self.timeline_written
            else None,
            "memory_snapshot": rundir.memory_snapshot_relpath(self.rank)
            if self.snapshot_written
            else None,
        }

    def _guard(self, where: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            self._report(f"{where} failed: {type(exc).__name__}: {exc}")
            return None

    def _fail(self, where: str, exc: Exception) -> None:
        """A collector error inside the step path: report once, stop collecting, keep training."""
        self._broken = True
        self._report(
            f"{where} failed: {type(exc).__name__}: {exc}; zdiag stops collecting on this rank"
        )
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._remove_forward_hook()
        self._unit_ranges.close()
        self._profiler_pending = False
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                prof.on_trace_ready = None
                prof.stop()
            except Exception:
                pass

    def _report(self, message: str) -> None:
        if len(self.collector_errors) < MAX_COLLECTOR_ERRORS:
            self.collector_errors.append(message)
            print(
                f"zdiag (rank {self.rank}): {message}; training continues.",
                file=sys.stderr,
                flush=True,
            )

    def _device(self) -> str | None:
        """The device this rank trains on: `cuda:<index>` once it has initialized CUDA, `cpu` if
        it finished without; None while that is not known yet (a part written before CUDA)."""
        device = memory.device_in_use()
        return None if device == "cpu" and not self._finished else device

    def _write_part(self, exit_code: int | None, error: str | None) -> None:
        if not self.owned_here():  # a forked child never writes the parent's part
            return
        ended = self._finished
        files = self._memory_files()
        entry = run_records.RankEntry(
            rank=self.rank,
            local_rank=self.local_rank,
            node_rank=self.node_rank,
            host=self.host,
            pid=os.getpid(),
            device=self._device(),
            trace=rundir.trace_relpath(self.rank) if self.trace_written else None,
            memory_timeline=files["memory_timeline"],
            memory_snapshot=files["memory_snapshot"],
            memory_timeline_categorized=self.timeline_categorized,
            oom_record=rundir.oom_relpath(self.rank) if self.oom_record_written else None,
            step_log=rundir.step_log_relpath(self.rank) if self._step_log.written else None,
            steps=self.step_index,
            step_log_truncated=self._step_log.truncated,
            exit_code=exit_code if ended else None,
            oom=self.oom,
            error=error,
            error_source=self.error_source,
            collector_errors=tuple(self.collector_errors),
            started_at=self.started_at,
            ended_at=utc_now_iso() if ended else None,
            ended_by=self.ended_by,
            hang=self.hang,
            stopped_in=self.stopped_in,
        )
        part = run_records.RankPart(
            entry=entry,
            world_size=self.world_size,
            command=tuple(self.command),
            cwd=os.getcwd(),
            backend=self.backend,
            versions=torch_versions(),
            profile=self.config.manifest_profile(),
            run_info=runinfo.current_run_info(),
        )
        write_json_atomically(rundir.rank_part_path(self.run_dir, self.rank), part.to_json())
