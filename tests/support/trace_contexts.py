"""A DetectorContext of one synthetic trace: its ledger, facts and step models, as the engine
builds them (the step models are what the findings' replayed gains re-time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.rank.fsdp_ledger import build_rank_ledger
from zdiag.analyzers.rank.rank_analysis import analyze_rank, rank_facts


def trace_context(path: Path, **kw: Any) -> DetectorContext:
    """The context of the trace at `path` (`kw`: more DetectorContext fields)."""
    trace = load_rank_trace(path)
    models = list(analyze_rank(trace).step_models)
    trace = load_rank_trace(path)  # the map may have filled the trace's tables: start afresh
    return DetectorContext(
        ledgers={0: build_rank_ledger(trace)},
        facts={0: rank_facts(trace)},
        step_models={0: models},
        device=trace.device,
        **kw,
    )
