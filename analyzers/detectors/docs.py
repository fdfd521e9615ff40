"""The rules' section of docs/detectors.md, written from the rule records (detectors/rule.py).

`rules_markdown()` returns it; `bench/rules_doc.py` puts it between the markers of
docs/detectors.md (`--check` says whether the file is up to date), and tests/unit/detectors/test_rules.py
fails when the file and the records disagree.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import RULES
from .rule import Rule

BEGIN = "<!-- rules: generated from the rule records by `python bench/rules_doc.py`; edit the records -->"
END = "<!-- end of the generated rules -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rule_markdown(rule: Rule) -> str:
    """One rule's subsection: what, why, example, fix, gain, scope and its thresholds."""
    lines = [
        f"### `{rule.id}`",
        "",
        f"**What it detects.** {rule.what}",
        "",
        f"**Why it matters.** {rule.why}",
        "",
        f"**Example.** {rule.example}",
        "",
        f"**Recommends.** {rule.fix}",
        "",
        f"**Gain estimate.** {rule.gain}",
        "",
        f"**Scope.** {rule.scope_text()}.",
        "",
    ]
    if not rule.thresholds:
        lines += ["**Thresholds.** None: it decides on what the run recorded.", ""]
        return "\n".join(lines)
    lines += [
        "**Thresholds.**",
        "",
        "| name | value | why | reported as |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| `{t.name}` | {t.shown()} | {_cell(t.why)} | {t.reported_as()} |"
        for t in rule.thresholds
    ]
    return "\n".join([*lines, ""])


def rules_markdown(rules: Sequence[Rule] = RULES) -> str:
    """The generated section, between its markers: an index, then every rule in report order."""
    index = [f"| `{r.id}` | {_cell(r.summary)} |" for r in rules]
    parts = [
        BEGIN,
        "",
        f"{len(rules)} rules, in report order (`zdiag explain ID` prints one of them):",
        "",
        "| id | detects |",
        "|---|---|",
        *index,
        "",
        *(rule_markdown(r) for r in rules),
        END,
    ]
    return "\n".join(parts)
