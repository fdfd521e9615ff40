"""The progress line of `zdiag analyze` (issue 17): bytes of JSON, within 80 columns, TTY only."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from support.traces import TraceBuilder
from zdiag.cli import main

KERNELS = 30_000
"""Kernels (each with its launch call): ~60k events, ~12 MB of JSON, 4 decode batches."""


class FakeTTY(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _big_trace(path: Path) -> Path:
    b = TraceBuilder(rank=0, world_size=1)
    per_step = KERNELS // 3
    for k in range(3):
        t0 = k * per_step * 20.0
        b.step(k, t0, per_step * 20.0)
        for i in range(per_step):
            b.kernel("sm90_gemm", t0 + i * 20.0, 15.0, launch_at=t0 + i * 20.0)
    return b.write(path)


def _drawn(text: str) -> list[str]:
    """The states the line went through (each redraw starts with a carriage return)."""
    return [x for x in text.split("\r") if x.strip()]


@pytest.fixture(scope="module")
def big_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # a long name of wide characters: the label must be cut by columns, not characters
    name = "rank-0-" + "训练" * 30 + ".json"
    return _big_trace(tmp_path_factory.mktemp("big") / name)


def _analyze(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    err = FakeTTY()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: the line still stops at 80
    assert main(["analyze", "--no-cache", *argv]) == 0
    return err.getvalue()


def test_one_big_trace_moves_the_line_by_bytes_read(
    big_trace: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert big_trace.stat().st_size > 5_000_000
    text = _analyze([str(big_trace), "-o", str(big_trace.parent / "out.txt")], monkeypatch)
    states = _drawn(text)
    shares = [int(m.group(1)) for s in states if (m := re.search(r"\] +(\d+)% ", s))]
    assert shares == sorted(shares) and shares[-1] == 100
    # the one file is reported while it decodes: shares strictly between 0 and 100
    assert len({p for p in shares if 0 < p < 100}) >= 2, states
    for s in states:
        cols = sum(2 if "\u4e00" <= ch <= "\u9fff" else 1 for ch in s)
        assert cols < 80, s
    assert any("…" in s and "训练.json" in s for s in states)  # cut at the front
    assert text.endswith("\r")  # wiped at the end
    capsys.readouterr()


def test_many_traces_move_the_line_per_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for r in range(4):
        b = TraceBuilder(rank=r, world_size=4)
        b.step(0, 0, 1000)
        b.kernel("sm90_gemm", 50, 500, launch_at=10)
        b.write(tmp_path / f"rank-{r}.json")
    text = _analyze([str(tmp_path), "-o", str(tmp_path / "out.txt")], monkeypatch)
    done = [s for s in _drawn(text) if "reading" not in s]
    assert [re.search(r"(\d+)%", s).group(1) for s in done] == ["25", "50", "75", "100"]  # type: ignore[union-attr]
    capsys.readouterr()


def test_no_line_when_stderr_is_not_a_terminal(
    big_trace: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    assert main(["analyze", "--no-cache", str(big_trace), "-o", str(big_trace.parent / "o")]) == 0
    assert err.getvalue() == ""
    capsys.readouterr()
