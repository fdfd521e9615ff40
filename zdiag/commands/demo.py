"""`zdiag demo`: the built-in FSDP2 harness on 2 CPU ranks, profiled, analyzed and reported.

It is `zdiag run --nproc-per-node 2 --harness ...` followed by `zdiag analyze RUN_DIR --html`,
so it exercises the same code a user runs, end to end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from zdiag.analyzers.misconfigs import SCENARIOS
from zdiag.errors import ConfigError, UserError


class DemoCommand:
    """`zdiag demo [--misconfig NAME] [--out DIR]`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of `zdiag demo`."""
        parser.add_argument(
            "--misconfig",
            choices=SCENARIOS,
            default="none",
            help="inject a misconfiguration into the harness to see it diagnosed (default: none)",
        )
        parser.add_argument(
            "--nproc-per-node", type=int, default=2, help="number of CPU ranks (default: 2)"
        )
        parser.add_argument(
            "--steps", type=int, default=6, help="training steps to run (default: 6)"
        )
        parser.add_argument(
            "--out",
            type=Path,
            default=None,
            help="run directory (default: ./zdiag_runs/demo-<timestamp>)",
        )

    def run(self, args: argparse.Namespace) -> int:
        """Run the harness under `zdiag run`, analyze the run directory, print and write the report."""
        if args.nproc_per_node < 1:
            raise ConfigError("--nproc-per-node must be at least 1.")
        if args.steps < 3:
            raise ConfigError("--steps must be at least 3 so the profiler can warm up.")
        out: Path = args.out or Path("zdiag_runs") / time.strftime("demo-%Y%m%d-%H%M%S")
        from zdiag.cli import main as zdiag_main

        run_argv = [
            "run",
            "--nproc-per-node",
            str(args.nproc_per_node),
            "--out",
            str(out),
            "--harness",
            "--device",
            "cpu",
            "--steps",
            str(args.steps),
            "--misconfig",
            args.misconfig,
        ]
        print(f"zdiag demo: zdiag {' '.join(run_argv)}", file=sys.stderr, flush=True)
        started = time.monotonic()
        code = zdiag_main(run_argv)
        expected_oom = args.misconfig == "activation-oom"
        if code != 0 and not expected_oom:
            raise UserError(
                f"the harness run failed with exit code {code}; see its output above and {out}.",
                exit_code=code,
            )
        if code != 0:
            print(
                "zdiag demo: the run ran out of memory as injected; analyzing what it recorded.",
                file=sys.stderr,
            )
        html = out / "report.html"
        print(f"zdiag demo: zdiag analyze {out} --html {html}", file=sys.stderr, flush=True)
        code = zdiag_main(["analyze", str(out), "--html", str(html)])
        if code != 0:
            return code
        print(f"\nHTML report: {html.resolve()}")
        print(f"demo took {time.monotonic() - started:.0f} s")
        return 0


COMMAND = DemoCommand()
