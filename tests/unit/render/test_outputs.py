"""Outputs never destroy inputs (issue 14, part 1), reproduced with real files and nodes.

`-o`, `--html` and `--perfetto` of `zdiag analyze` and `zdiag render`:
- pointed at an input (a trace, any file of an input run directory, by path, symlink or hard
  link) are refused: one sentence, exit 2, nothing written;
- pointed at a character device or a FIFO, write through it (the node stays what it was); through
  a symlink, write the file it points to (the link stays a link);
- a full disk, on stdout or on a file, is exit 2 with one sentence and leaves nothing behind.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.report import decode_report, encode_report
from zdiag.cli import main
from zdiag.render._sample import sample_report

SAMPLE_RUN = REPO_ROOT / "sample_traces" / "none"
OUTPUT_OPTIONS = ("-o", "--html", "--perfetto")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A copy of a small recorded run directory (2 ranks, manifest.json, step logs)."""
    return Path(shutil.copytree(SAMPLE_RUN, tmp_path / "run"))


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `folder`: its mode and bytes (to prove nothing changed)."""
    return {
        str(p.relative_to(folder)): (p.lstat().st_mode, p.read_bytes() if p.is_file() else b"")
        for p in sorted(folder.rglob("*"))
    }


def _zdiag(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _refused(code: int, out: str, err: str, option: str) -> None:
    assert code == 2, err
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert option.lstrip("-") in err and "input" in err, err


# --- outputs aimed at inputs --------------------------------------------------------------


@pytest.mark.parametrize("option", OUTPUT_OPTIONS)
def test_an_output_over_the_input_trace_is_refused(
    option: str, run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = run_dir / "traces" / "rank-0.json.gz"
    before = _snapshot(tmp_path)
    code, out, err = _zdiag(["analyze", str(trace), option, str(trace)], capsys)
    _refused(code, out, err, option)
    assert _snapshot(tmp_path) == before  # the trace intact, no temporary file


@pytest.mark.parametrize("option", OUTPUT_OPTIONS)
def test_an_output_over_a_file_of_the_input_run_directory_is_refused(
    option: str, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(run_dir)
    for victim in ("manifest.json", "steps/rank-0.jsonl", "manifest.d/rank-1.json"):
        code, out, err = _zdiag(["analyze", str(run_dir), option, str(run_dir / victim)], capsys)
        _refused(code, out, err, option)
    assert _snapshot(run_dir) == before


def test_symlinks_and_hard_links_to_an_input_are_refused(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Compared by resolved path (a symlink) and by inode (a hard link elsewhere)."""
    manifest = run_dir / "manifest.json"
    trace = run_dir / "traces" / "rank-1.json.gz"
    sym = tmp_path / "manifest-link.json"
    sym.symlink_to(manifest)
    hard = tmp_path / "hard-trace.json.gz"
    os.link(trace, hard)
    before = _snapshot(tmp_path)
    cases = [
        ([str(run_dir), "--html", str(sym)], "--html"),  # symlink into the run directory
        ([str(run_dir), "-o", str(hard)], "--output"),  # hard link to one of its traces
        ([str(trace), "--perfetto", str(hard)], "--perfetto"),  # hard link to the input trace
        ([str(hard), "-o", str(trace)], "--output"),  # the other way round
    ]
    for argv, option in cases:
        code, out, err = _zdiag(["analyze", *argv], capsys)
        _refused(code, out, err, option)
    assert _snapshot(tmp_path) == before
    assert sym.is_symlink() and os.readlink(sym) == str(manifest)


def test_a_file_per_rank_over_the_run_directory_traces_is_refused(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--perfetto DIR/rank-{rank}.json.gz` names the ranks' own traces only once the ranks are
    known: each file is checked before the first is written (it used to overwrite them)."""
    before = _snapshot(run_dir)
    target = run_dir / "traces" / "rank-{rank}.json.gz"
    code, _, err = _zdiag(["analyze", str(run_dir), "-q", "--perfetto", str(target)], capsys)
    assert code == 2 and "--perfetto" in err and "is an input" in err, err
    assert err.strip().splitlines()[-1].startswith("zdiag analyze: error: ")
    assert _snapshot(run_dir) == before


def test_a_new_file_inside_the_run_directory_is_allowed(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `zdiag demo` does: report.html next to the traces (it overwrites no input)."""
    code, _, err = _zdiag(["analyze", str(run_dir), "--html", str(run_dir / "report.html")], capsys)
    assert code == 0, err
    assert (run_dir / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_two_outputs_to_one_file_are_refused(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "out.json"
    code, out, err = _zdiag(
        ["analyze", str(run_dir), "-o", str(target), "--perfetto", str(target)], capsys
    )
    assert code == 2 and out == "" and "same file" in err
    assert not target.exists()


@pytest.mark.parametrize("option", OUTPUT_OPTIONS)
def test_zdiag_render_refuses_to_overwrite_its_report(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "report.json"
    saved.write_bytes(encode_report(sample_report(ranks=2, steps=3)))
    link = tmp_path / "link.json"
    link.symlink_to(saved)
    before = _snapshot(tmp_path)
    for target in (saved, link):
        code, out, err = _zdiag(["render", str(saved), option, str(target)], capsys)
        _refused(code, out, err, option)
    assert _snapshot(tmp_path) == before
    assert decode_report(saved.read_bytes()).ranks


# --- devices, FIFOs, symlinks -------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a device node needs root")
@pytest.mark.parametrize("option", OUTPUT_OPTIONS)
def test_a_character_device_is_written_through_not_replaced(
    option: str, run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`-o /dev/null` as root: the device node stays a device (a private null node here, so a
    regression cannot replace the machine's /dev/null)."""
    null = tmp_path / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.stat("/dev/null").st_rdev)
    code, _, err = _zdiag(["analyze", str(run_dir), option, str(null)], capsys)
    assert code == 0, err
    st = os.lstat(null)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.stat("/dev/null").st_rdev
    assert [p.name for p in tmp_path.iterdir() if p.name != "run"] == ["null"]


def _drain_fifo(path: Path, into: list[bytes]) -> threading.Thread:
    def read() -> None:
        with open(path, "rb") as fifo:
            into.append(fifo.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


@pytest.mark.parametrize("option", OUTPUT_OPTIONS)
def test_a_fifo_is_written_through(
    option: str, run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = _drain_fifo(fifo, received)
    code, _, err = _zdiag(["analyze", str(run_dir), option, str(fifo)], capsys)
    reader.join(timeout=60)
    assert code == 0, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    data = received[0]
    expected_start = {"-o": b"zdiag ", "--html": b"<!DOCTYPE html>", "--perfetto": b'{"trace'}
    assert data.startswith(expected_start[option])


def test_zdiag_render_writes_through_a_fifo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "report.json"
    saved.write_bytes(encode_report(sample_report(ranks=2, steps=3)))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = _drain_fifo(fifo, received)
    code, _, err = _zdiag(["render", str(saved), "--text", "-o", str(fifo)], capsys)
    reader.join(timeout=60)
    assert code == 0, err
    assert received[0].startswith(b"zdiag ") and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_symlink_output_writes_its_target_and_stays_a_link(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = tmp_path / "reports"
    elsewhere.mkdir()
    old = elsewhere / "old.html"
    old.write_text("old")
    link = tmp_path / "report.html"
    link.symlink_to(old)
    dangling = tmp_path / "overlay.json"
    dangling.symlink_to(elsewhere / "new-overlay.json")
    code, _, err = _zdiag(
        ["analyze", str(run_dir), "--html", str(link), "--perfetto", str(dangling)], capsys
    )
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(old)
    assert old.read_text().startswith("<!DOCTYPE html>")
    assert dangling.is_symlink() and (elsewhere / "new-overlay.json").read_bytes().startswith(b"{")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["new-overlay.json", "old.html"]


def test_folders_and_sockets_are_refused(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sock_path = tmp_path / "s"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(sock_path))
        for target, what in ((tmp_path, "folder"), (sock_path, "socket")):
            code, out, err = _zdiag(["analyze", str(run_dir), "-o", str(target)], capsys)
            assert code == 2 and out == "" and what in err, err
        assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    finally:
        server.close()


# --- full disks -----------------------------------------------------------------------------


def _zdiag_process(args: list[str], stdout: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "zdiag", *args],
        stdout=stdout if stdout is not None else subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def _full_device(tmp_path: Path) -> Path:
    """A device that fails every write with ENOSPC: a private copy of /dev/full's node (as root),
    so that a regression replacing the node cannot replace the machine's /dev/full."""
    if not stat.S_ISCHR(os.stat("/dev/full").st_mode) or os.geteuid() != 0:
        pytest.skip("needs root and a character device /dev/full")
    full = tmp_path / "full"
    os.mknod(full, stat.S_IFCHR | 0o666, os.stat("/dev/full").st_rdev)
    return full


@pytest.mark.slow  # starts a program
def test_a_full_disk_on_stdout_is_one_sentence(run_dir: Path, tmp_path: Path) -> None:
    """`zdiag analyze X --json > /dev/full` and `zdiag render R > /dev/full`."""
    full = _full_device(tmp_path)
    saved = tmp_path / "report.json"
    saved.write_bytes(encode_report(sample_report(ranks=2, steps=3)))
    for args in (["analyze", str(run_dir), "--json", "-q"], ["render", str(saved)]):
        fd = os.open(full, os.O_WRONLY)
        try:
            res = _zdiag_process(args, stdout=fd)
        finally:
            os.close(fd)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "no space left" in lines[0].lower(), res.stderr
        assert "standard output" in lines[0]


@pytest.mark.parametrize("option", OUTPUT_OPTIONS)
def test_a_full_disk_on_an_output_device_is_one_sentence(
    option: str, run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = _full_device(tmp_path)
    code, _, err = _zdiag(["analyze", str(run_dir), "-q", option, str(full)], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "no space left" in err.lower(), err
    assert stat.S_ISCHR(os.lstat(full).st_mode)  # still the device, not a file


@pytest.mark.parametrize("option", OUTPUT_OPTIONS)
def test_a_full_disk_on_a_file_is_one_sentence_and_leaves_nothing(
    option: str,
    run_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The disk fills while the temporary file is written: the old file stays, no temp left."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = out_dir / "report"
    target.write_text("old")

    def full(self: Path, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_bytes", full)
    code, _, err = _zdiag(["analyze", str(run_dir), option, str(target)], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "no space left" in err.lower(), err
    assert [p.name for p in out_dir.iterdir()] == ["report"] and target.read_text() == "old"
