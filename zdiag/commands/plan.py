"""`zdiag plan RUN --memory-budget-gb X`: the wrap, prefetch and resharding choices, searched
with the what-if replay, the best as code.

The run is analyzed as `zdiag analyze` does (stored summaries first); the planner
(analyzers/planning/plan.py) replays every combination of the choices the run can take on every
modelled step of every rank and ranks them by predicted step time within the budget. The text
gives the best plan's code (the framework's own remedies: the run's modules and mesh), its
predicted step time and peak, and the runners-up; `--json` writes `zdiag.plan/1`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zdiag.errors import ConfigError, InputError

EXAMPLES = """\
examples:
  zdiag plan runs/a                          # the fastest plan the replay finds
  zdiag plan runs/a --memory-budget-gb 40    # ... whose predicted peak fits 40 GiB per rank
  zdiag plan runs/a --json                   # zdiag.plan/1
"""


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number of GiB: {text!r}") from exc
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"a memory budget is more than 0 GiB, got {text}")
    return value


class PlanCommand:
    """`zdiag plan`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of `zdiag plan`."""
        parser.epilog = EXAMPLES
        parser.add_argument("run", type=Path, metavar="RUN", nargs="?",
                            help="a run directory, a trace file or a folder of traces")  # fmt: skip
        parser.add_argument("--memory-budget-gb", type=_gib, metavar="X",
                            help="keep the predicted peak memory per rank within X GiB")  # fmt: skip
        parser.add_argument("--json", action="store_true", help="write the plans as JSON")
        parser.add_argument("--output", "-o", type=Path, metavar="FILE",
                            help="write the text (or JSON) to FILE")  # fmt: skip
        parser.add_argument("--no-cache", action="store_true",
                            help="decode every trace: read no stored summary and write none")  # fmt: skip

    def run(self, args: argparse.Namespace) -> int:
        """Analyze, search, write; returns the exit code."""
        from zdiag.analyzers.engine.summary_pipeline import SummaryOptions, analyze_via_summaries
        from zdiag.analyzers.engine.summary_store import cache_disabled_by_env
        from zdiag.analyzers.planning.plan import PlanError, search
        from zdiag.commands.whatif import measured_peaks
        from zdiag.render.output import OutputTarget, check_outputs, deliver
        from zdiag.render.plan_text import render_plan_json, render_plan_text

        if args.run is None:
            raise ConfigError("give a run: zdiag plan RUN [--memory-budget-gb X] (see --help).")
        check_outputs(
            [OutputTarget("--output", args.output)] if args.output else [], inputs=[args.run]
        )
        if not args.run.exists():
            raise InputError(
                f"{args.run} does not exist; give a run directory, a trace file or a folder of traces."
            )
        use_cache = not (args.no_cache or cache_disabled_by_env())
        run = analyze_via_summaries(
            [args.run], SummaryOptions(use_stored=use_cache, write_cache=use_cache)
        )
        if run.context is None:
            raise InputError(f"{args.run}: no trace to plan from; give a run with its traces.")
        budget = None if args.memory_budget_gb is None else int(args.memory_budget_gb * 2**30)
        try:
            found = search(run.context, budget_bytes=budget, peaks=measured_peaks(run.report))
        except PlanError as exc:
            raise InputError(f"{args.run}: {exc}.") from exc
        deliver(
            lambda width: (
                render_plan_json(found) if args.json else render_plan_text(found, width)
            ).encode(),
            args.output,
            "the plan",
        )
        return 0


COMMAND = PlanCommand()
