"""The map (`analyze_rank`), its summary (`RankSummary`) and the reduce (`reduce_run`).

The reduce must give the same Report from summaries decoded from bytes as from the in-memory
analyses, so summaries computed elsewhere (a training job, a worker) can be cached and merged.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import msgspec
import pytest

from conftest import REPO_ROOT
from support.ledger_traces import BLOCKS, MAIN, fsdp2_cpu_trace, write
from support.stages import analyze_run, load_run
from zdiag.analyzers.engine.pipeline import run_facts
from zdiag.analyzers.engine.reduce import reduce_run
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.rank.rank_analysis import RankContext, analyze_rank
from zdiag.analyzers.rank.summary import (
    SUMMARY_SCHEMA,
    RankSummary,
    decode_summary,
    encode_summary,
    summarize,
)
from zdiag.analyzers.report import encode_report

RUNS = [
    REPO_ROOT / "sample_traces" / "tiny-layer-wrap",
    REPO_ROOT / "sample_traces" / "none",
    REPO_ROOT / "sample_traces" / "activation-oom",
    REPO_ROOT / "tests" / "data" / "deepspeed_zero3",
]


@pytest.mark.parametrize("run_dir", RUNS, ids=[p.name for p in RUNS])
def test_reduce_on_decoded_summaries_equals_the_pipeline(run_dir: Path) -> None:
    if not run_dir.is_dir():
        pytest.skip(f"{run_dir} not present")
    run = load_run([run_dir])
    analysis = analyze_run(run)
    blobs = [encode_summary(s) for s in analysis.summaries]
    decoded = [decode_summary(b) for b in blobs]
    assert decoded == analysis.summaries
    assert all(s.schema == SUMMARY_SCHEMA for s in decoded)
    again = reduce_run(decoded, run_facts(run, decoded)).report
    assert encode_report(again) == encode_report(analysis.report)
    if len(decoded) > 1:
        assert again.stragglers, "a multi-rank run has per-rank straggler stats"


def test_summary_of_an_fsdp_rank_carries_its_ledger_and_collectives(tmp_path: Path) -> None:
    trace = load_rank_trace(write(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=2)))
    analysis = analyze_rank(trace)
    summary = summarize(analysis)
    again = decode_summary(encode_summary(summary))
    assert again.ledger is not None and again.ledger.records == analysis.ledger.records
    rc = again.collective_columns()
    assert [rc.kinds[k] for k in rc.kind] == analysis.collectives.kind
    assert [rc.groups[g] for g in rc.group] == analysis.collectives.process_group
    assert rc.start_us.tolist() == analysis.collectives.start_us.tolist()
    assert rc.end_us.tolist() == analysis.collectives.end_us.tolist()
    assert rc.step.tolist() == analysis.collectives.step.tolist()
    assert again.rank_report().steps == list(analysis.breakdown)


def test_the_map_leaves_the_trace_as_it_was(tmp_path: Path) -> None:
    doc = fsdp2_cpu_trace(BLOCKS, steps=2)
    trace = load_rank_trace(write(tmp_path, doc))
    before = list(trace.warnings)
    analysis = analyze_rank(
        trace, RankContext(collector_errors=("the memory timeline has totals only",))
    )
    assert trace.warnings == before
    assert "zdiag run: the memory timeline has totals only" in analysis.warnings
    with pytest.raises(AttributeError):
        analysis.rank = 3  # type: ignore[misc]


def test_ledger_and_step_table_share_one_definition_of_compute(tmp_path: Path) -> None:
    """Host-only run: the ledger's compute inside its steps is the breakdown's compute. An
    autograd node wrapping the last backward matmul (5 us of its own before it) is not compute
    in either (the ledger used to count the wrapper's whole span)."""
    doc = fsdp2_cpu_trace(BLOCKS, steps=2)
    events = doc["traceEvents"]
    assert isinstance(events, list)
    (mm,) = [e for e in events if e.get("name") == "aten::mm" and e["ts"] == 8405.0]
    wrapper = "autograd::engine::evaluate_function: MmBackward0"
    start, end = 8400.0, mm["ts"] + mm["dur"]
    events.append(
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": wrapper,
            "pid": 1,
            "tid": MAIN,
            "ts": start,
            "dur": end - start,
        }
    )
    trace = load_rank_trace(write(tmp_path, doc))
    analysis = analyze_rank(trace)
    ledger = analysis.ledger
    assert ledger.records and not trace.has_device_events
    table_ms = sum(s.compute_ms for s in analysis.breakdown if s.step in ledger.steps)
    assert table_ms > 0
    assert ledger.compute_us / 1000.0 == pytest.approx(table_ms, rel=1e-6)


def test_unit_bytes_are_filled_once_in_the_map(tmp_path: Path) -> None:
    doc = fsdp2_cpu_trace(BLOCKS, steps=1)
    for ev in doc["traceEvents"]:
        ev.get("args", {}).pop("Input Dims", None)
    trace = load_rank_trace(write(tmp_path, doc))
    sizes = {n: 4 * k for n, k in BLOCKS}
    bare = analyze_rank(trace).ledger
    sized = analyze_rank(trace, RankContext(unit_param_bytes=sizes)).ledger
    assert all(r.bytes <= 0 for r in bare.records)
    assert {r.bytes for r in sized.records if r.unit == "layers.2"} == {sizes["layers.2"]}


def test_decode_rejects_other_data() -> None:
    with pytest.raises(ValueError, match="not a zdiag rank summary"):
        decode_summary(b"\x01\x02garbage")
    with pytest.raises(ValueError, match="not a zdiag rank summary"):
        decode_summary(zlib.compress(msgspec.msgpack.encode({"schema": 3})))
    other = encode_summary(RankSummary(rank=0, schema="zdiag.rank-summary/99"))
    with pytest.raises(ValueError, match="unsupported rank-summary schema"):
        decode_summary(other)
