"""`zdiag analyze` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse

from zdiag.errors import UserError


class AnalyzeCommand:
    """`zdiag analyze`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """No options yet."""
        parser.add_argument("paths", nargs="*")

    def run(self, args: argparse.Namespace) -> int:
        """Not built yet."""
        raise UserError("'zdiag analyze' is not available in this build yet.")


COMMAND = AnalyzeCommand()
