"""Write the rules' section of docs/detectors.md from the rule records.

    python bench/rules_doc.py            # rewrite the section between the markers
    python bench/rules_doc.py --check    # exit 1 when the file is out of date

The section (zdiag.analyzers.detectors.docs.rules_markdown) lies between the BEGIN and END
markers; the hand-written text around it is kept.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zdiag.analyzers.detectors.docs import BEGIN, END, rules_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "detectors.md"


def updated(text: str) -> str:
    """`text` (docs/detectors.md) with its generated section replaced by today's."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{DOC}: the markers of the generated section are missing")
    return text[:start] + rules_markdown() + text[end + len(END) :]


def main() -> int:
    """Rewrite docs/detectors.md, or with --check say whether it is up to date."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when out of date")
    args = parser.parse_args()
    text = DOC.read_text(encoding="utf-8")
    new = updated(text)
    if args.check:
        if new != text:
            print(f"{DOC} is out of date: run python bench/rules_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
