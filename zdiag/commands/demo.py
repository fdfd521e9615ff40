"""`zdiag demo` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse

from zdiag.errors import UserError


class DemoCommand:
    """`zdiag demo`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """No options yet."""

    def run(self, args: argparse.Namespace) -> int:
        """Not built yet."""
        raise UserError("'zdiag demo' is not available in this build yet.")


COMMAND = DemoCommand()
