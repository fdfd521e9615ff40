"""The detectors on the committed sample run directories (sample_traces/<scenario>/, recorded by
the harness under `zdiag run`): each misconfiguration is found under its id and no other of the
four; the healthy run raises none of them. Fast: no training, only analysis."""

from __future__ import annotations

import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.misconfigs import MISCONFIGS, SCENARIOS

SAMPLES = REPO_ROOT / "sample_traces"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_sample_run_dir(scenario: str) -> None:
    run_dir = SAMPLES / scenario
    if not (run_dir / "manifest.json").is_file():
        pytest.skip(f"{run_dir} not recorded (make sample-traces)")
    report = analyze_paths([run_dir])
    found = {f.id: f for f in report.findings if f.id in MISCONFIGS}
    assert not [w for w in report.warnings if w.startswith("detector ")]
    if scenario == "none":
        assert not found, {k: f.title for k, f in found.items()}
        return
    assert set(found) == {scenario}, [f"{f.id}: {f.title}" for f in report.findings]
    finding = found[scenario]
    assert finding.severity in ("warning", "critical")
    assert finding.code
    assert finding.gain_method
    assert finding.expected_gain_ms is not None or finding.expected_gain_bytes is not None


def test_sample_units_match_the_manifest() -> None:
    run_dir = SAMPLES / "none"
    if not (run_dir / "manifest.json").is_file():
        pytest.skip(f"{run_dir} not recorded (make sample-traces)")
    import json

    manifest = json.loads((run_dir / "manifest.json").read_text())
    expected = {u["name"] for u in manifest["fsdp_units"]}
    report = analyze_paths([run_dir])
    for rank in {u.rank for u in report.fsdp_units}:
        assert {u.name for u in report.fsdp_units if u.rank == rank} == expected
