"""The imports of a source file as absolute module names (relative imports resolved as the
installed `zdiag.*` packages resolve them), for the architecture tests."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

FOLDER_PACKAGES = {
    "analyzers": "zdiag.analyzers",
    "collectors": "zdiag.collectors",
    "tui": "zdiag.tui",
}
"""The checkout's folders and the packages they are installed as (relative imports resolve so)."""


def package_of(path: Path) -> list[str]:
    """The dotted package a source file belongs to, as its parts."""
    rel = path.resolve().relative_to(REPO_ROOT)
    return FOLDER_PACKAGES[rel.parts[0]].split(".") + list(rel.parts[1:-1])


def module_imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom):
            base = package_of(path)[: len(package_of(path)) - node.level + 1]
            if node.module:
                found.append((node.lineno, ".".join([*base, node.module])))
            else:  # `from . import x`: each name is a module of that package
                found += [(node.lineno, ".".join([*base, a.name])) for a in node.names]
    return found
