"""The rule records: every rule documented, docs/detectors.md and `zdiag explain` written from them,
and every threshold a rule declares reported where the record says (evidence or
Report.thresholds), checked on findings each rule really gives."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import REPO_ROOT
from support.ledger_traces import BLOCKS, LEAVES, fsdp2_cpu_trace, write
from support.trace_contexts import trace_context
from zdiag.analyzers.detectors import BY_ID, RULES, STRAGGLER_RULE
from zdiag.analyzers.detectors.context import DetectorContext, parse_oom_message
from zdiag.analyzers.detectors.docs import rules_markdown
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.inputs.model_facts import ModelFacts
from zdiag.analyzers.rank.declared_groups import ProcessGroupInfo
from zdiag.analyzers.rank.fsdp_ledger import CollectiveRecord, RankLedger
from zdiag.analyzers.rank.host_syncs import HostSyncSites
from zdiag.analyzers.rank.pipeline_times import PipelineStepTimes
from zdiag.analyzers.rank.rank_analysis import RankFacts
from zdiag.analyzers.report import Finding, MemoryBreakdown, StepBreakdown
from zdiag.analyzers.run import crossrank, stragglers
from zdiag.cli import main as zdiag_main
from zdiag.collectors.model_schema import (
    ModelDescription,
    PipelineInfo,
    PipelineScheduleInfo,
    PipelineStageInfo,
)
from zdiag.collectors.run_records import Manifest

REPO = REPO_ROOT
MIB = 1024**2
HARNESS = {"layers": 3, "dim": 64, "vocab": 512, "batch": 8, "seq": 1024, "zero": 3, "ac": "none"}
OOM_TEXT = (
    "Emulated device out of memory on rank 0. Tried to allocate 1.00 MiB. The device budget "
    "(--memory-budget-gb) has a total capacity of 0.03 GiB of which 0.90 MiB is free. In use: "
    "27.14 MiB activations saved for backward, 0.45 MiB unsharded parameters, 2.22 MiB sharded "
    "parameters, gradients and optimizer state."
)

UNREPORTED = {
    "whole-model-wrap": {"BLOCKS_UNSHARDED_AT_PEAK"},
    "tiny-layer-wrap": {
        "MIN_UNITS_PER_BLOCK",
        "FLAT_BANDWIDTH_SHARE",
        "MIN_SPLIT_COLLECTIVE_SHARE",
    },
    "missing-overlap": {
        "MIN_GAIN_SHARE",
        "MIN_GAIN_MS",
        "CRITICAL_SHARE",
        "CRITICAL_GAIN_SHARE",
        "HOST_SYNCS_PER_UNIT",
        "HOST_BOUND_STEP_SHARE",
    },
    "activation-oom": {"MIN_SAVED_TENSORS_PER_BLOCK"},
    "optimizer-state-dominant": {"WARNING_GAIN_SHARE"},
    "host-sync": {"WARNING_GAIN_SHARE", "CRITICAL_GAIN_SHARE"},
    "fp32-collectives": {"FP32_BYTES_SHARE", "EXPOSED_STEP_SHARE"},
    "flat-sharding-multinode": {"INTRA_NODE_SPEEDUP"},
}
"""Thresholds used but reported nowhere today (reporting them would change `--json`): pinned,
so a new threshold has to say where a report shows it or be added here on purpose."""


def test_every_rule_is_documented() -> None:
    assert len(BY_ID) == len(RULES)  # ids are unique
    for r in RULES:
        for field in ("summary", "what", "why", "example", "fix", "gain", "scope"):
            text = getattr(r, field)
            assert text.strip() and text == text.strip(), (r.id, field)
        assert "\n" not in r.summary and len(r.summary) <= 80, r.id
        assert len({t.name for t in r.thresholds}) == len(r.thresholds), r.id
        assert all(t.why.strip() for t in r.thresholds), r.id


def test_docs_detectors_md_is_written_from_the_records() -> None:
    """docs/detectors.md holds today's generated section (`python bench/rules_doc.py`)."""
    doc = (REPO / "docs" / "detectors.md").read_text(encoding="utf-8")
    assert rules_markdown() in doc
    for r in RULES:
        assert f"### `{r.id}`" in doc
        assert all(f"| `{t.name}` |" in doc for t in r.thresholds)


def test_threshold_values_are_the_module_constants() -> None:
    for r in RULES:
        module = sys.modules[r.detect.__module__]
        for t in r.thresholds:
            owners = (crossrank, stragglers) if r is STRAGGLER_RULE else (module,)
            owner = next(m for m in owners if hasattr(m, t.name))
            assert getattr(owner, t.name) == t.value, (r.id, t.name)


def test_unreported_thresholds_are_the_pinned_ones() -> None:
    found = {
        r.id: {t.name for t in r.thresholds if t.evidence is None and t.report is None}
        for r in RULES
    }
    assert {k: v for k, v in found.items() if v} == UNREPORTED


def _trace_ctx(tmp_path: Path, doc: dict[str, Any], **kw: Any) -> DetectorContext:
    return trace_context(write(tmp_path, doc), **kw)


def _step(i: int, verdict: str, idle: float, exposed: float, comm: float = 0.0) -> StepBreakdown:
    return StepBreakdown(
        step=i, duration_ms=100.0, compute_ms=100.0 - idle - exposed, comm_ms=comm or exposed,
        overlapped_ms=0.0, exposed_comm_ms=exposed, idle_ms=idle, verdict=verdict,
    )  # fmt: skip


def _straggler() -> DetectorContext:
    """Two ranks over 3 steps of 100 ms; rank 1 reaches every collective 5 ms late."""
    matched = []
    t = 0.0
    for step in range(3):
        for i in range(4):
            starts = [t, t + 5000.0]
            ends = [t + 6000.0] * 2
            matched.append(
                crossrank.MatchedCollective("pg0", "all_reduce", step, i, [0, 1], starts, ends)
            )
            t += 25_000.0
    steps = [_step(s, "exposed-comm", 0.0, 30.0) for s in range(3)]
    return DetectorContext(
        ledgers={},
        breakdowns={0: steps, 1: steps},
        crossrank=crossrank.CrossRankResult.from_matched([0, 1], matched),
    )


def _pipeline() -> DetectorContext:
    """Stage 0 of 2 on ranks 0 and 1 (GPipe, 4 micro-batches): stage 1 waits 45% of the step."""
    stage = PipelineStageInfo(0, 2, 0, (0, 1), "0")
    desc = ModelDescription(
        pipeline=PipelineInfo(
            stages=(stage,), schedules=(PipelineScheduleInfo("ScheduleGPipe", "", 4, (0,), 2),)
        )
    )
    facts = {
        r: RankFacts(pipeline=[PipelineStepTimes(
            step=k, step_ms=100.0, window_ms=busy + wait, busy_ms=busy, wait_ms=wait, actions=8
        ) for k in range(3)])
        for r, busy, wait in ((0, 60.0, 10.0), (1, 20.0, 45.0))
    }  # fmt: skip
    return DetectorContext(ledgers={}, facts=facts, model=ModelFacts(desc))


def _hsdp() -> DetectorContext:
    """A gloo HSDP rank whose replicate all-reduces (4 ms each, group {0, 2}) are exposed for
    8 ms of a 100 ms step, after 1 ms reduce-scatters (group {0, 1})."""
    recs: list[CollectiveRecord] = []
    members: dict[float, tuple[int, ...]] = {}
    t = 0.0
    for unit in ("layers.0", ""):
        for group, dur in (((0, 1), 1e3), ((0, 2), 4e3)):
            recs.append(
                CollectiveRecord(
                    unit=unit, framework="fsdp2", family="reduce", kind="all_reduce", phase="",
                    step=1, issued_us=t, issue_end_us=t, start_us=t, end_us=t + dur, bytes=-1,
                    dtype="", exposed_us=dur,
                )
            )  # fmt: skip
            members[round(t, 3)] = group
            t += dur
    groups = [
        ProcessGroupInfo(name="1", description="mesh_replicate", size=2, ranks=[0, 2]),
        ProcessGroupInfo(name="3", description="mesh_shard", size=2, ranks=[0, 1]),
    ]
    ledger = RankLedger(
        rank=0, framework="fsdp2", device="cpu", records=recs, steps=[1], window_us=100e3
    )
    return DetectorContext(
        ledgers={0: ledger},
        facts={0: RankFacts(process_groups=groups)},
        record_members={0: members},
    )


def _contexts(tmp_path: Path) -> dict[str, DetectorContext]:
    """A context on which each rule with an evidence-reported threshold fires."""
    (tmp_path / "wrap").mkdir(parents=True)
    (tmp_path / "overlap").mkdir()
    (tmp_path / "tiny").mkdir()
    wrap = _trace_ctx(
        tmp_path / "wrap",
        fsdp2_cpu_trace([("", 20000)], steps=2),
        manifest=Manifest.from_json(
            {"harness": HARNESS, "fsdp_units": [{"name": "", "param_bytes": 80000}]}
        ),
    )
    breakdown = MemoryBreakdown(
        rank=0, source="snapshot", reserved_bytes=4096 * MIB, fragmented_bytes=1800 * MIB,
        blocks_with_stacks=1, peak_bytes=1000 * MIB,
        peak_category_bytes={"OPTIMIZER_STATE": 600 * MIB, "UNKNOWN": 400 * MIB},
    )  # fmt: skip
    light = MemoryBreakdown(rank=1, source="snapshot", peak_bytes=500 * MIB)
    sites = HostSyncSites(total=6, units={"layers.0": 3, "layers.1": 3}, model_blocked_ms=1.0)
    comm_ledger = SimpleNamespace(
        rank=0, framework="fsdp2", records=[object()], gathers=[], unit_order=[]
    )
    return {
        "whole-model-wrap": wrap,
        "missing-overlap": _trace_ctx(tmp_path / "overlap", fsdp2_cpu_trace(BLOCKS, steps=2)),
        "tiny-layer-wrap": _trace_ctx(
            tmp_path / "tiny", fsdp2_cpu_trace(LEAVES, steps=2, gather_us=200, bytes_per_us=1000)
        ),
        "activation-oom": DetectorContext(
            ledgers={},
            memory=[parse_oom_message(0, OOM_TEXT)],
            manifest=Manifest.from_json({"harness": HARNESS}),
        ),
        "fragmentation": DetectorContext(ledgers={}, memory_breakdowns=[breakdown]),
        "optimizer-state-dominant": DetectorContext(ledgers={}, memory_breakdowns=[breakdown]),
        "memory-imbalance": DetectorContext(ledgers={}, memory_breakdowns=[breakdown, light]),
        "host-sync": DetectorContext(
            ledgers={},
            facts={0: RankFacts(host_sync_sites=sites)},
            breakdowns={0: [_step(1, "compute-bound", 0.0, 0.0)]},
        ),
        "host-bound": DetectorContext(
            ledgers={}, breakdowns={0: [_step(i, "host-bound", 60.0, 0.0) for i in range(3)]}
        ),
        "exposed-comm": DetectorContext(
            ledgers={}, breakdowns={0: [_step(i, "exposed-comm", 0.0, 30.0) for i in range(3)]}
        ),
        "straggler": _straggler(),
        "pipeline-bubble": _pipeline(),
        "exposed-replicate-allreduce": _hsdp(),
        "comm-bound": DetectorContext(
            ledgers={0: comm_ledger},  # type: ignore[dict-item]
            breakdowns={0: [_step(i, "comm-bound", 0.0, 40.0, comm=80.0) for i in range(3)]},
        ),
    }


def test_every_reported_threshold_is_in_the_findings_and_the_report(tmp_path: Path) -> None:
    fired: dict[str, Finding] = {}
    for rule_id, ctx in _contexts(tmp_path / "ctx").items():
        (fired[rule_id],) = BY_ID[rule_id].detect(ctx)
    report = analyze_paths([REPO / "sample_traces" / "none"])  # two ranks
    for r in RULES:
        for t in r.thresholds:
            if t.evidence is not None:
                assert fired[r.id].evidence[t.evidence] == t.value, (r.id, t.name)
            if t.report is not None:
                assert report.thresholds[t.report] == t.value, (r.id, t.name)
    # the straggler thresholds close Report.thresholds, in the rule's order
    keys = list(report.thresholds)
    assert keys[-len(STRAGGLER_RULE.thresholds) :] == list(STRAGGLER_RULE.report_thresholds())


def test_explain_lists_every_rule_and_prints_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert zdiag_main(["explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [r.id for r in RULES]
    assert zdiag_main(["explain", "fragmentation"]) == 0
    out = capsys.readouterr().out
    assert "Why it matters:" in out and "FRAGMENTATION_SHARE = 0.3" in out
    assert "evidence `threshold_share`" in out


def test_explain_an_unknown_id_is_one_sentence_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert zdiag_main(["explain", "slow-gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'slow-gpu'" in err
    assert all(r.id in err for r in RULES)
