"""`comm-bound`'s expected gain: the replay of the remedies it names where the run allows them
(bf16 gathers off CPU, HSDP on several nodes), on top of `missing-overlap`'s prefetch; the upper
bound elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zdiag.analyzers.detectors import comm_bound
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.detectors.reconcile import reconcile
from zdiag.analyzers.rank.step_model import ModelOp, StepModel
from zdiag.analyzers.report import Finding, StepBreakdown
from zdiag.collectors.run_records import Manifest

UNITS = 4
COMPUTE_US = 100.0  # per unit
GATHER_US = 300.0  # per unit, issued where it is needed (no prefetch)


def _gather(k: int) -> ModelOp:
    pos = k * COMPUTE_US
    return ModelOp(
        kind="all_gather", lane="0|all_gather", issue_pos_us=pos, after=-1, delay_us=0.0,
        dur_us=GATHER_US, wait_pos_us=pos, waited_us=GATHER_US, bytes=4 << 20,
        unit=f"layers.{k}", family="all_gather", phase="forward", needed_pos_us=pos,
    )  # fmt: skip


def _step(n: int) -> StepModel:
    total = UNITS * (COMPUTE_US + GATHER_US)
    return StepModel(
        step=n, start_us=10_000.0 * n, duration_us=total, work_us=UNITS * COMPUTE_US,
        ops=[_gather(k) for k in range(UNITS)],
    )  # fmt: skip


def _ctx(*, modelled: bool, manifest: Manifest | None = None) -> DetectorContext:
    """Every step comm-bound: four fp32 gathers of 0.3 ms, each exposed before its unit's
    0.1 ms of compute, on a GPU (kernels counted)."""
    steps = [
        StepBreakdown(step=n, duration_ms=1.6, compute_ms=0.4, comm_ms=1.2, overlapped_ms=0.0,
                      exposed_comm_ms=1.2, idle_ms=0.0, verdict="comm-bound", kernel_count=8)
        for n in (1, 2)
    ]  # fmt: skip
    gather = SimpleNamespace(dtype="float")
    ledger = SimpleNamespace(
        rank=0, framework="fsdp2", records=[gather], gathers=[gather], unit_order=[], steps=[1, 2]
    )
    ranks = manifest.ranks if manifest is not None else [SimpleNamespace(rank=0)]
    return DetectorContext(
        ledgers={0: ledger}, breakdowns={e.rank: steps for e in ranks}, manifest=manifest,
        step_models={e.rank: [_step(1), _step(2)] for e in ranks} if modelled else {},
        device="cuda",
    )  # type: ignore[dict-item]  # fmt: skip


def test_on_a_gpu_the_gain_is_the_bf16_replay_beyond_prefetch() -> None:
    (f,) = comm_bound.detect(_ctx(modelled=True))
    assert f.evidence["comm_excess_ms_per_step"] == pytest.approx(0.8)
    assert f.evidence["replayed_beyond_prefetch"] is True
    method = f.gain_method or ""
    assert method.startswith("replayed: bf16 parameter gathers (zdiag whatif --prefetch 1 ")
    assert "--param-dtype bf16" in method and "against --prefetch 1 alone" in method
    # by hand: prefetch issues each gather as the previous unit's compute starts, on one lane:
    # 0.3 + 3 x 0.3 + 0.1 = 1.3 ms; with half the bytes 0.15 + 3 x 0.15 + 0.1 = 0.7 ms
    assert "1.3 -> 0.7 ms" in method
    assert f.expected_gain_ms == pytest.approx(0.6)
    assert "a bigger batch per rank is not replayed" in method


def test_without_modelled_steps_the_gain_stays_the_upper_bound() -> None:
    (f,) = comm_bound.detect(_ctx(modelled=False))
    assert f.expected_gain_ms == pytest.approx(0.8)
    assert (f.gain_method or "").startswith("upper bound")
    assert "replayed_beyond_prefetch" not in f.evidence


def test_on_a_cpu_only_run_bf16_is_not_replayed() -> None:
    manifest = Manifest.from_json({"world_size": 1, "ranks": [{"rank": 0, "device": "cpu"}]})
    (f,) = comm_bound.detect(_ctx(modelled=True, manifest=manifest))
    assert (f.gain_method or "").startswith("upper bound")


def test_on_two_nodes_hsdp_is_replayed_too() -> None:
    ranks = [
        {"rank": r, "node_rank": r // 2, "host": f"h{r // 2}", "device": "cuda"} for r in range(4)
    ]
    manifest = Manifest.from_json({"world_size": 4, "nnodes": 2, "ranks": ranks})
    ctx = _ctx(modelled=True, manifest=manifest)
    best = comm_bound.replayed_gain(ctx, bf16=False)  # HSDP alone
    assert best is not None and best[1].startswith("replayed: HSDP (zdiag whatif ")
    assert "--mesh-shape 2,2" in best[1]
    # the shard group inside a node: half the ranks, and bytes INTRA_NODE_SPEEDUP (2x) faster
    assert best[0] > comm_bound.replayed_gain(_ctx(modelled=True), bf16=True)[0]  # type: ignore[index]


def _finding(fid: str, gain: float, **evidence: object) -> Finding:
    return Finding(
        id=fid, severity="warning", title=fid, ranks=[0], steps=[1], evidence=dict(evidence),
        recommendation=comm_bound.NO_OVERLAP_FIX + " What would: x.", expected_gain_ms=gain,
        gain_method="m",
    )  # fmt: skip


def test_reconcile_keeps_a_gain_replayed_beyond_prefetch() -> None:
    replayed = _finding("comm-bound", 5.0, replayed_beyond_prefetch=True)
    bound = _finding("comm-bound", 5.0)
    for cb, kept in ((replayed, 5.0), (bound, 2.0)):
        out = reconcile([_finding("missing-overlap", 3.0), cb])
        (got,) = [f for f in out if f.id == "comm-bound"]
        assert got.expected_gain_ms == pytest.approx(kept)
        assert got.recommendation.startswith("Beyond the 3.00 ms per step that prefetch recovers")
