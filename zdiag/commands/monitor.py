"""`zdiag monitor`: follow a running job live, rank by rank (or relay one node's ranks to it).

- ``zdiag monitor [--listen 127.0.0.1:5577]``: the Textual app (one job at a time, `j` switches,
  Enter opens a rank, `?` lists the keys).
- ``zdiag monitor --headless --duration S [--json]``: receive for S seconds, print a summary.
- ``zdiag monitor --relay --listen 127.0.0.1:5580 --forward MONITOR:5577``: the per-node relay
  (records up to the monitor; the monitor's capture requests down to the ranks, on 5581).

Listening on anything but loopback needs a shared token (``--token`` or ``ZDIAG_MONITOR_TOKEN``);
senders without it are refused at the connection's handshake and counted. Ranks publish when
``ZDIAG_MONITOR=HOST:PORT`` is set (``zdiag run --monitor HOST:PORT`` sets it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from zdiag.errors import ConfigError, UserError
from zdiag.live.wire import ENV_TOKEN

if TYPE_CHECKING:  # imported where used: `zdiag --help` loads neither
    from zdiag.analyzers.report import Report
    from zdiag.live.metrics import MetricsServer
    from zdiag.live.state import MonitorState

DEFAULT_LISTEN = "127.0.0.1:5577"
METRICS_HOST = "127.0.0.1"
CAPTURE_CHECK_S = 0.5
"""How often the headless monitor runs the capture rules."""
CAPTURE_ANALYSIS_WAIT_S = 30.0
"""At the end, how long the headless monitor waits for a capture being analyzed."""
JSON_HISTORY_STEPS = 60
"""Steps of step-time history `--headless --json` prints (`history`: per rank, median, slowest)."""


def rss_bytes() -> int:
    """This process's resident memory now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Stop:
    """Turns SIGTERM into a clean stop, so a terminated headless monitor still prints."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


class MonitorCommand:
    """`zdiag monitor`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of the monitor and of the relay."""
        parser.add_argument(
            "--listen",
            default=DEFAULT_LISTEN,
            metavar="HOST:PORT",
            help=f"address to receive step records on (default {DEFAULT_LISTEN}; "
            "a non-loopback address requires --token)",
        )
        parser.add_argument(
            "--token",
            default=None,
            help="shared token every rank sends (default: $ZDIAG_MONITOR_TOKEN); "
            "senders without it are refused at the handshake and counted",
        )
        parser.add_argument(
            "--headless",
            action="store_true",
            help="no terminal UI: receive for --duration seconds, then print a summary "
            "(of the latest job; the others are listed)",
        )
        parser.add_argument(
            "--duration",
            type=float,
            default=None,
            metavar="S",
            help="stop after S seconds (headless default 10; relay default: until interrupted)",
        )
        parser.add_argument(
            "--json", action="store_true", help="with --headless: print the summary as JSON"
        )
        parser.add_argument(
            "--no-capture",
            action="store_true",
            help="never ask the ranks for a triggered capture (by default a chronic straggler "
            "or a creeping step time, or the key c, makes every rank profile a few steps; the "
            "requests go out on the --listen port + 1)",
        )
        parser.add_argument(
            "--every",
            type=float,
            default=None,
            metavar="S",
            help="with --headless: also print a summary every S seconds",
        )
        parser.add_argument(
            "--relay",
            action="store_true",
            help="run the per-node relay: receive this node's ranks on --listen, forward to "
            "--forward, and pass the monitor's capture requests back to the ranks on the "
            "--listen port + 1",
        )
        parser.add_argument(
            "--forward",
            default=None,
            metavar="HOST:PORT",
            help="with --relay: the monitor's address",
        )
        parser.add_argument(
            "--metrics-port",
            default=None,
            metavar="PORT",
            help="also serve the ranks' figures as Prometheus/OpenMetrics metrics on "
            "http://HOST:PORT/metrics (docs/monitor.md, Metrics)",
        )
        parser.add_argument(
            "--metrics-host",
            default=None,
            metavar="HOST",
            help=f"with --metrics-port: the address to serve on (default {METRICS_HOST}; "
            "the endpoint has no authentication)",
        )

    def run(self, args: argparse.Namespace) -> int:
        """Validate the options, then run the app, the headless loop or the relay."""
        token = args.token if args.token is not None else os.environ.get(ENV_TOKEN, "")
        if args.duration is not None and not args.duration > 0:
            raise ConfigError(
                f"--duration must be a positive number of seconds, got {args.duration}."
            )
        if args.json and not args.headless:
            raise ConfigError("--json needs --headless (the terminal UI has no JSON output).")
        if args.every is not None and (not args.headless or not args.every > 0):
            raise ConfigError("--every needs --headless and a positive number of seconds.")
        if args.relay:
            if args.metrics_port is not None or args.metrics_host is not None:
                raise ConfigError("--metrics-port and --metrics-host are not for --relay.")
            if not args.forward:
                raise ConfigError(
                    "--relay needs --forward MONITOR_HOST:PORT, the monitor's address."
                )
            return self._relay(args, token)
        if args.forward:
            raise ConfigError("--forward is only for --relay.")
        metrics_at = self._metrics_address(args)
        from zdiag.live.receiver import LiveReceiver

        receiver = LiveReceiver(args.listen, token=token)
        try:
            if not args.headless and not sys.stdout.isatty():
                raise UserError(
                    "stdout is not a terminal: use --headless --duration S for a summary."
                )
            state, metrics = self._state(metrics_at)
        except BaseException:
            receiver.close()
            raise
        control, captures = self._captures(args, receiver, token)
        try:
            if args.headless:
                return self._headless(receiver, args, state, captures)
            from zdiag.tui.monitor_app import MonitorApp

            # the app closes the receiver when it exits
            app = MonitorApp(
                receiver,
                listen=str(receiver.endpoint),
                captures=captures,
                load_report=load_capture_report,
            )
            app.state = state  # the state the metrics endpoint reads (a `SharedMonitorState`)
            app.run()
            return 0
        finally:
            if metrics is not None:
                metrics.close()
            if control is not None:
                control.close()

    def _captures(self, args: argparse.Namespace, receiver: Any, token: str) -> tuple[Any, Any]:
        """The control socket and the capture controller (None, None with --no-capture, or when
        the control port is taken: said on stderr, the monitor goes on without captures)."""
        if args.no_capture:
            return None, None
        from zdiag.live.captures import CaptureController, ControlSender

        try:
            control = ControlSender(receiver.endpoint, token)
        except ConfigError as exc:
            print(f"zdiag monitor: no triggered captures: {exc.message}", file=sys.stderr)
            return None, None
        return control, CaptureController(control.send)

    def _metrics_address(self, args: argparse.Namespace) -> tuple[str, int] | None:
        """--metrics-host and --metrics-port checked: (host, port), None without a port."""
        if args.metrics_port is None:
            if args.metrics_host is not None:
                raise ConfigError("--metrics-host needs --metrics-port.")
            return None
        text = str(args.metrics_port).strip()
        if not (text.isascii() and text.isdigit() and 0 < int(text) < 65536):
            raise ConfigError(
                f"--metrics-port must be a port number from 1 to 65535, got {args.metrics_port!r}."
            )
        return args.metrics_host or METRICS_HOST, int(text)

    def _state(
        self, metrics_at: tuple[str, int] | None
    ) -> tuple[MonitorState, MetricsServer | None]:
        """The monitor's state; with a metrics address, a `SharedMonitorState` whose metrics are
        served there (the `MetricsServer`, else None); a port it cannot listen on is refused."""
        from zdiag.live.state import MonitorState

        if metrics_at is None:
            return MonitorState(), None
        from zdiag.live.metrics import SharedMonitorState, serve_metrics

        host, port = metrics_at
        state = SharedMonitorState()
        try:
            server = serve_metrics(state, host, port)
        except OSError as exc:
            raise ConfigError(
                f"--metrics-port: cannot serve metrics on {host}:{port} "
                f"({exc.strerror or exc}): pick another port or --metrics-host."
            ) from None
        shown = f"[{host}]" if ":" in host else host
        print(f"zdiag monitor: metrics on http://{shown}:{port}/metrics", file=sys.stderr)
        return state, server

    def _headless(
        self, receiver: Any, args: argparse.Namespace, state: MonitorState, captures: Any
    ) -> int:
        duration = args.duration if args.duration is not None else 10.0
        stop = _Stop()
        previous = signal.signal(signal.SIGTERM, stop)
        rss: list[tuple[float, int]] = []
        start = time.monotonic()
        next_rss = start
        next_summary = start + args.every if args.every else None
        next_capture_check = start
        print(
            f"zdiag monitor: listening on {receiver.endpoint} for {duration:g} s", file=sys.stderr
        )
        try:
            while not stop.requested and (now := time.monotonic()) - start < duration:
                state.ingest(receiver.poll(timeout_ms=50), time.time())
                if now >= next_rss:
                    rss.append((round(now - start, 2), rss_bytes()))
                    next_rss = now + 1.0
                if captures is not None and now >= next_capture_check:
                    next_capture_check = now + CAPTURE_CHECK_S
                    try:
                        captures.update(state, time.time())
                    except Exception as exc:  # never the monitor's end: captures stop
                        print(f"zdiag monitor: captures stopped: {exc!r}", file=sys.stderr)
                        captures = None
                if next_summary is not None and now >= next_summary:
                    next_summary = now + args.every
                    state.sync_rejections(receiver)
                    self._print(state, receiver, args, start, rss, captures)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            state.sync_rejections(receiver)
            receiver.close()
        if captures is not None:
            from zdiag.live.captures import wait_for_analyses

            try:
                captures.update(state, time.time())
            except Exception as exc:
                print(f"zdiag monitor: captures stopped: {exc!r}", file=sys.stderr)
            wait_for_analyses(captures, CAPTURE_ANALYSIS_WAIT_S)
        self._print(state, receiver, args, start, rss, captures)
        return 0

    def _print(
        self,
        state: MonitorState,
        receiver: Any,
        args: argparse.Namespace,
        start: float,
        rss: list[tuple[float, int]],
        captures: Any = None,
    ) -> None:
        """Print the summary of the state now (text, or JSON with `--json`)."""
        from zdiag.tui.monitor_text import finite_json, render_summary, view_to_json

        view = state.view(time.time())
        taken = captures.to_json() if captures is not None else []
        if args.json:
            out = view_to_json(view)
            out["captures"] = taken
            out["history"] = finite_json(state.history(view.job, JSON_HISTORY_STEPS).to_json())
            out["listen"] = str(receiver.endpoint)
            out["duration_s"] = round(time.monotonic() - start, 3)
            out["rss_bytes"] = rss
            out["rejected_token"] = receiver.rejected_token
            out["malformed"] = receiver.malformed
            print(json.dumps(out, allow_nan=False), flush=True)
        else:
            print(render_summary(view, source=f"listening on {receiver.endpoint}"), flush=True)
            for c in taken:
                found = "; ".join(f"{f['id']} (ranks {f['ranks']})" for f in c["findings"] or [])
                print(
                    f"capture {c['id']} at step {c['start_step']} ({c['reason']}): "
                    f"{sorted(set(c['states'].values()))} {found or c['error'] or ''}",
                    flush=True,
                )

    def _relay(self, args: argparse.Namespace, token: str) -> int:
        from zdiag.live.receiver import Relay

        relay = Relay(args.listen, args.forward, token=token)
        previous = signal.signal(signal.SIGTERM, lambda s, f: relay.stop(timeout_s=0))
        print(
            f"zdiag monitor --relay: {relay.receiver.endpoint} -> {relay.forward}", file=sys.stderr
        )
        if relay.control_error is not None:
            print(
                f"zdiag monitor --relay: no triggered captures for this node's ranks: "
                f"{relay.control_error}",
                file=sys.stderr,
            )
        try:
            relay.run(duration_s=args.duration)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
        print(
            f"zdiag monitor --relay: forwarded {relay.forwarded}, dropped {relay.dropped}, "
            f"rejected {relay.receiver.rejected}; capture requests forwarded "
            f"{relay.control_forwarded}, rejected {relay.control_rejected}",
            file=sys.stderr,
        )
        return 0


COMMAND = MonitorCommand()


def load_capture_report(folders: list[Path]) -> Report:
    """The Report of capture folders, as `zdiag analyze FOLDER` makes it: each rank's in-job
    summary where it matches its trace, the trace itself otherwise; nothing is written."""
    from zdiag.analyzers.engine.summary_pipeline import SummaryOptions, analyze_via_summaries

    return analyze_via_summaries(folders, SummaryOptions(use_stored=True, write_cache=False)).report
