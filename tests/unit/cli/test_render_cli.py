"""`zdiag render REPORT.json`: a saved report re-rendered; every unusable file is one sentence."""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

import pytest

from zdiag.analyzers.report import encode_report
from zdiag.cli import main
from zdiag.render._sample import sample_report


def _render(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["render", *argv])
    out, err = capsys.readouterr()
    return code, out, err


BAD_REPORTS: dict[str, tuple[bytes, str]] = {
    "empty file": (b"", "not a JSON report"),
    "truncated": (encode_report(sample_report(ranks=1, steps=2))[:-40], "not a JSON report"),
    "not JSON": (b"<html></html>", "not a JSON report"),
    "a trace, not a report": (b'{"traceEvents": []}', "not a zdiag report"),
    "a newer schema": (b'{"schema": "zdiag.report/2"}', "newer than this zdiag"),
    "a wrong field type": (b'{"schema": "zdiag.report/1", "ranks": 3}', "malformed zdiag report"),
    "invalid UTF-8": (b'{"schema": "zdiag.report/1", "inputs": ["\xff\xfe"]}', "utf-8"),
    "deep nesting": (
        b'{"schema": "zdiag.report/1", "run": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
        "cannot be rendered",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REPORTS))
def test_an_unusable_report_is_one_sentence_and_exit_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, says = BAD_REPORTS[case]
    path = tmp_path / "report.json"
    path.write_bytes(data)
    html = tmp_path / "out.html"
    code, out, err = _render([str(path), "--html", str(html)], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("zdiag render: error: ") and says.lower() in lines[0].lower()
    assert str(path) in lines[0]
    assert not html.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_missing_folder_and_no_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, says in (
        ([str(tmp_path / "nope.json")], "does not exist"),
        ([str(tmp_path)], "not a regular file"),
        ([], "no report given"),
    ):
        code, out, err = _render(argv, capsys)
        assert code == 2 and out == "" and says in err and len(err.strip().splitlines()) == 1


def test_a_fifo_as_the_report_is_refused_without_hanging(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    result: list[tuple[int, str, str]] = []
    worker = threading.Thread(target=lambda: result.append(_render([str(fifo)], capsys)))
    worker.start()
    worker.join(timeout=30)
    if worker.is_alive():  # unblock the reader before failing
        with open(fifo, "wb"):
            pass
        worker.join()
        pytest.fail("zdiag render blocked reading a FIFO")
    code, _, err = result[0]
    assert code == 2 and "not a regular file" in err


def test_tui_with_a_file_output_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "r.json"
    saved.write_bytes(encode_report(sample_report(ranks=1, steps=1)))
    code, _, err = _render([str(saved), "--tui", "-o", str(tmp_path / "x.txt")], capsys)
    assert code == 2 and "--tui" in err and not (tmp_path / "x.txt").exists()


def test_several_formats_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "r.json"
    saved.write_bytes(encode_report(sample_report(ranks=2, steps=3)))
    html, overlay = tmp_path / "r.html", tmp_path / "o.json"
    code, out, err = _render(
        [str(saved), "--text", "--html", str(html), "--perfetto", str(overlay)], capsys
    )
    assert code == 0, err
    assert out.startswith("zdiag ") and "Rank 0" in out
    assert html.read_text().startswith("<!DOCTYPE html>") and overlay.read_bytes().startswith(b"{")
    code, out, _ = _render([str(saved), "--html", str(html)], capsys)
    assert code == 0 and out == ""  # no text unless asked, when another format is


def _options(command: str) -> dict[str, argparse.Action]:
    """The options of `zdiag COMMAND`, by flag."""
    from zdiag.cli import build_parser

    top = build_parser([command])
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: a for a in sub.choices[command]._actions for flag in a.option_strings}


def test_output_flags_come_from_the_registry() -> None:
    from zdiag.render.renderer import FORMATS

    for command in ("analyze", "render"):
        options = _options(command)
        offered = [fmt for fmt in FORMATS if command in fmt.commands]
        assert {"--html", "--perfetto", "--tui"} <= {fmt.flag for fmt in offered}
        for fmt in offered:
            action = options[fmt.flag]
            assert action.help == fmt.help and action.metavar == fmt.metavar
            assert (action.type is Path) == (fmt.kind == "file")
        assert "-o" in options
    assert "--json" in _options("analyze") and "--json" not in _options("render")
    assert "--text" in _options("render") and "--text" not in _options("analyze")


def test_a_new_format_is_one_renderer_and_one_registry_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A made-up CSV format, registered with one line, gets its flag in `zdiag render`, the
    refusal to overwrite the input, and the writer's line on stderr."""
    import sys
    import types

    from zdiag.analyzers.report import Report
    from zdiag.render import renderer as registry
    from zdiag.render.renderer import Destination, OutputFormat, Rendered

    class CsvRenderer:
        name = "csv"

        def render(self, report: Report, destination: Destination) -> Rendered:
            rows = [f"{r.rank},{len(r.steps)}" for r in report.ranks]
            return Rendered.one(destination, ("rank,steps\n" + "\n".join(rows) + "\n").encode())

    module = types.ModuleType("zdiag_test_csv")
    module.CsvRenderer = CsvRenderer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "zdiag_test_csv", module)
    line = OutputFormat("csv", "zdiag_test_csv", "CsvRenderer", "file", "write CSV", "the CSV")
    monkeypatch.setattr(registry, "FORMATS", (*registry.FORMATS, line))
    saved = tmp_path / "r.json"
    saved.write_bytes(encode_report(sample_report(ranks=2, steps=3)))
    code, out, err = _render([str(saved), "--csv", str(tmp_path / "r.csv")], capsys)
    assert code == 0 and out == "", err
    assert (tmp_path / "r.csv").read_text() == "rank,steps\n0,3\n1,3\n"
    assert f"zdiag: wrote the CSV to {tmp_path / 'r.csv'}" in err
    code, _, err = _render([str(saved), "--csv", str(saved)], capsys)
    assert code == 2 and "--csv" in err and "is an input" in err
    assert saved.read_bytes() == encode_report(sample_report(ranks=2, steps=3))


def test_a_file_per_rank_never_overwrites_the_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--perfetto DIR/rank-{rank}.json` names files only once the ranks are known: each is
    checked against the inputs before the first is written."""
    saved = tmp_path / "rank-1.json"
    data = encode_report(sample_report(ranks=2, steps=3))
    saved.write_bytes(data)
    code, _, err = _render([str(saved), "--perfetto", str(tmp_path / "rank-{rank}.json")], capsys)
    assert code == 2 and "is an input" in err and len(err.strip().splitlines()) == 1
    assert saved.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-1.json"]  # rank 0 not written
