"""A rank told to stop (SIGTERM, SIGINT) or stuck (the hang watchdog): what it was doing, and
what it recorded, written before it is killed.

On a signal (`signals.py` says from which thread) the training thread's stack is noted
(`stopped_in`: a rank torn down while stuck outside any collective is how a hang ends when a
collective timeout fires first); on a hang the watchdog's thread dumps every stack, the
collective and the flight recorder (`hang`). Either way the partial profiler window, the step log
and the manifest part are written at once, before torchrun's SIGKILL (docs/run.md gives the time
budget).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import rundir
from .error_log import ErrorLog
from .fsio import write_json_atomically
from .hang import HangWatchdog, describe_hang, hang_record
from .live_feed import LiveFeed
from .profiler_window import ProfilerWindow
from .run_records import HangRecord
from .signals import SignalFlush
from .step_clock import StepClock


class FailureWrites:
    """The signal handler and the hang watchdog of rank `rank`; `write_part` writes its
    manifest part (errors contained)."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        clock: StepClock,
        window: ProfilerWindow,
        feed: LiveFeed,
        errors: ErrorLog,
        *,
        write_part: Callable[[], None],
        owned_here: Callable[[], bool],
    ) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.clock = clock
        self.window = window
        self.feed = feed
        self.errors = errors
        self._write_part = write_part
        self._owned_here = owned_here
        self._main_thread = threading.get_ident()
        self.ended_by: str | None = None
        self.hang: HangRecord | None = None
        self.stopped_in: HangRecord | None = None
        self._signals = SignalFlush(self._on_signal)
        self._watchdog: HangWatchdog | None = None

    def install(self, hang_timeout_s: float | None) -> None:
        """Install the signal handler and start the watchdog (unless `hang_timeout_s` is 0)."""
        self.errors.guard("signal handler", self._signals.install)
        if hang_timeout_s != 0:
            self._watchdog = HangWatchdog(self._on_hang, hang_timeout_s).start()

    def beat(self, step_duration_s: float) -> None:
        """A step finished."""
        if self._watchdog is not None:
            self._watchdog.beat(step_duration_s)

    def begin_finish(self) -> None:
        """The session finishes: no more hang dumps, and a SIGTERM now waits for its writes."""
        if self._watchdog is not None:
            self._watchdog.stop()
        self._signals.defer()

    def end_finish(self) -> None:
        """The session's writes are done: a SIGTERM that came meanwhile now ends the rank."""
        self._signals.end_deferral()

    def entry_fields(self) -> dict[str, Any]:
        """The manifest entry's fields these paths set."""
        return {"ended_by": self.ended_by, "hang": self.hang, "stopped_in": self.stopped_in}

    # ----------------------------------------------------------------- the two paths
    def _on_signal(self, reason: str) -> None:
        """SIGTERM/SIGINT (from any thread): note where the training thread was, then write."""
        if not self._owned_here():
            return
        self.ended_by = reason
        self.errors.guard("stack at the signal", self._note_where_stopped)
        self._write_what_was_recorded(f"ended by {reason}")

    def _note_where_stopped(self) -> None:
        dump = describe_hang(self._main_thread)
        rel = rundir.hang_relpath(self.rank)
        since_step = self.clock.since_step_start()
        self.stopped_in = hang_record(dump, self.clock.step_index, since_step, 0.0, rel)
        if self.hang is None:  # keep the watchdog's dump when there is one
            write_json_atomically(self.run_dir / rel, {**self.stopped_in.to_json(), **dump})

    def _on_hang(self, stalled_s: float, timeout_s: float) -> None:
        """The watchdog's callback (its own thread): dump the stacks, the collective and the
        flight recorder, then write."""
        if not self._owned_here():
            return
        dump = describe_hang(self._main_thread)
        rel = rundir.hang_relpath(self.rank)
        path = self.run_dir / rel
        self.hang = hang_record(dump, self.clock.step_index, stalled_s, timeout_s, rel)
        self.errors.guard("hang dump", write_json_atomically, path, {**self.hang.to_json(), **dump})
        if self.feed.on:
            self.errors.guard("live publisher", self.feed.publish_hang, self.hang)
        print(
            f"zdiag (rank {self.rank}): no step finished for {stalled_s:.0f} s (hang timeout "
            f"{timeout_s:.0f} s); stacks written to {path}",
            file=sys.stderr,
            flush=True,
        )
        self._write_what_was_recorded("hang")

    def _write_what_was_recorded(self, why: str) -> None:
        self.window.close_from_any_thread(why)
        self._write_part()

    # ----------------------------------------------------------------- forked child
    def release_in_forked_child(self) -> tuple[Any, ...]:
        """In a forked child: drop the parent's watchdog uncalled; what to keep alive."""
        inherited, self._watchdog = self._watchdog, None
        return (inherited,)

    def disarm_signals_in_forked_child(self) -> None:
        """In a forked child: put the signal handler and the wakeup fd back (see signals.py)."""
        self._signals.disarm_in_forked_child()
