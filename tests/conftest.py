"""Shared test fixtures: the repository root and the real traces beside the checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
REAL_TRACES = REPO_ROOT.parent / "shared" / "real_traces"


@pytest.fixture
def real_traces() -> Path:
    """../shared/real_traces (next to the checkout, as in CI); skips when absent."""
    if not REAL_TRACES.is_dir():
        pytest.skip(
            f"real traces not found at {REAL_TRACES} (they live in ../shared next to the checkout)"
        )
    return REAL_TRACES


@pytest.fixture(autouse=True)
def _no_summary_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`zdiag analyze` writes a summary cache beside the traces it reads, and `zdiag run` a
    summary beside each trace from a background process: both off in tests (the repository's
    sample traces stay as they are; no background writer races a test's look at the run
    directory); tests of those features turn them back on."""
    monkeypatch.setenv("ZDIAG_CACHE", "off")
    monkeypatch.setenv("ZDIAG_INJOB_SUMMARY", "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


PROCESS_MARKERS = ("slow", "dist", "browser", "tui")
"""A test that starts a program (`subprocess`: the CLI, torchrun, a browser) carries one of
these markers, so `make unit` (which deselects them) never starts one. Forking is not counted:
the analysis forks workers to isolate an unpickler or decode batches in milliseconds."""


class UnmarkedProcessError(AssertionError):
    """Raised when a test without a process marker starts a program."""


@pytest.fixture(autouse=True)
def _processes_need_a_marker(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fail a test that starts a program without one of PROCESS_MARKERS."""
    if any(request.node.get_closest_marker(m) for m in PROCESS_MARKERS):
        return
    import subprocess

    def refuse(self: object, args: object, *rest: object, **kwargs: object) -> None:
        raise UnmarkedProcessError(
            f"{request.node.nodeid} starts a program ({args!r}) without a marker: "
            f"mark it with one of {', '.join(PROCESS_MARKERS)}"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
