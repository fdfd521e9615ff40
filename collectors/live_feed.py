"""The rank's side of `zdiag run --monitor`: one live record per step, a hang, the end.

Off (no monitor address in the environment) it costs one attribute test per step. On, each
step's record carries its time, memory, throughput and compute/comm split (`comm_split.py`).
"""

from __future__ import annotations

import os
from typing import Any

from zdiag.live.wire import ENV_MONITOR

from . import memory
from .error_log import ErrorLog
from .hang import hang_line
from .run_records import HangRecord


class LiveFeed:
    """Publishes rank `rank`'s live records when a monitor listens (see the module docstring)."""

    def __init__(self, rank: int, host: str, errors: ErrorLog) -> None:
        self.rank = rank
        self.host = host
        self.errors = errors
        self._publisher: Any = None
        self._comm_timer: Any = None  # the comm split's timer, only while publishing
        self._samples_per_step: float | None = None

    @property
    def on(self) -> bool:
        """Whether records are published."""
        return self._publisher is not None

    def start(self) -> None:
        """Connect to the monitor named in the environment, if any (and time collectives)."""
        if not os.environ.get(ENV_MONITOR):
            return
        try:
            from zdiag.live.publisher import publisher_from_env
        except ImportError as exc:
            self.errors.report(f"live metrics are off: {exc}")
            return
        self._publisher = publisher_from_env(self.rank, self.host)
        if self._publisher is not None:
            from .comm_split import CommTimer

            self._comm_timer = CommTimer().install()

    def on_run_info(self, info: dict[str, Any]) -> None:
        """The script's run info: samples per step (or the harness's batch) give throughput."""
        sps = info.get("samples_per_step")
        harness = info.get("harness")
        if sps is None and isinstance(harness, dict):
            sps = harness.get("batch")  # the harness: sequences per rank and step
        self._samples_per_step = float(sps) if isinstance(sps, (int, float)) and sps > 0 else None

    def publish_step(
        self,
        step: int,
        start: float,
        end: float,
        reading: tuple[int | None, int | None, int | None],
        cuda: bool,
        capture: dict[str, Any] | None = None,
    ) -> None:
        """The step's live record (`start`, `end`: perf_counter seconds; `reading`: allocated,
        reserved and peak bytes), with its comm split and the rank's latest triggered capture
        (`capture`: capture_id, capture_state, capture_path)."""
        duration_ms = (end - start) * 1000.0
        samples_per_s = None
        if self._samples_per_step and duration_ms > 0:
            samples_per_s = self._samples_per_step / (duration_ms / 1000.0)
        allocated, reserved, peak = reading
        record = {
            "rank": self.rank,
            "host": self.host,
            "step": step,
            "step_time_ms": duration_ms,
            "mem_allocated_bytes": allocated,
            "mem_reserved_bytes": reserved,
            "mem_peak_bytes": peak,
            "mem_source": memory.memory_source(cuda),
            "samples_per_s": samples_per_s,
        }
        split = self._comm_timer.take(start, end) if self._comm_timer is not None else None
        if split is not None:
            record.update(split._asdict())
        elif self._comm_timer is not None:  # it switched itself off: say why, once
            self.errors.report(f"comm split stopped: {self._comm_timer.error}")
            self._comm_timer = None
        if capture:
            record.update(capture)
        self._publisher.publish(record)

    def capture_request(self) -> dict[str, Any] | None:
        """The monitor's latest capture request (`collectors.capture_window`), if any."""
        return getattr(self._publisher, "capture_request", None)

    def publish_hang(self, hang: HangRecord) -> None:
        """One record saying where the rank is stuck (the monitor shows "hung in ...")."""
        if self._publisher is not None:
            self._publisher.publish(
                {
                    "rank": self.rank,
                    "host": self.host,
                    "step": hang.step,
                    "hung_in": hang_line(hang),
                }
            )

    def finish(self, step: int, ended: str) -> None:
        """The end-of-run record (the monitor shows the rank `ended`: "finished" or "failed"),
        then the connection and the collective timing are closed."""
        if self._comm_timer is not None:
            self.errors.guard("comm split", self._comm_timer.uninstall)
            self._comm_timer = None
        if self._publisher is not None:
            record = {"rank": self.rank, "host": self.host, "step": step, "ended": ended}
            self.errors.guard("live publisher", self._publisher.publish, record)
            self.errors.guard("live publisher", self._publisher.close)
            self._publisher = None

    def remove_comm_timer(self) -> None:
        """Stop timing collectives (in a forked child: its hooks are plain removals)."""
        if self._comm_timer is not None:
            self._comm_timer.uninstall()
            self._comm_timer = None

    def disarm_in_forked_child(self) -> tuple[Any, ...]:
        """In a forked child: drop the parent's publisher uncalled; what to keep alive."""
        inherited, self._publisher = self._publisher, None
        return (inherited,)
