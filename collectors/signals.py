"""Write what a rank recorded when it is told to stop (SIGTERM, SIGINT), even mid-collective.

torchrun tears down the peers of a failed rank with SIGTERM and, `PContext.close`'s grace period
later (30 s by default), SIGKILL. A Python signal handler runs only when the training thread
returns to the interpreter, which a rank blocked in a collective never does. So two paths write
the rank's data, whichever comes first:

- the training thread: zdiag's SIGTERM handler flushes, then re-raises the signal with the
  default action, so the process still ends "killed by SIGTERM" as torchrun expects;
- a watcher thread woken through `signal.set_wakeup_fd` the moment the signal arrives: if the
  training thread has not started flushing within `MAIN_THREAD_GRACE_S`, it flushes itself and,
  when zdiag's handler is still the one installed, ends the process with exit code 143 (128 +
  SIGTERM: off the main thread Python cannot restore the default action to re-raise it).

SIGINT keeps Python's KeyboardInterrupt (the bootstrap finishes the session on it); the watcher
only writes the data if the training thread does not, and never ends the process, so a script
that catches KeyboardInterrupt to stop gracefully keeps doing so. A handler the script installs
itself for SIGTERM replaces zdiag's: then the watcher writes the data and leaves the rest to it.

A second SIGTERM while the flush runs (a launcher, `timeout` or Slurm signalling the whole process
group while `zdiag run` forwards its own) is remembered, not run: the flush in progress completes
and the process then ends by the signal. (A handler re-entered on the same thread used to wait
for its own flush to finish, forever.)

In a forked child, `disarm_in_forked_child` puts SIGTERM and the wakeup fd back as they were
before zdiag: the wakeup pipe is shared with the parent, so a signal to the child (a
multiprocessing worker's `terminate()`) would otherwise wake the parent's watcher, which flushed
and ended the *parent* with 143.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

MAIN_THREAD_GRACE_S = 1.0
"""How long the watcher lets the training thread start the flush before doing it itself."""


class SignalFlush:
    """Calls `flush(reason)` once on SIGTERM/SIGINT, from whichever thread can (module docstring).

    `flush` must be safe to call from any thread and idempotent. Only the main thread can install
    it (a Python rule); elsewhere `install()` returns False and nothing changes.
    """

    def __init__(self, flush: Callable[[str], None]) -> None:
        self._flush = flush
        self._started = threading.Event()
        self._done = threading.Event()
        self._lock = threading.RLock()  # a handler may interrupt its own thread inside it
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._previous_wakeup = -1
        self._installed = False
        self._deferring = False
        self._pending: int | None = None
        self._flushing_thread: int | None = None  # the thread that runs (or ran) the flush

    def install(self) -> bool:
        """Install the SIGTERM handler and the watcher (True), or do nothing off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            return False  # the process already handles SIGTERM its own way
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read_fd)
            os.close(write_fd)
            return False
        self._read_fd, self._write_fd = read_fd, write_fd
        signal.signal(signal.SIGTERM, self._on_sigterm)
        threading.Thread(target=self._watch, name="zdiag-signal-flush", daemon=True).start()
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Put SIGTERM and the wakeup fd back as they were (main thread; idempotent)."""
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._installed = False
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            signal.set_wakeup_fd(self._previous_wakeup)
        except (ValueError, OSError):
            pass
        if self._write_fd is not None:
            os.close(self._write_fd)  # the watcher sees end-of-file and exits
            self._write_fd = None

    def defer(self) -> None:
        """The training thread is writing everything itself (the session is finishing): a SIGTERM
        from now on only waits for it, and `end_deferral()` re-raises it afterwards."""
        with self._lock:
            self._started.set()
            self._deferring = True

    def end_deferral(self) -> None:
        """Uninstall; if SIGTERM came while deferring, end the process by it now."""
        self._done.set()
        self.uninstall()
        if self._pending is not None and threading.current_thread() is threading.main_thread():
            _die_by(self._pending)

    def flush_once(self, reason: str) -> None:
        """Run the flush unless it ran or is running (then wait for it to finish, unless this
        very thread runs it: a handler re-entered inside the flush returns at once).

        The flushing thread is named before the flush counts as started, and stays named: a
        second SIGTERM on the same thread at any point (even inside the lock, which is
        re-entrant) never waits for a flush that can only finish after it returns."""
        me = threading.get_ident()
        with self._lock:
            first = not self._started.is_set()
            if first:
                self._flushing_thread = me
                self._started.set()
        if not first:
            if self._flushing_thread != me:
                self._done.wait()  # another thread flushes: wait for it
            return
        try:
            self._flush(reason)
        except Exception:
            pass
        finally:
            self._done.set()

    def disarm_in_forked_child(self) -> None:
        """In a forked child: SIGTERM and the wakeup fd as they were before `install`, and the
        child's copies of the pipe closed; the parent's handler and watcher are untouched."""
        if not self._installed:
            return
        self._installed = False
        self._deferring = False
        self._pending = None
        try:
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError):
            pass
        try:
            current = signal.set_wakeup_fd(-1)
            # Someone else's wakeup fd set after ours stays; ours gives way to the one before it.
            signal.set_wakeup_fd(self._previous_wakeup if current == self._write_fd else current)
        except (ValueError, OSError):
            pass
        for fd in (self._read_fd, self._write_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._read_fd = self._write_fd = None

    # --- the two paths -------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._deferring:  # the session is finishing on this thread: let it complete first
            self._pending = signum
            return
        if self._flushing_thread == threading.get_ident():
            # A second SIGTERM inside this thread's flush: the outer handler ends the process
            # once the flush is done.
            self._pending = signum
            return
        self.flush_once("SIGTERM")
        _die_by(signum)

    def _watch(self) -> None:
        fd = self._read_fd
        if fd is None:
            return
        try:
            while True:
                data = os.read(fd, 64)
                if not data:
                    break
                for signum in data:
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        self._after_signal(signum)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _after_signal(self, signum: int) -> None:
        if self._started.wait(MAIN_THREAD_GRACE_S):
            return  # the training thread is on it
        name = signal.Signals(signum).name
        self.flush_once(f"{name} (the training thread was blocked)")
        if signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            os._exit(128 + signum)  # off the main thread a handler cannot be reset: exit 143


def _die_by(signum: int) -> None:
    """End the process by `signum` with its default action (the exit status torchrun expects)."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
