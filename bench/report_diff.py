"""Compare two folders of `zdiag analyze --json` reports, file by file, field by field.

    python bench/report_diff.py BEFORE_DIR AFTER_DIR [--ignore zdiag_version --ignore inputs]

Files are paired by name (`*.json`); a file present on one side only is a difference. Each
difference is one line: the file, the JSON path (`findings[2].evidence.gain_ms`) and both values.
`--ignore KEY` skips every object key named KEY at any depth (fields that legitimately vary
between checkouts, such as `zdiag_version`). Floats compare exactly unless `--rel-tol` is given.
Exit status: 0 when the folders agree, 1 when any difference is found, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MAX_VALUE_CHARS = 120
"""Values longer than this are cut in the listing (a whole list of spans is not readable)."""


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def _same_number(a: Any, b: Any, rel_tol: float) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b or math.isclose(a, b, rel_tol=rel_tol, abs_tol=0.0)
    return False


def diff_values(
    a: Any, b: Any, path: str, ignore: frozenset[str], rel_tol: float = 0.0
) -> Iterator[str]:
    """One line per difference between two decoded JSON values (`path` names where they sit)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key in ignore:
                continue
            sub = f"{path}.{key}" if path else key
            if key not in b:
                yield f"{sub}: removed (was {_show(a[key])})"
            elif key not in a:
                yield f"{sub}: added {_show(b[key])}"
            else:
                yield from diff_values(a[key], b[key], sub, ignore, rel_tol)
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{path}: length {len(a)} -> {len(b)}"
        for k, (x, y) in enumerate(zip(a, b, strict=False)):
            yield from diff_values(x, y, f"{path}[{k}]", ignore, rel_tol)
        return
    if a == b and type(a) is type(b):
        return
    if _same_number(a, b, rel_tol):
        return
    yield f"{path}: {_show(a)} -> {_show(b)}"


def diff_folders(
    before: Path, after: Path, ignore: frozenset[str], rel_tol: float = 0.0
) -> list[str]:
    """Every difference between the reports of two folders, as readable lines."""
    names_a = {p.name for p in before.glob("*.json")}
    names_b = {p.name for p in after.glob("*.json")}
    out = [f"{n}: only in {before}" for n in sorted(names_a - names_b)]
    out += [f"{n}: only in {after}" for n in sorted(names_b - names_a)]
    for name in sorted(names_a & names_b):
        a = json.loads((before / name).read_text())
        b = json.loads((after / name).read_text())
        out += [f"{name}: {line}" for line in diff_values(a, b, "", ignore, rel_tol)]
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--ignore", action="append", default=[], metavar="KEY")
    p.add_argument("--rel-tol", type=float, default=0.0)
    args = p.parse_args(argv)
    for d in (args.before, args.after):
        if not d.is_dir():
            print(f"{d}: not a folder; pass two folders of report JSON.", file=sys.stderr)
            return 2
    try:
        lines = diff_folders(args.before, args.after, frozenset(args.ignore), args.rel_tol)
    except (OSError, ValueError) as exc:
        print(f"cannot read a report: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    print(f"{len(lines)} difference(s)", file=sys.stderr)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
