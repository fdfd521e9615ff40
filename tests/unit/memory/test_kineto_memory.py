"""Memory by category from Kineto `[memory]` events, for traces without a snapshot.

Anchors: the allocator's own `Total Allocated` on every event (the replayed `Bytes` must
agree), torch's memory profiler on the same CPU harness run (sample_traces/activation-oom holds
both the trace and `export_memory_timeline`'s output), and HTA's memory analysis on the memory
profiler's raw export (the category model the Kineto categories follow).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.inputs.memory_timeline import CATEGORIES, load_memory_timeline
from zdiag.analyzers.memory.kineto_memory import kineto_memory
from zdiag.analyzers.rank.rank_analysis import analyze_rank
from zdiag.analyzers.rank.summary import decode_summary, encode_summary, summarize

SAMPLE = REPO_ROOT / "sample_traces" / "activation-oom"


def test_v100_ddp_trace_gets_a_memory_timeline(real_traces: Path) -> None:
    path = real_traces / "hta" / "v100_ddp_rank1_of_2.json.gz"
    trace = load_rank_trace(path)
    mem = trace.memory_events
    assert mem is not None and len(mem) == 28010
    b, tl, warnings = kineto_memory(trace, 34089730048)
    assert warnings == []  # the replayed Bytes agree with Total Allocated on every event
    assert b is not None and tl is not None
    cuda = (mem.device_type == 1) & (mem.device_id == 1)
    assert b.device == 1 and b.history_events == int(cuda.sum())
    assert b.peak_bytes == int(mem.total_allocated[cuda].max())
    assert b.peak_reserved_bytes == int(mem.total_reserved[cuda].max())
    assert sum(b.peak_category_bytes.values()) == b.peak_bytes
    assert b.peak_category_bytes["AUTOGRAD_DETAIL"] > 0 and b.peak_category_bytes["ACTIVATION"] > 0
    report = analyze_paths([path])
    assert report.memory and report.memory[0].source == "kineto memory events"
    assert report.memory[0].peak_bytes == b.peak_bytes
    assert report.memory_breakdowns[0].peak_bytes == b.peak_bytes


def test_activations_match_torchs_memory_profiler_on_the_same_run() -> None:
    for rank in (0, 1):
        trace = load_rank_trace(SAMPLE / "traces" / f"rank-{rank}.json.gz")
        b, _, _ = kineto_memory(trace)
        profiler = load_memory_timeline(SAMPLE / "memory" / f"rank-{rank}.timeline.json.gz", rank)
        assert b is not None and b.source == "kineto memory events"
        # The memory profiler also counts tensors made before the window (parameters, inputs):
        # the activations, made inside it, agree to the byte.
        assert b.peak_category_bytes["ACTIVATION"] == profiler.peak_category_bytes["ACTIVATION"]


def test_the_summary_carries_the_kineto_memory_to_the_reduce() -> None:
    trace = load_rank_trace(SAMPLE / "traces" / "rank-0.json.gz")
    summary = decode_summary(encode_summary(summarize(analyze_rank(trace))))
    assert summary.memory_breakdown is not None and summary.memory_timeline is not None
    assert summary.memory_breakdown.peak_category_bytes["ACTIVATION"] > 0


def test_hta_memory_analysis_agrees_with_zdiag_on_the_raw_export(real_traces: Path) -> None:
    hta_memory = pytest.importorskip("hta.memory_analysis")
    path = real_traces / "hta" / "memory_timeline.raw.gz"
    _times, sizes = hta_memory.MemoryAnalysis(str(path))._process_raw_events()
    by_cat = np.asarray(sizes)
    at = int(np.argmax(by_cat.sum(axis=1)))
    ours = load_memory_timeline(path, 0)
    assert ours.peak_bytes == int(by_cat[at].sum())
    # HTA's order: Parameter, Optimizer state, Input, Temporary, Activation, Gradient,
    # Autograd, Unknown: torch's, which zdiag's CATEGORIES follow.
    theirs = {c: int(v) for c, v in zip(CATEGORIES, by_cat[at], strict=True) if v}
    assert ours.peak_category_bytes == theirs
