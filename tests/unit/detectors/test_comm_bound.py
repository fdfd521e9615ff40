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


def test_on_a_gpu_the_gain_is_the_bf16_replay() -> None:
    (f,) = comm_bound.detect(_ctx(modelled=True))
    assert f.evidence["comm_excess_ms_per_step"] == pytest.approx(0.8)
    method = f.gain_method or ""
    # by hand: four gathers of 0.3 ms, each exposed before its unit's 0.1 ms: 1.6 ms; with
    # half the bytes, 4 x 0.15 + 0.4 = 1.0 ms
    assert method.startswith(
        "replayed: bf16 parameter gathers (zdiag whatif --param-dtype bf16) against the "
        "measured step, 1.6 -> 1.0 ms"
    )
    assert f.expected_gain_ms == pytest.approx(0.6)
    assert "a bigger batch per rank is not replayed" in method
    assert "replayed_beyond_prefetch" not in f.evidence


def test_beside_missing_overlap_the_gain_is_beyond_prefetch() -> None:
    (f,) = comm_bound.detect(_ctx(modelled=True))
    comm_bound.settle(f, {"comm-bound", "missing-overlap"})
    # by hand: prefetch issues each gather as the previous unit's compute starts, on one lane:
    # 0.3 + 3 x 0.3 + 0.1 = 1.3 ms; with half the bytes 0.15 + 3 x 0.15 + 0.1 = 0.7 ms
    assert (f.gain_method or "").startswith(
        "replayed: bf16 parameter gathers (zdiag whatif --prefetch 1 --param-dtype bf16) "
        "against --prefetch 1 alone, 1.3 -> 0.7 ms"
    )
    assert f.expected_gain_ms == pytest.approx(0.6)
    assert f.evidence["replayed_beyond_prefetch"] is True


def test_a_remedy_another_finding_proposes_keeps_its_gain_there() -> None:
    (f,) = comm_bound.detect(_ctx(modelled=True))
    comm_bound.settle(f, {"comm-bound", "fp32-collectives"})
    assert f.expected_gain_ms is None
    assert (f.gain_method or "").startswith(
        "none of its own: `fp32-collectives` gives the replayed gain of bf16 parameter gathers"
    )


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
    (f,) = comm_bound.detect(_ctx(modelled=True, manifest=manifest))
    # the shard group inside a node: half the ranks' bytes, INTRA_NODE_SPEEDUP (2x) faster: the
    # gathers take a quarter of their time, more than bf16's half saves
    assert (f.gain_method or "").startswith("replayed: HSDP (zdiag whatif --mesh-shape 2,2)")
    hsdp = f.expected_gain_ms
    assert hsdp is not None and hsdp > 0.6
    comm_bound.settle(f, {"comm-bound", "flat-sharding-multinode"})
    method = f.gain_method or ""
    assert method.startswith("replayed: bf16 parameter gathers")
    assert "`flat-sharding-multinode` gives the gain of HSDP" in method
    assert f.expected_gain_ms == pytest.approx(0.6)


def _missing_overlap(gain: float) -> Finding:
    return Finding(id="missing-overlap", severity="warning", title="t", expected_gain_ms=gain)


def test_reconcile_takes_nothing_from_a_gain_replayed_beyond_prefetch() -> None:
    (replayed,) = comm_bound.detect(_ctx(modelled=True))
    (bound,) = comm_bound.detect(_ctx(modelled=False))
    for cb, kept in ((replayed, 0.6), (bound, 0.8 - 0.3)):
        out = reconcile([_missing_overlap(0.3), cb])
        (got,) = [f for f in out if f.id == "comm-bound"]
        assert got.expected_gain_ms == pytest.approx(kept)
        assert got.recommendation.startswith("Beyond the 0.30 ms per step that prefetch recovers")
    assert "against --prefetch 1 alone" in replayed.gain_method


def test_on_a_cpu_host_whose_cores_are_full_it_says_the_collectives_wait_for_them() -> None:
    import dataclasses

    from zdiag.analyzers.run.core_use import HostCores

    manifest = Manifest.from_json({"world_size": 1, "ranks": [{"rank": 0, "device": "cpu"}]})
    ctx = _ctx(modelled=True, manifest=manifest)
    (quiet,) = comm_bound.detect(
        dataclasses.replace(ctx, host_cores=(HostCores("vm", (0,), 2, 1.0, 9),))
    )
    assert "cores are full" not in quiet.recommendation
    (full,) = comm_bound.detect(
        dataclasses.replace(ctx, host_cores=(HostCores("vm", (0,), 2, 1.9, 9),))
    )
    assert (
        "On this CPU run the host's cores are full (the 1 rank on vm kept 1.9"
        in full.recommendation
    )
    assert full.evidence["host_cores_busy"] == [1.9, 2]
    (gpu,) = comm_bound.detect(
        dataclasses.replace(_ctx(modelled=True), host_cores=(HostCores("vm", (0,), 2, 1.9, 9),))
    )
    assert "cores are full" not in gpu.recommendation  # on GPUs NCCL's links, not these cores
