"""One small module per CLI subcommand; each defines `COMMAND`, an object with the `Command` shape."""

from __future__ import annotations

import argparse
from typing import Protocol


class Command(Protocol):
    """A `zdiag` subcommand: declares its options, then runs and returns an exit code."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this subcommand's options to its parser."""

    def run(self, args: argparse.Namespace) -> int:
        """Run with parsed options; return the process exit code. Raise UserError for mistakes."""
