"""`zdiag monitor` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse

from zdiag.errors import UserError


class MonitorCommand:
    """`zdiag monitor`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """No options yet."""

    def run(self, args: argparse.Namespace) -> int:
        """Not built yet."""
        raise UserError("'zdiag monitor' is not available in this build yet.")


COMMAND = MonitorCommand()
