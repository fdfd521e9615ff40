"""Header integers a damaged trace carries beyond 64 bits (found by the CLI fuzzer, seed 4000:
`baseTimeNanoseconds` of 10**30) are unknown, never a crash when the summary is encoded."""

from __future__ import annotations

import json
from pathlib import Path

import fuzz_inputs as fz
import pytest

from zdiag.analyzers.engine.summary_pipeline import SummaryOptions, analyze_via_summaries


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("baseTimeNanoseconds", 10**30),
        ("deviceProperties", [{"id": 0, "name": "GPU", "totalGlobalMem": 10**30}]),
        ("distributedInfo", {"backend": "gloo", "rank": 0, "world_size": 1e300}),
        ("distributedInfo", {"backend": "gloo", "rank": 0, "world_size": 10**30}),
    ],
)
def test_an_integer_beyond_64_bits_in_the_header_is_unknown(
    tmp_path: Path, field: str, value: object
) -> None:
    doc = fz.base_trace(0)
    doc[field] = value
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps(doc))
    report = analyze_via_summaries([path], SummaryOptions(use_stored=False, write_cache=False))
    assert report.report.ranks and report.report.ranks[0].steps
