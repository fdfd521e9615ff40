"""The architecture's import boundaries, checked on the source (AST), not by convention.

- collectors/ runs inside training: only the standard library, torch, zmq and zdiag's own
  collectors/errors and the live stream's training side (`TRAINING_LIVE`) may be imported; the
  stream (`LIVE_STREAM`) itself imports only the standard library, zmq, zdiag.errors and itself.
- the Textual apps (tui/) only draw: the Report, the view layer and the live monitor's model.
- analyzers/ never imports torch; only analyzers/inputs/hta_adapter.py imports hta.
- analysis never prints or draws: no plotly/textual in analyzers/.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from support.imports import module_imports as _imports

STDLIB = set(sys.stdlib_module_names)


def test_relative_imports_resolve_to_the_installed_names() -> None:
    path = REPO_ROOT / "analyzers" / "detectors" / "context.py"
    names = {name for _, name in _imports(path)}
    assert "zdiag.collectors.run_records" in names and "zdiag.analyzers.rank.fsdp_ledger" in names


def _sources(folder: str) -> list[Path]:
    return sorted((REPO_ROOT / folder).rglob("*.py"))


TRAINING_LIVE = ("zdiag.live.wire", "zdiag.live.auth", "zdiag.live.publisher")
"""The live modules the training side needs (the stream's format, its keys, the publisher)."""


def training_violations(
    path: Path, allowed_roots: set[str], allowed_zdiag: tuple[str, ...]
) -> list[tuple[int, str]]:
    """Imports in `path` outside `allowed_roots` (top-level names) and `allowed_zdiag` (zdiag
    modules, with their submodules)."""
    bad = []
    for line, name in _imports(path):
        root = name.split(".")[0]
        if root == "zdiag":
            if not (
                name == "zdiag" or any(name == a or name.startswith(a + ".") for a in allowed_zdiag)
            ):
                bad.append((line, name))
        elif root not in allowed_roots:
            bad.append((line, name))
    return bad


@pytest.mark.parametrize("path", _sources("collectors"), ids=lambda p: p.name)
def test_collectors_import_only_stdlib_torch_zmq(path: Path) -> None:
    allowed = ("zdiag.collectors", "zdiag.errors", *TRAINING_LIVE)
    bad = training_violations(path, STDLIB | {"torch", "zmq", "__future__"}, allowed)
    assert not bad, f"{path} imports outside the collectors' boundary: {bad}"


LIVE_STREAM = (*TRAINING_LIVE, "zdiag.live.receiver")
"""The stream's modules: the training side, and the receiver (its relay may run inside a rank)."""


@pytest.mark.parametrize("module", LIVE_STREAM)
def test_the_live_stream_imports_only_stdlib_zmq_and_itself(module: str) -> None:
    path = REPO_ROOT.joinpath(*module.split(".")).with_suffix(".py")
    allowed = ("zdiag.errors", *LIVE_STREAM)
    bad = training_violations(path, STDLIB | {"zmq", "__future__"}, allowed)
    assert not bad, f"{path} imports outside the training side's boundary: {bad}"


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


# --- layers inside zdiag: which zdiag modules each layer may import --------------------------

LAYER_RULES: dict[str, tuple[str, ...]] = {
    # analysis is a library: no presentation, no CLI, no training harness
    "analyzers": (
        "zdiag.render",
        "zdiag.tui",
        "zdiag.commands",
        "zdiag.harness",
        "zdiag.cli",
    ),
    # collectors run inside training ranks and never need the analysis
    "collectors": (
        "zdiag.analyzers",
        "zdiag.render",
        "zdiag.tui",
        "zdiag.commands",
        "zdiag.harness",
        "zdiag.cli",
    ),
    # the live stream and the monitor's model: the Textual app draws it, never the reverse
    "zdiag/live": ("zdiag.tui", "zdiag.commands", "zdiag.harness", "zdiag.cli"),
}
"""Folder -> zdiag modules its files must not import (the folder's layer sits below them)."""

TUI_ALLOWED = (
    "zdiag.tui",
    "zdiag.analyzers.report",
    "zdiag.analyzers.compare.model",  # the RunDiff: a value like the Report
    "zdiag.render",
    "zdiag.errors",
    "zdiag.live.state",
    "zdiag.live.history",
    "zdiag.live.findings",
)
"""The Textual apps see the Report (a value), the view layer, the live monitor's model (its views,
and the constants they show) and their own modules only: no analysis, no sockets."""


def layer_violations(path: Path, forbidden: tuple[str, ...]) -> list[tuple[int, str]]:
    """The imports in `path` that name one of the `forbidden` modules (or a submodule)."""
    return [
        (line, name)
        for line, name in _imports(path)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


@pytest.mark.parametrize(
    ("folder", "path"),
    [(folder, p) for folder in LAYER_RULES for p in _sources(folder)],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_layers(folder: str, path: Path) -> None:
    bad = layer_violations(path, LAYER_RULES[folder])
    assert not bad, f"{path} imports from a layer above {folder}/: {bad}"


def tui_violations(path: Path) -> list[tuple[int, str]]:
    """zdiag imports of a tui/ file outside the Report, the view layer and tui/ itself."""
    return [
        (line, name)
        for line, name in _imports(path)
        if name.split(".")[0] == "zdiag" and name != "zdiag" and not name.startswith(TUI_ALLOWED)
    ]


@pytest.mark.parametrize("path", _sources("tui"), ids=lambda p: p.name)
def test_tui_sees_only_the_report_and_the_view_layer(path: Path) -> None:
    bad = tui_violations(path)
    assert not bad, f"{path} reaches past the Report and the view layer: {bad}"


def test_layer_rules_catch_a_forbidden_import(tmp_path: Path) -> None:
    """The layer checks fail when a forbidden import is added (a planted file per rule)."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from zdiag.render.text import render_text\n"
        "import zdiag.analyzers.engine.pipeline\n"
        "from zdiag.analyzers.report import Report\n"
    )
    assert layer_violations(planted, LAYER_RULES["analyzers"]) == [(1, "zdiag.render.text")]
    assert [n for _, n in layer_violations(planted, LAYER_RULES["collectors"])] == [
        "zdiag.render.text",
        "zdiag.analyzers.engine.pipeline",
        "zdiag.analyzers.report",
    ]
    assert tui_violations(planted) == [(2, "zdiag.analyzers.engine.pipeline")]


def test_the_training_boundary_catches_a_live_module_beyond_the_publisher(tmp_path: Path) -> None:
    """The collectors may import the publisher, not the monitor's receiver or its model."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from zdiag.live.publisher import publisher_from_env\n"
        "from zdiag.live.receiver import LiveReceiver\n"
        "import zdiag.live.state\n"
        "import zdiag.live_wire\n"
    )
    allowed = ("zdiag.collectors", "zdiag.errors", *TRAINING_LIVE)
    assert training_violations(planted, STDLIB, allowed) == [
        (2, "zdiag.live.receiver"),
        (3, "zdiag.live.state"),
        (4, "zdiag.live_wire"),
    ]
    assert [n for _, n in tui_violations(planted)] == [
        "zdiag.live.publisher",
        "zdiag.live.receiver",
        "zdiag.live_wire",
    ]


def test_no_test_module_imports_another() -> None:
    """Shared test helpers live in tests/support/, never in a test module another one imports."""
    offenders = []
    for path in sorted((REPO_ROOT / "tests").rglob("test_*.py")):
        offenders += [
            (path.name, n) for _, n in _imports(path) if n.split(".")[0].startswith("test_")
        ]
    assert not offenders, offenders
