"""`zdiag explain [ID]`: what a finding id detects, why it matters, an example, its thresholds.

Written from the rule records (zdiag.analyzers.detectors.RULES), as docs/detectors.md is. Without
an id, every rule in one line each. An unknown id is one sentence naming the known ones, exit 2.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import TYPE_CHECKING

from zdiag.errors import ConfigError

if TYPE_CHECKING:
    from zdiag.analyzers.detectors import Rule

WIDTH = 100


def _para(label: str, text: str) -> list[str]:
    return textwrap.wrap(f"{label}: {text}", WIDTH, initial_indent="  ", subsequent_indent="    ")


def explain_text(rule: Rule) -> str:
    """One rule in words: what, why, example, fix, gain, scope, thresholds."""
    lines = [f"{rule.id}: {rule.summary}", ""]
    for label, text in (
        ("What it detects", rule.what),
        ("Why it matters", rule.why),
        ("Example", rule.example),
        ("Recommends", rule.fix),
        ("Gain estimate", rule.gain),
        ("Scope", rule.scope_text()),
    ):
        lines += [*_para(label, text), ""]
    if not rule.thresholds:
        lines.append("  Thresholds: none (it decides on what the run recorded).")
    else:
        lines.append("  Thresholds:")
    for t in rule.thresholds:
        lines.append(f"    {t.name} = {t.shown()}  (reported as: {t.reported_as()})")
        lines += textwrap.wrap(t.why, WIDTH, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines) + "\n"


def rules_list(rules: tuple[Rule, ...]) -> str:
    """Every rule in one line: its id and what it detects."""
    width = max(len(r.id) for r in rules)
    return "".join(f"{r.id:<{width}}  {r.summary}\n" for r in rules)


class ExplainCommand:
    """`zdiag explain [ID]`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of `zdiag explain`."""
        parser.add_argument(
            "id", nargs="?", metavar="ID", help="a finding id; without one, every rule is listed"
        )

    def run(self, args: argparse.Namespace) -> int:
        """Print the rule (or the list of rules) on standard output; returns 0."""
        from zdiag.analyzers.detectors import BY_ID, RULES

        if args.id is None:
            sys.stdout.write(rules_list(RULES))
            return 0
        rule = BY_ID.get(args.id)
        if rule is None:
            raise ConfigError(
                f"no rule has the id {args.id!r}; the finding ids are: {', '.join(BY_ID)}."
            )
        sys.stdout.write(explain_text(rule))
        return 0


COMMAND = ExplainCommand()
