"""`zdiag capture --monitor HOST:PORT`: ask a running `zdiag monitor` for a triggered capture now.

The request travels on the monitor's data path (a ZeroMQ PUSH, authenticated with the job's
token like the ranks' records). The monitor then asks every rank of the job for a short profiler
window at the same step, as when its rules fire (docs/monitor.md, "Triggered captures"); it
still applies its per-job limit, but no cool-down. The monitor shows the capture and its
findings; this command only says whether the request was handed over.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from zdiag.errors import ConfigError, UserError

SEND_TIMEOUT_MS = 3000
"""How long to wait for the monitor's connection before giving up."""

EXAMPLES = """\
examples:
  zdiag capture --monitor 127.0.0.1:5577                     # the monitor's current job
  zdiag capture --monitor node0:5577 --job 4242 --reason "loss spike at step 9000"
"""


class CaptureCommand:
    """`zdiag capture`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of `zdiag capture`."""
        parser.epilog = EXAMPLES
        parser.add_argument(
            "--monitor",
            metavar="HOST:PORT",
            help="the running monitor's --listen address (default: $ZDIAG_MONITOR)",
        )
        parser.add_argument(
            "--job", default="", help="the job id (default: the monitor's current job)"
        )
        parser.add_argument("--reason", default="", help="a few words the monitor shows with it")
        parser.add_argument(
            "--token", help="the shared token (default: $ZDIAG_MONITOR_TOKEN; needed off localhost)"
        )

    def run(self, args: argparse.Namespace) -> int:
        """Send the request; exit 0 once the monitor's socket took it."""
        import zmq

        from zdiag.live.wire import ENV_MONITOR, ENV_TOKEN, encode, parse_endpoint, push_socket

        target = args.monitor or os.environ.get(ENV_MONITOR)
        if not target:
            raise ConfigError(
                f"give the monitor's address: --monitor HOST:PORT (or {ENV_MONITOR})."
            )
        endpoint = parse_endpoint(target, option="--monitor")
        token = (args.token if args.token is not None else os.environ.get(ENV_TOKEN, "")).encode()
        ctx: zmq.Context[Any] = zmq.Context()
        sock = push_socket(ctx, endpoint, send_hwm=1, token=token)
        sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        payload = {"kind": "capture", "job": args.job, "reason": args.reason, "ts": time.time()}
        try:
            sock.send_multipart(encode(payload, token))
        except zmq.Again:
            raise UserError(
                f"no monitor took the request at {endpoint} within {SEND_TIMEOUT_MS // 1000} s; "
                "check the address (the monitor's --listen) and the token."
            ) from None
        finally:
            sock.close(linger=SEND_TIMEOUT_MS)
            ctx.term()
        job = f"job {args.job}" if args.job else "its current job"
        print(
            f"zdiag capture: asked the monitor at {endpoint} for a capture of {job}",
            file=sys.stderr,
        )
        return 0


COMMAND = CaptureCommand()
