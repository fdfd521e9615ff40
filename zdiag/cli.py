"""The `zdiag` command line: one exit path for every subcommand.

Subcommand modules are imported only when chosen, so `zdiag --help` and `zdiag --version` start
fast and one subcommand's heavy dependencies (torch, textual, plotly) never load for another.
A user mistake prints one sentence on stderr and exits 2; `--debug` shows tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from zdiag import __version__
from zdiag.errors import UserError

# name -> (module defining COMMAND, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "zdiag.commands.run",
        "launch a training script (or the built-in harness) under the profiler",
    ),
    "analyze": ("zdiag.commands.analyze", "analyze profiler traces or a run directory"),
    "render": (
        "zdiag.commands.render",
        "re-render a saved --json report as text, HTML, a Perfetto overlay or in the terminal",
    ),
    "diff": (
        "zdiag.commands.diff",
        "compare two runs: where the step time went, and a CI gate on regressions",
    ),
    "whatif": (
        "zdiag.commands.whatif",
        "replay the measured step with a changed schedule: predicted step time and memory",
    ),
    "plan": (
        "zdiag.commands.plan",
        "search wrap, prefetch and resharding with the replay: the best plan as code",
    ),
    "monitor": ("zdiag.commands.monitor", "follow a running multi-node job live, rank by rank"),
    "capture": (
        "zdiag.commands.capture",
        "ask a running monitor to profile a few steps on every rank of its job, now",
    ),
    "demo": ("zdiag.commands.demo", "run the built-in FSDP2 harness on 2 CPU ranks and analyze it"),
    "explain": ("zdiag.commands.explain", "explain a finding id: what it detects, why, thresholds"),
    "completion": (
        "zdiag.commands.completion",
        "print a shell completion script for bash, zsh or fish",
    ),
}

EXAMPLES: dict[str, str] = {
    "": """\
examples:
  zdiag demo                                      # see it work: 2 CPU ranks, ~30 s
  zdiag run --nproc-per-node 8 train.py --lr 3e-4  # profile your script, unchanged
  zdiag analyze zdiag_runs/20261122-190000/       # where the time went, what to change
  zdiag analyze run_dir/ --html report.html       # the interactive page
  zdiag diff runs/good runs/bad                   # what changed between two runs, and why
  zdiag whatif run_dir/ --prefetch 2              # the step replayed with a changed schedule
  zdiag plan run_dir/ --memory-budget-gb 40       # the fastest wrap/prefetch/reshard plan, as code
  zdiag monitor --listen 127.0.0.1:5577           # follow a running job live
  zdiag completion bash > ~/.local/share/bash-completion/completions/zdiag
""",
    "run": """\
examples:
  zdiag run train.py --lr 3e-4                    # one process
  zdiag run --nproc-per-node 8 train.py           # torchrun on this node
  zdiag run --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29500 --nproc-per-node 8 train.py
  zdiag run --nproc-per-node 2 --harness --wrap whole --zero 2
  zdiag run --profile-steps 1:1:3 --profile-memory --out runs/a train.py
  zdiag run --monitor 127.0.0.1:5577 --nproc-per-node 8 train.py
""",
    "analyze": """\
examples:
  zdiag analyze run_dir/                          # the text report (steps numbered from 0)
  zdiag analyze rank-0.json.gz rank-1.json.gz     # trace files
  zdiag analyze run_dir/ --rank 3                 # only some ranks
  zdiag analyze run_dir/ --json -o report.json    # the versioned JSON report
  zdiag analyze run_dir/ --html report.html       # one self-contained page (offline)
  zdiag analyze run_dir/ --tui                    # browse it in the terminal
  zdiag analyze run_dir/ --perfetto merged.json   # traces + zdiag tracks, for ui.perfetto.dev
  zdiag analyze run_dir/ --fail-on warning        # CI: exit 1 on a finding
""",
    "monitor": """\
examples:
  zdiag monitor --listen 127.0.0.1:5577           # the live terminal UI (? lists its keys)
  zdiag monitor --listen 127.0.0.1:5577 --headless --duration 60 --json
  zdiag monitor --relay --listen 127.0.0.1:5580 --forward monitor-host:5577
""",
    "demo": """\
examples:
  zdiag demo                                      # a healthy FSDP2 run
  zdiag demo --misconfig missing-overlap          # a misconfiguration, diagnosed
""",
    "completion": """\
examples:
  zdiag completion bash > ~/.local/share/bash-completion/completions/zdiag
  zdiag completion zsh > "${fpath[1]}/_zdiag"     # then: autoload -U compinit && compinit
  zdiag completion fish > ~/.config/fish/completions/zdiag.fish
""",
}
"""Example lines shown under each command's --help ("" is `zdiag --help`); a command that sets
its own epilog (render) keeps it."""

EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 70
EXIT_INTERRUPTED = 130


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr, with a pointer to --help."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand named in argv (the first non-option word), if it is a known one."""
    for token in argv:
        if token == "--":
            return None
        if not token.startswith("-"):
            return token if token in COMMANDS else None
    return None


def build_parser(argv: Sequence[str], *, every_command: bool = False) -> argparse.ArgumentParser:
    """The top-level parser; only the chosen subcommand's module is imported and asked for
    options (every one with `every_command`, for shell completion)."""
    parser = OneLineParser(
        prog="zdiag",
        description="Find out why sharded PyTorch training (FSDP2, ZeRO) is slow or out of memory.",
        epilog=EXAMPLES[""],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"zdiag {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    chosen = _chosen_command(argv)
    for name, (module_name, help_text) in COMMANDS.items():
        sp = sub.add_parser(
            name,
            help=help_text,
            description=help_text[0].upper() + help_text[1:] + ".",
            epilog=EXAMPLES.get(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if name == chosen or every_command:
            command = importlib.import_module(module_name).COMMAND
            command.add_arguments(sp)
            sp.set_defaults(_command=command, _parser=sp)
            sp.add_argument(
                "--debug",
                action="store_true",
                default=argparse.SUPPRESS,
                help="show tracebacks for errors",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `zdiag`; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        (getattr(args, "_parser", None) or parser).error(
            f"unrecognized arguments: {' '.join(extra)}"
        )
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USER_ERROR
    prog = f"zdiag {args.command}"
    try:
        return int(args._command.run(args))
    except UserError as exc:
        if args.debug:
            raise
        print(f"{prog}: error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0
    except Exception as exc:  # the one exit path for unexpected errors
        if args.debug:
            raise
        print(
            f"{prog}: internal error: {type(exc).__name__}: {exc} "
            "(rerun with --debug for the traceback and please report it)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL_ERROR
