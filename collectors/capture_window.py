"""Triggered captures: a short profiler window at the step the monitor names, on every rank.

The monitor sends a capture request (`zdiag.live.wire.decode_control`: an id, a start step S, a
number of steps K) when one of its anomaly rules fires or a person asks; every rank's publisher
keeps the latest one. At each step end the session hands it here (`step`), which costs one
comparison when nothing is asked. When step S starts, the rank starts a profiler (one warm-up
step, then K recorded steps: S+1..S+K, numbered as in the step log), exports the trace to
`RUN_DIR/captures/capture-<id>/rank-<N>.json.gz` and starts its in-job summary, as for the fixed
window. Every rank starts at the same step, so the captures line up.

Bounds: at most `MAX_CAPTURES` per run; a request that arrives more than `LATE_STEPS` steps after
its start step, or while the fixed profiler window is still open (one profiler at a time), is
skipped. The rank's latest capture (`status`: id, state, path) rides on each later live record,
so the monitor sees it even if a record is dropped. Errors are contained: the capture is marked
failed and training goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zdiag.live.wire import MAX_CAPTURES_PER_RUN as MAX_CAPTURES

from . import rundir, summary_job
from .error_log import ErrorLog
from .fsio import write_atomically
from .profiler_window import align_step, profiler_activities

MAX_REQUESTS_SEEN = 64
LATE_STEPS = 2
"""A request whose start step passed by more than this is skipped (the ranks would not align)."""


class CaptureWindow:
    """Rank `rank`'s triggered captures (see the module docstring). `busy` says whether the
    fixed profiler window is still open."""

    def __init__(
        self, run_dir: Path, rank: int, errors: ErrorLog, *, busy: Callable[[], bool]
    ) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.errors = errors
        self._busy = busy
        self._prof: Any = None
        self._seen: set[int] = set()
        self._taken = 0
        self._current: dict[str, Any] | None = None
        self._exported = False
        self.status: dict[str, Any] = {}  # capture_id, capture_state, capture_path

    def step(self, step_index: int, request: dict[str, Any] | None) -> None:
        """At a step end (`step_index`: the step now starting), with the latest request."""
        if self._prof is not None:
            if self._exported:  # the trace is written: stop the profiler (as the fixed window)
                prof, self._prof = self._prof, None
                self.errors.guard("capture", prof.stop)
            else:
                self.errors.guard("capture", self._prof.step)
            return
        if request is None or request["id"] in self._seen or step_index < request["step"]:
            return
        if len(self._seen) >= MAX_REQUESTS_SEEN:  # bounded, whatever a monitor sends
            return
        self._seen.add(request["id"])
        if step_index > request["step"] + LATE_STEPS:
            self._mark(request["id"], "skipped")
            self.errors.report(f"capture {request['id']} skipped: its start step had passed")
        elif self._taken >= MAX_CAPTURES:
            self._mark(request["id"], "skipped")
        elif self._busy() or torch.autograd._profiler_enabled():
            self._mark(request["id"], "skipped")  # one profiler at a time
        else:
            self._taken += 1
            self._current = request
            self._mark(request["id"], "recording")
            if self.errors.guard("capture", self._start, step_index, request["steps"]) is None:
                if self._prof is None:
                    self._mark(request["id"], "failed")

    def trace_path(self, capture_id: int) -> Path:
        """Where capture `capture_id`'s trace of this rank goes."""
        return self.run_dir / rundir.capture_trace_relpath(capture_id, self.rank)

    def _mark(self, capture_id: int, state: str, path: Path | None = None) -> None:
        self.status = {
            "capture_id": capture_id,
            "capture_state": state,
            "capture_path": str(path) if path is not None else None,
        }

    def _start(self, at_step: int, steps: int) -> None:
        prof: Any = torch.profiler.profile(
            activities=profiler_activities(),
            # skip_first: the schedule counts from step 0, and this window starts at `at_step`
            schedule=torch.profiler.schedule(
                wait=0, warmup=1, active=steps, repeat=1, skip_first=at_step
            ),
            on_trace_ready=self._on_trace_ready,
        )
        align_step(prof, at_step)
        self._exported = False
        self._prof = prof
        prof.start()

    def _on_trace_ready(self, prof: Any) -> None:
        request = self._current or {"id": -1}
        path = self.trace_path(request["id"])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, prof.export_chrome_trace, suffix=".json.gz")
            self.errors.guard("in-job summary", summary_job.start_summary, path)
            self._mark(request["id"], "done", path)
        except Exception as exc:
            self._mark(request["id"], "failed")
            self.errors.report(
                f"capture {request['id']} export failed: {type(exc).__name__}: {exc}"
            )
        finally:
            self._exported = True

    def close(self) -> None:
        """At the end of the run: stop a capture still recording (its steps so far are exported)."""
        prof, self._prof = self._prof, None
        if prof is not None:
            self.errors.guard("capture", prof.stop)  # exports what it recorded, if not yet
