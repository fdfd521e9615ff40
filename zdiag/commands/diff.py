"""`zdiag diff A B`: compare two runs, say where the step-time change went, gate CI on it.

Each side is a run directory, a trace file or folder of traces, or a report saved with
`zdiag analyze ... --json -o FILE`. Run directories and traces are analyzed as `zdiag analyze`
does, stored summaries first (a run whose summaries are stored, in the job or in the cache, is
not decoded again), so two 1000-rank runs compare without reading their traces twice; a saved
report is read as it is. The text starts with the attribution on one line; `--json` writes the
versioned diff (`zdiag.diff/1`), `--html FILE` the side-by-side page, `--tui` the browser.

Exit status: 0, or 1 when a gate fails (`--fail-on-regression PCT` on the median step time,
`--fail-on-memory PCT` on the peak memory), with the attribution on stderr; 2 for bad input or
runs that do not compare (different device kind, world size or model), in one sentence.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from zdiag.errors import ConfigError, InputError

if TYPE_CHECKING:
    from zdiag.analyzers.compare.model import RunDiff
    from zdiag.analyzers.engine.summary_pipeline import SummaryOptions
    from zdiag.analyzers.report import Report

EXIT_REGRESSION = 1
REPORT_HEAD = re.compile(rb'^\s*\{\s*"schema"\s*:\s*"zdiag\.report/')
"""How a saved report starts (zdiag writes `schema` first); anything else is read as traces."""
HEAD_BYTES = 256

EXAMPLES = """\
examples:
  zdiag diff runs/good runs/bad                     # where the step time went, in one line first
  zdiag diff baseline.json candidate.json          # two saved 'zdiag analyze --json' reports
  zdiag diff base/ cand/ --fail-on-regression 5    # CI: exit 1 when the median step is 5% slower
  zdiag diff base/ cand/ --json -o diff.json       # the versioned diff (zdiag.diff/1)
  zdiag diff base/ cand/ --html diff.html          # side by side, in one offline page
  zdiag diff base/ cand/ --tui                     # browse it in the terminal
"""


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a percentage: {text!r}") from exc
    if not 0 <= value < 1e6:
        raise argparse.ArgumentTypeError(f"a percentage is 0 or more, got {text}")
    return value


def is_saved_report(path: Path) -> bool:
    """Whether `path` is a regular file starting like a saved zdiag report."""
    if not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError:
        return False
    return bool(REPORT_HEAD.match(head))


def load_side(path: Path, options: SummaryOptions) -> Report:
    """One side's Report: a saved report as it is, anything else analyzed."""
    from zdiag.analyzers.engine.summary_pipeline import analyze_via_summaries
    from zdiag.commands.render import load_report

    if is_saved_report(path):
        return load_report(path)
    if not path.exists():
        raise InputError(
            f"{path} does not exist; give a run directory, a trace file or a saved --json report."
        )
    return analyze_via_summaries([path], options).report


class DiffCommand:
    """`zdiag diff`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of `zdiag diff`."""
        parser.epilog = EXAMPLES
        parser.add_argument("baseline", type=Path, metavar="A", nargs="?", help="the baseline run")
        parser.add_argument("candidate", type=Path, metavar="B", nargs="?", help="the run to judge")
        parser.add_argument("--json", action="store_true", help="write the diff as JSON")
        parser.add_argument("--html", type=Path, metavar="FILE", help="write the side-by-side page")
        parser.add_argument("--tui", action="store_true", help="browse the diff in the terminal")
        parser.add_argument(
            "--output", "-o", type=Path, metavar="FILE", help="write the text (or JSON) to FILE"
        )
        parser.add_argument(
            "--fail-on-regression",
            type=_percent,
            metavar="PCT",
            help="exit 1 when B's median step time is more than PCT%% above A's and outside the "
            "step-to-step spread (docs/diff.md)",
        )
        parser.add_argument(
            "--fail-on-memory",
            type=_percent,
            metavar="PCT",
            help="exit 1 when B's peak memory is more than PCT%% above A's (needs memory recorded "
            "in both runs: 'zdiag run --profile-memory')",
        )
        parser.add_argument(
            "--allow-incomparable",
            action="store_true",
            help="compare runs on different devices, world sizes or models anyway (a warning)",
        )
        parser.add_argument(
            "--no-cache",
            action="store_true",
            help="decode every trace: read no stored summary and write none (also ZDIAG_CACHE=off)",
        )

    def run(self, args: argparse.Namespace) -> int:
        """Analyze both sides, diff, write, then apply the gates; returns the exit code."""
        from zdiag.analyzers.compare.diff import NotComparable, diff_reports
        from zdiag.analyzers.engine.summary_pipeline import SummaryOptions
        from zdiag.analyzers.engine.summary_store import cache_disabled_by_env
        from zdiag.render.output import OutputTarget, check_outputs
        from zdiag.render.terminal import check_tui_possible

        if args.baseline is None or args.candidate is None:
            raise ConfigError("give two runs: zdiag diff BASELINE CANDIDATE.")
        if args.tui:
            check_tui_possible(json_to_stdout=args.json and args.output is None)
        inputs = [args.baseline, args.candidate]
        targets = [OutputTarget("--output", args.output)] if args.output else []
        if args.html:
            targets.append(OutputTarget("--html", args.html))
        check_outputs(targets, inputs=inputs)
        use_cache = not (args.no_cache or cache_disabled_by_env())
        options = SummaryOptions(use_stored=use_cache, write_cache=use_cache)
        a = load_side(args.baseline, options)
        b = load_side(args.candidate, options)
        try:
            diff = diff_reports(
                a,
                b,
                baseline=str(args.baseline),
                candidate=str(args.candidate),
                allow_incomparable=args.allow_incomparable,
            )
        except NotComparable as exc:
            hint = (
                "" if "no analyzed step" in str(exc) else "; --allow-incomparable compares anyway"
            )
            raise InputError(f"{exc}{hint}.") from exc
        memory_change = _memory_change(diff, args.fail_on_memory)
        _write(diff, a, b, args, inputs)
        return _gates(diff, args.fail_on_regression, args.fail_on_memory, memory_change)


def _memory_change(diff: RunDiff, pct: float | None) -> float | None:
    """B's total peak memory change in percent, when `--fail-on-memory` is given (ConfigError
    when a side recorded no memory: the gate cannot be judged)."""
    if pct is None:
        return None
    total = next((m for m in diff.memory if m.category == "total"), None)
    if total is None or not total.a_bytes or total.b_bytes is None:
        raise ConfigError(
            "--fail-on-memory needs the peak memory of both runs; record them with "
            "'zdiag run --profile-memory' (or CUDA memory snapshots)."
        )
    return 100.0 * (total.b_bytes - total.a_bytes) / total.a_bytes


def _write(
    diff: RunDiff, a: Report, b: Report, args: argparse.Namespace, inputs: list[Path]
) -> None:
    """The text or JSON to stdout / -o, the HTML page, then the browser."""
    from zdiag.analyzers.compare.model import encode_diff
    from zdiag.render.diff_text import render_diff_text
    from zdiag.render.output import write_output, write_stdout
    from zdiag.render.terminal import DEFAULT_WIDTH, color_enabled, terminal_width

    if args.json:
        data = encode_diff(diff) + b"\n"
    elif args.output is not None:
        data = render_diff_text(diff, DEFAULT_WIDTH).encode()
    else:
        data = render_diff_text(
            diff, terminal_width(sys.stdout), color_enabled(sys.stdout)
        ).encode()
    if args.output is not None:
        write_output(args.output, data)
        print(f"zdiag: wrote the diff to {args.output}", file=sys.stderr)
    elif not args.tui or args.json:
        write_stdout(data)
    if args.html is not None:
        from zdiag.render.diff_html import render_diff_html

        write_output(args.html, render_diff_html(diff, a, b).encode())
        print(f"zdiag: wrote the HTML diff to {args.html}", file=sys.stderr)
    if args.tui:
        from zdiag.tui.diff_app import run_diff_app

        run_diff_app(diff, a, b)


def _gates(
    diff: RunDiff,
    regression_pct: float | None,
    memory_pct: float | None,
    memory_change: float | None,
) -> int:
    """Exit 1 (the attribution on stderr) when a gate fails, else 0. The step-time gate ignores
    a change inside the run-to-run spread ("no change")."""
    failed = []
    step = diff.step_time()
    if regression_pct is not None and step is not None and step.pct is not None:
        if step.pct > regression_pct and step.change != "no change":
            failed.append(f"median step time {step.pct:+.1f}% (limit {regression_pct:g}%)")
    if memory_pct is not None and memory_change is not None and memory_change > memory_pct:
        failed.append(f"peak memory {memory_change:+.1f}% (limit {memory_pct:g}%)")
    if not failed:
        return 0
    print(f"zdiag diff: regression: {'; '.join(failed)}: {diff.headline}", file=sys.stderr)
    return EXIT_REGRESSION


COMMAND = DiffCommand()
