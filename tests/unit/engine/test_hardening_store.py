"""Issue 24, stored summaries: the summary cache and in-job summaries attacked as a co-tenant on
a shared filesystem would, and as a careless user would.

Each case reproduces one reported failure. "Another user" is a file chowned to a uid that is not
ours, so the ownership cases need root (CI runs as root) and skip otherwise.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import fuzz_inputs as fz
import msgspec
import pytest

from conftest import REPO_ROOT
from support.traces import TraceBuilder, small_job
from zdiag.analyzers.engine.summarize_trace import main as summarize_main
from zdiag.analyzers.engine.summary_pipeline import (
    SummaryOptions,
    SummaryRun,
    analyze_via_summaries,
)
from zdiag.analyzers.engine.summary_store import (
    CACHE_DIR_NAME,
    StoredSummary,
    read_stored,
    summary_path_for,
    write_stored,
)
from zdiag.analyzers.report import Report, encode_report
from zdiag.render.text import render_text

REPO = REPO_ROOT
SAMPLE = REPO / "sample_traces" / "none"
OTHER_UID = 4242
as_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root"
)


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.delenv("ZDIAG_CACHE", raising=False)
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    return xdg


def _job(folder: Path, late_rank: int | None = 2) -> Path:
    """Four small traces; `late_rank` arrives late at every all-reduce (a straggler finding)."""
    return small_job(folder, ranks=4, late=late_rank)


def _analyze(paths: list[Path], **kw: Any) -> SummaryRun:
    return analyze_via_summaries(paths, SummaryOptions(**kw))


def _decoded_everything(paths: list[Path]) -> Report:
    return _analyze(paths, use_stored=False, write_cache=False).report


def _same_but_warnings(
    report: Report, expected: Report, moved: tuple[Path, Path] | None = None
) -> list[str]:
    """The report's warnings, after checking that all else is `expected` (the traces decoded;
    `moved`: the folder they were decoded in, and where they are now)."""
    assert expected.warnings == []
    want = encode_report(expected)
    if moved is not None:
        want = want.replace(str(moved[0]).encode(), str(moved[1]).encode())
    assert encode_report(msgspec.structs.replace(report, warnings=[])) == want
    return report.warnings


def _chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid, follow_symlinks=False)
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            _chown_tree(child, uid)


def _entry(job: Path, rank: int) -> Path:
    return job / CACHE_DIR_NAME / f"rank-{rank}.json.zds"


def _forged(victim: StoredSummary, donor: StoredSummary) -> StoredSummary:
    """The donor's summary (another run) under the victim's fingerprint and keys."""
    return msgspec.structs.replace(victim, summary_msgpack=donor.summary_msgpack)


# --- writes never follow a planted link ------------------------------------------------------


@as_root
def test_a_cotenants_cache_folder_is_not_written_into(tmp_path: Path, _cache_on: Path) -> None:
    """A co-tenant creates `.zdiag-cache` first in a shared folder, with links where entries and
    temporary files would go: nothing of the victim's is overwritten, nothing is written there."""
    job = _job(tmp_path / "shared")
    victim_file = tmp_path / "victim.txt"
    victim_file.write_text("precious")
    planted = job / CACHE_DIR_NAME
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    for r in range(4):
        (planted / f"rank-{r}.json.zds").symlink_to(victim_file)
        for pid in range(os.getpid() - 2, os.getpid() + 3):
            (planted / f".rank-{r}.json.zds.tmp-{pid}").symlink_to(victim_file)
    _chown_tree(planted, OTHER_UID)
    before = sorted(p.name for p in planted.iterdir())
    run = _analyze([job])
    assert victim_file.read_text() == "precious"
    assert sorted(p.name for p in planted.iterdir()) == before
    assert any(f"belongs to uid {OTHER_UID}" in w for w in run.report.warnings)
    assert len(list((_cache_on / "zdiag").glob("*.zds"))) == 4  # the user's own cache instead
    assert _analyze([job]).sources.cache == 4


def test_a_cache_folder_that_is_a_link_is_not_followed(tmp_path: Path, _cache_on: Path) -> None:
    job = _job(tmp_path / "job")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (job / CACHE_DIR_NAME).symlink_to(elsewhere)
    run = _analyze([job])
    assert list(elsewhere.iterdir()) == []
    assert any("symbolic link" in w for w in run.report.warnings)
    assert len(list((_cache_on / "zdiag").glob("*.zds"))) == 4


def test_a_link_at_an_entry_is_replaced_not_written_through(tmp_path: Path) -> None:
    """In the user's own folder (group-writable, say), a link planted where an entry or an in-job
    summary goes is replaced by the entry; its target is untouched."""
    job = _job(tmp_path / "job")
    target = tmp_path / "target.txt"
    target.write_text("precious")
    (job / CACHE_DIR_NAME).mkdir()
    _entry(job, 0).symlink_to(target)
    _analyze([job])
    assert target.read_text() == "precious"
    assert _entry(job, 0).is_file() and not _entry(job, 0).is_symlink()
    run_dir = tmp_path / "run"
    shutil.copytree(SAMPLE, run_dir)
    trace = run_dir / "traces" / "rank-0.json.gz"
    summary_path_for(trace).symlink_to(target)
    assert summarize_main([str(trace), str(summary_path_for(trace))]) == 0
    assert target.read_text() == "precious"
    assert not summary_path_for(trace).is_symlink()
    assert read_stored(summary_path_for(trace)) is not None


# --- who may supply a stored summary ---------------------------------------------------------


@as_root
def test_a_planted_cache_entry_of_another_run_is_ignored(tmp_path: Path) -> None:
    """An entry with the victim trace's fingerprint (anyone who can read the trace can compute
    it) but a healthy run's summary: it used to turn the straggler finding into no finding."""
    victim = _job(tmp_path / "victim", late_rank=2)
    healthy = _job(tmp_path / "healthy", late_rank=None)
    expected = _decoded_everything([victim])
    assert _analyze([victim]).report.findings  # the straggler
    _analyze([healthy])
    for r in range(4):
        donor = read_stored(_entry(healthy, r))
        mine = read_stored(_entry(victim, r))
        assert donor is not None and mine is not None
        assert write_stored(_entry(victim, r), _forged(mine, donor))
        os.chown(_entry(victim, r), OTHER_UID, OTHER_UID)
    run = _analyze([victim], write_cache=False)
    assert run.sources.cache == 0 and run.sources.mapped == 4
    warnings = _same_but_warnings(run.report, expected)
    assert any("not trusted" in w and "(and 3 more)" in w for w in warnings)


@as_root
def test_a_forged_in_job_summary_is_ignored(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(SAMPLE, run_dir)
    expected = _decoded_everything([run_dir])
    donor_dir = tmp_path / "donor"
    shutil.copytree(REPO / "sample_traces" / "missing-overlap", donor_dir)
    for r in (0, 1):
        trace = run_dir / "traces" / f"rank-{r}.json.gz"
        donor_trace = donor_dir / "traces" / f"rank-{r}.json.gz"
        assert summarize_main([str(trace), str(summary_path_for(trace))]) == 0
        assert summarize_main([str(donor_trace), str(summary_path_for(donor_trace))]) == 0
        mine = read_stored(summary_path_for(trace))
        donor = read_stored(summary_path_for(donor_trace))
        assert mine is not None and donor is not None
        assert write_stored(summary_path_for(trace), _forged(mine, donor))
        os.chown(summary_path_for(trace), OTHER_UID, OTHER_UID)
    run = _analyze([run_dir], write_cache=False)
    assert run.sources.in_job == 0 and run.sources.mapped == 2
    warnings = _same_but_warnings(run.report, expected)
    assert any("rank-0.summary.zds belongs to uid" in w for w in warnings)


def test_an_entry_others_can_write_is_ignored(tmp_path: Path) -> None:
    job = _job(tmp_path / "job")
    _analyze([job])
    _entry(job, 1).chmod(0o666)
    run = _analyze([job], write_cache=False)
    assert (run.sources.cache, run.sources.mapped) == (3, 1)
    assert any("writable by other users (mode 666)" in w for w in run.report.warnings)


def test_entries_are_written_for_their_owner_alone(tmp_path: Path) -> None:
    job = _job(tmp_path / "job")
    old = os.umask(0o000)
    try:
        _analyze([job])
    finally:
        os.umask(old)
    assert (_entry(job, 0).stat().st_mode & 0o777) == 0o644
    assert _analyze([job]).sources.cache == 4


# --- reads never wait: FIFOs where stored summaries go ---------------------------------------


@pytest.mark.slow  # starts a program
def test_a_fifo_in_place_of_an_entry_or_in_job_summary_does_not_hang(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(SAMPLE, run_dir)
    os.mkfifo(summary_path_for(run_dir / "traces" / "rank-0.json.gz"))
    (run_dir / "traces" / CACHE_DIR_NAME).mkdir()
    os.mkfifo(run_dir / "traces" / CACHE_DIR_NAME / "rank-1.json.gz.zds")
    proc = subprocess.run(
        [sys.executable, "-m", "zdiag", "analyze", "-q", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 0, proc.stderr
    report = msgspec.json.decode(proc.stdout, type=Report)
    assert any("is not a regular file" in w for w in report.warnings)
    assert len(report.ranks) == 2


# --- crafted entries of the user's own: a warning and the trace decoded, never exit 70 -------


def _rewrite_summary(entry: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the summary inside a stored entry (as plain msgpack data) and store it again, as
    the user who owns it: trusted, only its content is crafted."""
    stored = read_stored(entry)
    assert stored is not None
    tree = msgspec.msgpack.decode(stored.summary_msgpack)
    edit(tree)
    payload = msgspec.msgpack.encode(tree)
    assert write_stored(entry, msgspec.structs.replace(stored, summary_msgpack=payload))


def _craft(tree: dict[str, Any], how: str) -> None:
    calls = tree["collectives"]
    if how == "odd-length buffer":
        calls["start_us"] = calls["start_us"][:-3]
    elif how == "kind index out of range":
        calls["kind"] = b"\xff\xff" * (len(calls["kind"]) // 2)
    elif how == "group index out of range":
        calls["group"] = b"\x07\x00" * (len(calls["group"]) // 2)
    elif how == "columns of mismatched lengths":
        calls["step"] = calls["step"][:-4]
    elif how == "NaN step time":
        tree["steps"][0]["duration_ms"] = math.nan
    elif how == "NaN step number":
        tree["steps"][0]["step"] = math.nan
    elif how == "negative step number":
        tree["steps"][0]["step"] = -5
    elif how == "rank -7":
        tree["rank"] = -7
    elif how == "rank 2^62":
        tree["rank"] = 2**62
    elif how == "infinite collective time":
        tree["collectives"]["end_us"] = b"\x00" * 6 + b"\xf0\x7f" + calls["end_us"][8:]
    elif how == "ledger of another rank":
        tree["ledger"]["rank"] = 3
    elif how == "NaN in a step model's collective":
        tree["step_models"][0]["ops"][1][5] = math.nan  # array-like ModelOp: its dur_us
    elif how == "infinite step model position":
        tree["step_models"][-1]["ops"][-1][2] = math.inf  # its issue_pos_us
    else:
        raise AssertionError(how)


CRAFTS = [
    "odd-length buffer",
    "kind index out of range",
    "group index out of range",
    "columns of mismatched lengths",
    "NaN step time",
    "NaN step number",
    "negative step number",
    "rank -7",
    "rank 2^62",
    "infinite collective time",
    "ledger of another rank",
    "NaN in a step model's collective",
    "infinite step model position",
]


@pytest.fixture(scope="module")
def sample_entries(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Report]:
    """The sample run with its cache written, and the report of its decoded traces."""
    root = tmp_path_factory.mktemp("crafted")
    job = root / "job"
    shutil.copytree(SAMPLE, job)
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(root / "xdg")
    try:
        expected = _decoded_everything([job])
        _analyze([job])
    finally:
        if old is None:
            os.environ.pop("XDG_CACHE_HOME")
        else:
            os.environ["XDG_CACHE_HOME"] = old
    return job, expected


@pytest.mark.parametrize("how", CRAFTS)
def test_a_crafted_entry_is_a_warning_and_the_trace_decoded(
    how: str, sample_entries: tuple[Path, Report], tmp_path: Path
) -> None:
    job = tmp_path / "job"
    shutil.copytree(sample_entries[0], job)
    _rewrite_summary(
        job / "traces" / CACHE_DIR_NAME / "rank-0.json.gz.zds", partial(_craft, how=how)
    )
    run = _analyze([job], write_cache=False)
    assert (run.sources.cache, run.sources.mapped) == (1, 1)
    warnings = _same_but_warnings(run.report, sample_entries[1], (sample_entries[0], job))
    assert any("damaged" in w and "rank-0.json.gz.zds" in w for w in warnings), warnings
    rc, stderr, _ = fz.run_zdiag(["analyze", "-q", str(job)])  # the CLI: no exit 70
    assert fz.verdict(rc, stderr) is None and rc == 0, stderr


def test_a_stored_rank_that_disagrees_with_its_summary_is_damage(
    sample_entries: tuple[Path, Report], tmp_path: Path
) -> None:
    job = tmp_path / "job"
    shutil.copytree(sample_entries[0], job)
    entry = job / "traces" / CACHE_DIR_NAME / "rank-1.json.gz.zds"
    stored = read_stored(entry)
    assert stored is not None
    # the key and fingerprint are rank 1's, the summary claims rank 0: two rank-0s would result
    other = read_stored(job / "traces" / CACHE_DIR_NAME / "rank-0.json.gz.zds")
    assert other is not None
    assert write_stored(entry, msgspec.structs.replace(other, trace=stored.trace))
    run = _analyze([job], write_cache=False)
    assert sorted(r.rank for r in run.report.ranks) == [0, 1]
    assert run.sources.mapped == 1


# --- escape sequences in names never reach the terminal --------------------------------------


@pytest.mark.parametrize("where", ["trace", "stored summary"])
def test_an_escape_sequence_in_a_host_name_is_shown_as_text(
    where: str, sample_entries: tuple[Path, Report], tmp_path: Path
) -> None:
    evil = "evil\x1b]0;pwned\x07\x1b[2J\u202ehost\x9b"
    job = tmp_path / "job"
    if where == "trace":
        builder = TraceBuilder(rank=0, world_size=1)
        builder.step(0, 0.0, 1000)
        builder.kernel("sm90_gemm", 100, 400, launch_at=50)
        job.mkdir()
        path = builder.write(job / "rank-0.json")
        doc = msgspec.json.decode(path.read_bytes())
        doc["host_name"] = evil
        path.write_bytes(msgspec.json.encode(doc))
    else:
        shutil.copytree(sample_entries[0], job)
        _rewrite_summary(
            job / "traces" / CACHE_DIR_NAME / "rank-0.json.gz.zds",
            lambda tree: tree.update(host=evil),
        )
    run = _analyze([job], write_cache=False)
    assert any(r.host == evil for r in run.report.ranks)  # the data keeps the name exactly
    text = render_text(run.report, color=True)
    for raw in ("\x1b]", "\x07", "\x1b[2J", "\u202e", "\x9b"):
        assert raw not in text
    assert "evil\\x1b]0;pwned\\x07\\x1b[2J\\u202ehost\\x9b" in text


# --- an in-job summary is not reused after its trace changed ---------------------------------


def _edit_in_place(path: Path, edit: Callable[[bytearray], None]) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    edit(data)
    with path.open("r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_an_in_job_summary_is_not_reused_after_its_trace_was_edited(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(SAMPLE, run_dir)
    for r in (0, 1):
        trace = run_dir / "traces" / f"rank-{r}.json.gz"
        assert summarize_main([str(trace), str(summary_path_for(trace))]) == 0
    assert _analyze([run_dir], write_cache=False).sources.in_job == 2
    # one byte in the middle of the gzip stream, size and mtime restored: a damaged trace that
    # the summary would have hidden
    trace = run_dir / "traces" / "rank-1.json.gz"
    size = trace.stat().st_size

    def flip(data: bytearray) -> None:
        data[size // 2] ^= 0xFF

    _edit_in_place(trace, flip)
    assert trace.stat().st_size == size
    rc, stderr, _ = fz.run_zdiag(["analyze", "-q", str(run_dir)])
    assert rc == 2 and "rank-1.json.gz" in stderr, stderr


# --- the stamp: an unchanged trace is not hashed again, a changed one always is --------------


def test_a_settled_stamp_skips_the_hash_and_any_change_defeats_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zdiag.analyzers.engine import summary_store

    monkeypatch.setattr(summary_store, "SETTLED_NS", 0)  # as if hashed long after the writes
    job = _job(tmp_path / "job")
    _analyze([job])

    def no_hashing(path: Path) -> summary_store.TraceFingerprint:
        raise AssertionError(f"{path} was hashed although its stamp vouches for it")

    with monkeypatch.context() as m:
        m.setattr(summary_store, "fingerprint", no_hashing)
        assert _analyze([job], write_cache=False).sources.cache == 4
    # an edit in place with the size and mtime restored: the ctime moved, so it is hashed
    trace = job / "rank-1.json"

    def flip(data: bytearray) -> None:
        at = data.index(b"4200") + 3
        data[at] = ord("1")

    _edit_in_place(trace, flip)
    assert _analyze([job], write_cache=False).sources.mapped == 1
    # a copy (another inode, new ctime), same bytes: hashed, and used
    copy = tmp_path / "copy"
    shutil.copytree(job, copy, symlinks=True)
    assert _analyze([copy], write_cache=False).sources.mapped == 1  # rank 1's entry is stale


def test_a_stamp_taken_too_soon_after_a_change_does_not_vouch(tmp_path: Path) -> None:
    from zdiag.analyzers.engine.summary_store import SETTLED_NS, FileStamp

    path = tmp_path / "t"
    path.write_bytes(b"x")
    st = path.stat()
    settled = FileStamp.of(st, st.st_ctime_ns + SETTLED_NS)
    racy = FileStamp.of(st, st.st_ctime_ns + SETTLED_NS - 1)
    assert settled.still(st) and not racy.still(st)


def test_many_values_are_checked_at_once_and_exactly() -> None:
    """The column check: a sum that overflows on finite values is no error (each value is then
    checked), one non-finite value among thousands is, and so is an int beyond 64 bits."""
    from zdiag.analyzers.rank.summary_checks import _check_column

    _check_column([1e308] * 3 + [None], "big")
    with pytest.raises(ValueError, match="not a finite number"):
        _check_column([1.0] * 5000 + [math.nan], "x")
    with pytest.raises(ValueError, match="beyond 64 bits"):
        _check_column([*range(5000), 2**64], "members")
    _check_column(["a", None, True, b"x"], "names")
