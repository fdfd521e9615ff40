"""Triggered captures, the monitor's side: when to ask every rank for a profile, and what came back.

`ControlSender` binds the monitor's control socket (a ZeroMQ PUB on the data port + 1,
`wire.control_endpoint`), authenticated like the data path: with a token only holders of it
connect (CURVE), without one it listens on loopback only. Ranks subscribe from their publisher's
thread and never wait on it (`zdiag.live.publisher`). Ranks behind a per-node relay subscribe to
the relay's control socket (its port + 1), which re-publishes every valid request it receives
from its upstream's (`zdiag.live.receiver.Relay`), so the requests reach them too, through any
chain of relays.

`CaptureController.update(state, now)`, called by the monitor about twice a second:
- asks for a capture when a rule that names a lasting problem fires (a `chronic` straggler,
  `step-time-creep`), when a person asks (the key `c` in the monitor, or `zdiag capture`, whose
  record arrives on the data path and waits in `state.capture_asks`; no cool-down then): the start
  step is the latest step any rank reported plus `CAPTURE_LEAD_STEPS`, `CAPTURE_STEPS` steps
  recorded, at most `wire.MAX_CAPTURES_PER_RUN` per job and one per `COOLDOWN_S`;
- re-sends the request every `RESEND_S` until every rank answered (a PUB socket drops what a
  subscriber that is still connecting misses; ranks ignore an id they have seen);
- follows each rank's answer on its live records (`capture_state`: recording, done, skipped,
  failed) and, once every rank that was asked is done, analyzes the capture's traces (their
  in-job summaries first) in a background thread: the capture's findings, with the ranks they
  name, are what the monitor shows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from zdiag.errors import ConfigError
from zdiag.live.state import MonitorState
from zdiag.live.wire import (
    MAX_CAPTURES_PER_RUN,
    Endpoint,
    control_endpoint,
    control_pub_socket,
    encode,
)

CAPTURE_LEAD_STEPS = 3
"""The capture starts this many steps after the latest step any rank reported (room for the
request to reach every rank before that step)."""
CAPTURE_STEPS = 3
COOLDOWN_S = 30.0
RESEND_S = 1.0
GIVE_UP_S = 120.0
"""A capture some rank never answered is given up (and reported as such) after this long."""


def _triggering(finding: Any) -> bool:
    """Whether a live finding asks for a capture: a chronic straggler or a creeping step time."""
    if finding.id == "straggler":
        return bool(finding.evidence.get("persistence") == "chronic")
    return bool(finding.id == "step-time-creep")


class ControlSender:
    """The monitor's control socket (see the module docstring)."""

    def __init__(self, data: Endpoint, token: str = "") -> None:
        """Bind next to the data endpoint `data` (`wire.control_pub_socket`); ConfigError when
        that port is taken."""
        self._token = token.encode()
        self._ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        self.endpoint = control_endpoint(data)
        try:
            self._sock, self._guard = control_pub_socket(self._ctx, data, self._token)
        except zmq.ZMQError as exc:
            self._ctx.term()
            raise ConfigError(
                f"the control port {self.endpoint} (the data port + 1, for triggered captures) "
                f"is taken ({exc.strerror}): choose another --listen port or pass --no-capture."
            ) from None

    def send(self, payload: dict[str, Any]) -> None:
        """Publish one control message; never blocks (a full queue drops it)."""
        try:
            self._sock.send_multipart(encode(payload, self._token), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        """Close the socket and its context."""
        self._guard.close()
        self._sock.close(linger=0)
        self._ctx.term()


@dataclass
class Capture:
    """One capture asked of a job's ranks, and what they answered."""

    id: int
    job: str
    step: int
    steps: int
    reason: str
    ranks: list[int]
    requested_at: float
    states: dict[int, str] = field(default_factory=dict)
    paths: dict[int, str] = field(default_factory=dict)
    findings: list[dict[str, Any]] | None = None  # the analysis of the capture, when done
    error: str | None = None
    analyzing: bool = False
    last_sent: float = 0.0

    def answered(self) -> bool:
        """Whether every rank asked has said done, skipped or failed."""
        return all(self.states.get(r) in ("done", "skipped", "failed") for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        """The capture as the monitor's JSON shows it."""
        return {
            "id": self.id,
            "job": self.job,
            "start_step": self.step,
            "steps": self.steps,
            "reason": self.reason,
            "requested_at": round(self.requested_at, 3),
            "ranks": self.ranks,
            "states": {str(r): s for r, s in sorted(self.states.items())},
            "traces": sorted(set(self.paths.values()))[:4],
            "findings": self.findings,
            "error": self.error,
        }


def analyze_capture(paths: list[str]) -> list[dict[str, Any]]:
    """The findings of a capture's traces (their in-job summaries first), with their ranks."""
    from zdiag.analyzers.engine.summary_pipeline import SummaryOptions, analyze_via_summaries

    run = analyze_via_summaries(
        [Path(p) for p in sorted(paths)], SummaryOptions(use_stored=True, write_cache=False)
    )
    return [
        {"id": f.id, "severity": f.severity, "title": f.title, "ranks": f.ranks}
        for f in run.report.findings
    ]


class CaptureController:
    """Decides, sends and follows triggered captures (see the module docstring)."""

    def __init__(
        self,
        send: Callable[[dict[str, Any]], None],
        *,
        analyze: Callable[[list[str]], list[dict[str, Any]]] = analyze_capture,
    ) -> None:
        self._send = send
        self._analyze = analyze
        self.captures: list[Capture] = []

    def request(
        self,
        state: MonitorState,
        now: float,
        reason: str,
        job: str | None = None,
        *,
        manual: bool = False,
    ) -> Capture | None:
        """Ask the job's ranks for a capture now (None when the job has no rank, or its
        captures are used up, or, unless a person asked (`manual`), cooling down)."""
        view = state.view(now, job)
        if not view.rows:
            return None
        mine = [c for c in self.captures if c.job == view.job]
        if len(mine) >= MAX_CAPTURES_PER_RUN:
            return None
        if mine and now - mine[-1].requested_at < COOLDOWN_S and not manual:
            return None
        live = [row for row in view.rows if row.status in ("ok", "straggler")]
        if not live:
            return None
        capture = Capture(
            id=len(self.captures) + 1,
            job=view.job,
            step=max(row.step for row in live) + CAPTURE_LEAD_STEPS,
            steps=CAPTURE_STEPS,
            reason=reason,
            ranks=sorted(row.rank for row in live),
            requested_at=now,
        )
        self.captures.append(capture)
        self._resend(capture, now)
        return capture

    def update(self, state: MonitorState, now: float) -> None:
        """Trigger, re-send, follow the ranks' answers, start analyses (see the module
        docstring)."""
        while state.capture_asks:
            job, why = state.capture_asks.popleft()
            self.request(state, now, f"zdiag capture: {why or 'asked'}", job or None, manual=True)
        view = state.view(now)
        trigger = next((f for f in view.findings if _triggering(f)), None)
        if trigger is not None:
            self.request(state, now, f"{trigger.id}: {trigger.title}")
        for capture in self.captures:
            self._follow(capture, state, now)

    def _follow(self, capture: Capture, state: MonitorState, now: float) -> None:
        job = state.jobs.get(capture.job)
        if job is not None:
            for rank in capture.ranks:
                last = job.ranks[rank].last if rank in job.ranks else {}
                if last.get("capture_id") == capture.id and last.get("capture_state"):
                    capture.states[rank] = str(last["capture_state"])
                    if last.get("capture_path"):
                        capture.paths[rank] = str(last["capture_path"])
        if not capture.answered():
            if now - capture.requested_at > GIVE_UP_S:
                capture.error = capture.error or "some ranks never answered"
            elif now - capture.last_sent >= RESEND_S:
                self._resend(capture, now)
            return
        if capture.findings is None and not capture.analyzing and capture.error is None:
            if not capture.paths:
                capture.error = "no rank recorded it"
                return
            capture.analyzing = True
            threading.Thread(
                target=self._run_analysis, args=(capture,), name="zdiag-capture", daemon=True
            ).start()

    def _resend(self, capture: Capture, now: float) -> None:
        capture.last_sent = now
        self._send(
            {
                "kind": "capture",
                "id": capture.id,
                "job": capture.job,
                "step": capture.step,
                "steps": capture.steps,
                "reason": capture.reason[:120],
            }
        )

    def _run_analysis(self, capture: Capture) -> None:
        try:
            findings = self._analyze(list(capture.paths.values()))
        except Exception as exc:  # a damaged capture is reported, never fatal to the monitor
            capture.error = f"analysis failed: {type(exc).__name__}: {str(exc)[:200]}"
        else:
            capture.findings = findings
        finally:
            capture.analyzing = False

    def to_json(self) -> list[dict[str, Any]]:
        """Every capture, oldest first."""
        return [c.to_json() for c in self.captures]


def wait_for_analyses(controller: CaptureController, timeout_s: float) -> None:
    """Wait (at most `timeout_s`) for captures being analyzed, before a final summary."""
    deadline = time.monotonic() + timeout_s
    while any(c.analyzing for c in controller.captures) and time.monotonic() < deadline:
        time.sleep(0.05)
