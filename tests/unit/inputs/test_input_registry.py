"""The input registry: one Reader per format, each recognizing its own inputs by `sniff`."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import pytest

from zdiag.analyzers.inputs import (
    cuda_snapshot,
    flight_dumps,
    loader,
    memory_timeline,
    model_facts,
    remote_traces,
)
from zdiag.analyzers.inputs.registry import READERS, reader_for


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_each_format_is_recognized_by_its_own_reader(tmp_path: Path) -> None:
    trace = _write(tmp_path / "rank-0.json", b'{"traceEvents": []}')
    snapshot = _write(
        tmp_path / "dump.bin", pickle.dumps({"segments": [], "device_traces": []}, protocol=4)
    )
    timeline = _write(tmp_path / "rank-0.timeline.json.gz", gzip.compress(b"[[], []]"))
    model = _write(
        tmp_path / "model" / "rank-0.json", json.dumps({"schema": "zdiag.model/1"}).encode()
    )
    assert reader_for(trace) is loader.READER
    assert reader_for(snapshot) is cuda_snapshot.READER
    assert reader_for(timeline) is memory_timeline.READER
    assert reader_for(model) is model_facts.READER
    assert reader_for("s3://bucket/job/rank-0.json") is remote_traces.READER
    dump = _write(tmp_path / "_dump_0", pickle.dumps({"version": "2.3", "entries": []}))
    assert reader_for(dump) is flight_dumps.READER


def test_a_trace_is_recognized_by_content_whatever_its_name(tmp_path: Path) -> None:
    gz = _write(tmp_path / "worker7.bin", gzip.compress(b'{"traceEvents": []}'))
    plain = _write(tmp_path / "worker7.out", b'  {"traceEvents": []}')
    assert reader_for(gz) is loader.READER and reader_for(plain) is loader.READER


def test_what_no_reader_knows_is_none(tmp_path: Path) -> None:
    assert reader_for(_write(tmp_path / "notes.txt", b"hello")) is None
    assert reader_for(_write(tmp_path / "empty.bin", b"")) is None
    assert reader_for(tmp_path) is None  # a folder is never opened
    # a plain pickle that is no snapshot, and a JSON file in model/ without the schema
    assert reader_for(_write(tmp_path / "other.pkl", pickle.dumps({"a": 1}, protocol=4))) is None
    assert reader_for(_write(tmp_path / "model" / "rank-1.json", b'{"a": 1}')) is loader.READER


def test_every_reader_is_named_once_and_reads() -> None:
    names = [r.name for r in READERS]
    assert len(set(names)) == len(names)
    assert all(r.what and callable(r.sniff) and callable(r.read) for r in READERS)
    assert READERS[-1] is loader.READER  # the catch-all for JSON comes last


def test_a_new_trace_format_is_one_reader_in_the_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registered "trace" reader is what the map decodes its files with (here: a made-up
    format whose file holds the path of a Kineto trace)."""
    from support.ledger_traces import BLOCKS, fsdp2_cpu_trace, write
    from zdiag.analyzers.engine.summary_pipeline import analyze_paths
    from zdiag.analyzers.inputs import registry
    from zdiag.analyzers.inputs.reader import Reader

    kineto = write(tmp_path, fsdp2_cpu_trace(BLOCKS))
    pointer = _write(tmp_path / "run.ptr", str(kineto).encode())
    seen: list[Path] = []

    def read(path: Path, **kwargs: object) -> object:
        seen.append(Path(path))
        trace = loader.load_rank_trace(Path(Path(path).read_text()), **kwargs)  # type: ignore[arg-type]
        trace.source = Path(path)  # a reader names the file it read
        return trace

    pointer_format = Reader(
        name="pointer",
        kind="trace",
        what="a file naming a Kineto trace",
        sniff=lambda path, head: str(path).endswith(".ptr"),
        read=read,
    )
    assert registry.trace_reader_for(pointer) is loader.READER  # not registered yet
    monkeypatch.setattr(registry, "READERS", (pointer_format, *registry.READERS))
    assert registry.trace_reader_for(pointer) is pointer_format
    assert registry.trace_reader_for(kineto) is loader.READER
    report = analyze_paths([pointer])
    assert seen == [pointer] and len(report.ranks) == 1 and report.ranks[0].steps
