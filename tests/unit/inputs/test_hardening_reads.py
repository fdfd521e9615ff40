"""Issue 14, part 5: bounded reads. Regular files only (a FIFO or a link to /dev/zero is refused,
never read), confinement to a folder, a decompressed-size cap with a flag to raise it and no
peak at twice the data, and pickles bounded in bytes, memory and time."""

from __future__ import annotations

import gzip
import os
import pickle
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any

import fuzz_inputs as fz
import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.inputs.cuda_snapshot import SnapshotReader, read_snapshot
from zdiag.analyzers.inputs.memory_timeline import load_memory_timeline
from zdiag.analyzers.inputs.plain_pickle import load_plain_pickle
from zdiag.analyzers.inputs.safe_read import (
    GIB,
    gunzip_capped,
    open_regular,
    read_input_bytes,
    use_limits,
)
from zdiag.analyzers.memory.memory_snapshot import summarize_snapshot
from zdiag.errors import InputError

ROOT = REPO_ROOT
needs_dev_zero = pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")


def zdiag(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The CLI in a child process (a regression that reads a FIFO must not hang the suite)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "zdiag", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def good_trace(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_bytes(fz.trace_bytes(fz.base_trace()))
    return path


@pytest.mark.slow  # starts a program
def test_a_fifo_among_the_traces_is_refused_not_read(tmp_path: Path) -> None:
    good_trace(tmp_path, "rank-0.json")
    fifo = tmp_path / "rank-1.json"
    os.mkfifo(fifo)
    proc = zdiag("analyze", "-q", str(tmp_path))  # discovery leaves the FIFO out (no hang:
    assert proc.returncode == 0, proc.stderr  # zdiag() times out at 60 s)
    proc = zdiag("analyze", "-q", str(tmp_path / "rank-0.json"), str(fifo))  # named: refused
    assert proc.returncode == 2, proc.stderr
    assert "FIFO" in proc.stderr and "not a regular file" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # starts a program
@needs_dev_zero
def test_a_link_to_dev_zero_as_a_trace_is_refused(tmp_path: Path) -> None:
    (tmp_path / "rank-0.json.gz").symlink_to("/dev/zero")
    proc = zdiag("analyze", "-q", str(tmp_path / "rank-0.json.gz"))
    assert proc.returncode == 2 and "is a device" in proc.stderr


@needs_dev_zero
@pytest.mark.parametrize("reader", [read_snapshot, read_input_bytes, load_memory_timeline])
def test_dev_zero_and_fifos_as_records_or_snapshots_are_refused(
    tmp_path: Path, reader: Any
) -> None:
    link = tmp_path / "rank-0.oom.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(InputError, match="is a device"):
        reader(link, 0) if reader is load_memory_timeline else reader(link)
    fifo = tmp_path / "rank-0.snapshot.pickle"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="FIFO"):
        reader(fifo, 0) if reader is load_memory_timeline else reader(fifo)


def test_confinement_to_the_run_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "memory").mkdir(parents=True)
    inside = run / "memory" / "rank-0.oom.json"
    inside.write_text('{"rank": 0}')
    outside = tmp_path / "secret.json"
    outside.write_text('{"rank": 1}')
    (run / "memory" / "escape.json").symlink_to(outside)
    assert read_input_bytes(inside, "OOM record", root=run) == b'{"rank": 0}'
    for path in (run / ".." / "secret.json", run / "memory" / "escape.json"):
        with pytest.raises(InputError, match="outside"):
            read_input_bytes(path, "OOM record", root=run)
    with pytest.raises(InputError, match="outside"):
        read_snapshot(outside, root=run)


def _gzip_bomb(path: Path, mib: int) -> Path:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    body = [c.compress(b'{"traceEvents": [')]
    zeros = b" " * (1 << 20)
    body += [c.compress(zeros) for _ in range(mib)]
    body += [c.compress(b"]}"), c.flush()]
    path.write_bytes(b"".join(body))
    return path


def test_decompressed_size_cap_names_the_flag_and_the_flag_raises_it(tmp_path: Path) -> None:
    bomb = _gzip_bomb(tmp_path / "rank-0.json.gz", 40)
    assert bomb.stat().st_size < 100_000  # a small file ...
    rc, stderr, _ = fz.run_zdiag(["analyze", "-q", "--max-trace-gb", "0.01", str(bomb)])
    assert rc == 2 and "--max-trace-gb" in stderr and "0.01 GiB" in stderr
    rc, stderr, _ = fz.run_zdiag(["analyze", "-q", "--max-trace-gb", "1", str(bomb)])
    assert rc == 2 and "--max-trace-gb" not in stderr  # read in full: no events in it
    rc, stderr, _ = fz.run_zdiag(["analyze", "-q", "--max-trace-gb", "0", str(bomb)])
    assert rc == 2 and "--max-trace-gb must be" in stderr


def test_the_cap_applies_to_plain_files_and_to_timelines(tmp_path: Path) -> None:
    path = good_trace(tmp_path, "rank-0.json")
    with use_limits(max_bytes=1000), pytest.raises(InputError, match="--max-trace-gb"):
        read_input_bytes(path, "trace")
    timeline = tmp_path / "rank-0.timeline.json.gz"
    timeline.write_bytes(gzip.compress(b"[[1, 2], [[0,0], [0,0]]]" + b" " * 5000))
    with use_limits(max_bytes=1000), pytest.raises(InputError, match="--max-trace-gb"):
        read_input_bytes(timeline, "memory timeline")


@pytest.mark.slow  # starts a program
def test_gunzip_peak_is_about_the_data_not_twice(tmp_path: Path) -> None:
    bomb = _gzip_bomb(tmp_path / "big.json.gz", 200)
    script = textwrap.dedent(
        f"""
        import resource
        from pathlib import Path
        from zdiag.analyzers.inputs.safe_read import gunzip_capped
        data = Path({str(bomb)!r}).read_bytes()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = gunzip_capped(data, Path("x"), "trace", 1 << 30)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(len(out), (after - before) * 1024)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    n, grown = map(int, proc.stdout.split())
    assert n > 200 << 20
    assert grown < 1.3 * n, f"peak grew {grown / n:.2f}x the data"


def test_gunzip_capped_stops_at_the_cap() -> None:
    data = gzip.compress(b"\0" * (3 << 20))
    with pytest.raises(InputError, match=r"0\.001 GiB"):
        gunzip_capped(data, Path("x.gz"), "trace", int(0.001 * GIB))
    assert len(gunzip_capped(data, Path("x.gz"), "trace", 3 << 20)) == 3 << 20


def test_a_gzip_bomb_stops_at_the_compression_ratio_unless_the_flag_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zdiag.analyzers.inputs.safe_read as safe_read

    monkeypatch.setattr(safe_read, "GZIP_RATIO_FLOOR_BYTES", 1 << 20)
    bomb = _gzip_bomb(tmp_path / "rank-0.json.gz", 8)  # ~8 KB expanding 1000x
    with pytest.raises(InputError, match=r"more than 100 times .*--max-trace-gb"):
        read_input_bytes(bomb, "trace")
    with use_limits(max_bytes=GIB):  # the user vouches for the file
        assert len(read_input_bytes(bomb, "trace")) > 8 << 20
    real = ROOT / "sample_traces" / "activation-oom" / "traces" / "rank-0.json.gz"  # ~15x
    assert len(read_input_bytes(real, "trace")) > 10 * real.stat().st_size


def test_open_regular_refuses_folders_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="folder"):
        open_regular(tmp_path, "trace")
    with pytest.raises(InputError, match="no such file"):
        open_regular(tmp_path / "nope.json", "trace")


# --- pickles ---------------------------------------------------------------------------------


def _child_peak(code: str) -> tuple[str, int]:
    """Run `code` in a child; (its stdout, how much its peak RSS grew while running it)."""
    script = (
        "import resource\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        + textwrap.dedent(code)
        + "\nprint((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    *lines, grown = proc.stdout.strip().splitlines()
    return "\n".join(lines), int(grown)


@pytest.mark.slow  # starts a program
@pytest.mark.skipif(sys.platform != "linux", reason="the memory budget is an RLIMIT_AS (Linux)")
def test_a_ten_byte_memo_bomb_is_refused_without_taking_memory(tmp_path: Path) -> None:
    bomb = tmp_path / "rank-0.snapshot.pickle"
    bomb.write_bytes(b"\x80\x04]r\xff\xff\xff\x07.")  # LONG_BINPUT 2**27: a 2 GB memo table
    assert len(bomb.read_bytes()) <= 10
    out, grown = _child_peak(
        f"""
        from zdiag.analyzers.inputs.cuda_snapshot import read_snapshot
        from zdiag.errors import InputError
        try:
            read_snapshot({str(bomb)!r})
        except InputError as exc:
            print(exc.message)
        """
    )
    assert "asks for more memory" in out and "not loaded" in out
    assert grown < 300 << 20, f"grew {grown >> 20} MiB"


@pytest.mark.slow  # starts a program
@pytest.mark.skipif(sys.platform != "linux", reason="the memory budget is an RLIMIT_AS (Linux)")
def test_a_memo_bomb_as_a_flight_recorder_dump_is_refused_without_taking_memory(
    tmp_path: Path,
) -> None:
    bomb = tmp_path / "nccl_trace_rank_2"  # sniffs as a dump: {"version": "2.9", "entries": ...
    bomb.write_bytes(
        b"\x80\x02}q\x00(X\x07\x00\x00\x00versionq\x01X\x03\x00\x00\x002.9q\x02"
        b"X\x07\x00\x00\x00entriesq\x03]r\xff\xff\xff\x07u."
    )
    out, grown = _child_peak(
        f"""
        from zdiag.analyzers.inputs.flight_dumps import read_dump
        from zdiag.errors import InputError
        try:
            read_dump({str(bomb)!r})
        except InputError as exc:
            print(exc.message)
        """
    )
    assert "asks for more memory" in out
    assert grown < 300 << 20, f"grew {grown >> 20} MiB"


def test_shared_references_are_walked_once(tmp_path: Path) -> None:
    frames = [{"filename": f"/x/f{i}.py", "name": f"f{i}", "line": i} for i in range(1000)]
    block = {"size": 1 << 20, "state": "active_allocated", "frames": frames}
    segment = {"device": 0, "total_size": 4 << 20, "blocks": [block] * 1000}
    doc = {"segments": [segment] * 1000, "device_traces": [[{"action": "oom", "size": 1}] * 1000]}
    data = pickle.dumps(doc, protocol=4)
    assert len(data) < 70_000  # ... that a naive walk visits 10**9 frames of
    path = tmp_path / "snap.pickle"
    path.write_bytes(data)
    reader = SnapshotReader(path)  # the work, counted: each container and frame once
    reader.read(pickle.loads(data))
    assert reader.items < 10_000, reader.items
    mem = summarize_snapshot(read_snapshot(path))
    assert mem.blocks == 1 and mem.in_use_bytes == 1 << 20  # one block, referenced 10**6 times


def test_a_doubling_list_bomb_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(fz.shared_reference_bomb(40))  # 2**40 leaves if walked naively
    # refused for its shape, never walked (not by the time bound, which would say "longer than")
    with pytest.raises(InputError, match="no 'segments' list"):
        read_snapshot(path)


def test_a_pickle_naming_a_function_is_refused_and_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "snap.pickle"
    path.write_bytes(f"cos\nsystem\n(S'touch {marker}'\ntR.".encode())
    with pytest.raises(InputError, match=r"refusing to load os\.system"):
        load_plain_pickle(path, "flight-recorder dump")
    assert not marker.exists()


def test_the_pickle_byte_cap(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(fz.snapshot_doc()))
    with use_limits(max_bytes=50), pytest.raises(InputError, match="--max-trace-gb"):
        read_snapshot(path)
