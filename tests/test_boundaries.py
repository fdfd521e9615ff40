"""The architecture's import boundaries, checked on the source (AST), not by convention.

- collectors/ runs inside training: only the standard library, torch, zmq and zdiag's own
  collectors/errors may be imported.
- analyzers/ never imports torch; only analyzers/hta_adapter.py imports hta.
- analysis never prints or draws: no plotly/textual in analyzers/.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

STDLIB = set(sys.stdlib_module_names)


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _sources(folder: str) -> list[Path]:
    return sorted((REPO_ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _sources("collectors"), ids=lambda p: p.name)
def test_collectors_import_only_stdlib_torch_zmq(path: Path) -> None:
    allowed_roots = STDLIB | {"torch", "zmq", "__future__"}
    allowed_zdiag = ("zdiag.collectors", "zdiag.errors")
    bad = []
    for line, name in _imports(path):
        root = name.split(".")[0]
        if root == "zdiag":
            if not (name == "zdiag" or name.startswith(allowed_zdiag)):
                bad.append((line, name))
        elif root not in allowed_roots:
            bad.append((line, name))
    assert not bad, f"{path} imports outside the collectors' boundary: {bad}"


@pytest.mark.parametrize("path", _sources("analyzers"), ids=lambda p: p.name)
def test_analyzers_never_import_torch_or_ui(path: Path) -> None:
    banned = {"torch", "plotly", "textual", "rich"}
    if path.name != "hta_adapter.py":
        banned.add("hta")
    bad = [(line, name) for line, name in _imports(path) if name.split(".")[0] in banned]
    assert not bad, f"{path} crosses the analysis boundary: {bad}"


def test_only_the_adapter_imports_hta() -> None:
    offenders = []
    for folder in ("zdiag", "collectors", "analyzers", "tui"):
        for path in _sources(folder):
            if path.name == "hta_adapter.py":
                continue
            offenders += [(str(path), n) for _, n in _imports(path) if n.split(".")[0] == "hta"]
    assert not offenders


def test_boundary_checker_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import pandas\nfrom torch import nn\n")
    assert [n for _, n in _imports(bad)] == ["pandas", "torch"]
