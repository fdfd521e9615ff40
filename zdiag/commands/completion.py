"""`zdiag completion bash|zsh|fish`: print a shell completion script (see zdiag.completion)."""

from __future__ import annotations

import argparse
import sys

from zdiag.completion import SHELLS


class CompletionCommand:
    """`zdiag completion`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of `zdiag completion`."""
        parser.add_argument(
            "shell", nargs="?", choices=SHELLS, help="the shell to complete zdiag in"
        )

    def run(self, args: argparse.Namespace) -> int:
        """Print the script on standard output; returns 0."""
        from zdiag.completion import completion_script
        from zdiag.errors import ConfigError

        if args.shell is None:
            raise ConfigError(f"name the shell: zdiag completion {'|'.join(SHELLS)}.")
        sys.stdout.write(completion_script(args.shell))
        sys.stdout.flush()
        return 0


COMMAND = CompletionCommand()
