"""The run directories recorded on a lent H100 (sample_traces/gpu/, by `bench/gpu_checks.py` on
2026-11-27, torch 2.11.0+cu130, NCCL 2.28.9): what only a GPU run shows, analyzed here without one.

- `healthy-nccl`: the harness on one GPU over NCCL (FSDP2 on one rank issues no collective).
- `whole-model-wrap-gloo`: 2 ranks sharing the one GPU over gloo; gloo moves CUDA tensors through
  host memory, so its collectives launch no kernel and exist only as host `gloo:*` ops.
- `activation-oom`: a real CUDA out-of-memory error, the allocator capped at 3.45 GiB
  (`--memory-budget-gb`) between the measured peaks with and without checkpointing.
- `stacks-all.snapshot.pickle`: a user's own snapshot of an MLP's AdamW step recorded with C++
  frames (`_record_memory_history(stacks="all")`, from `python -c`): torch 2.11 keeps the
  stacks only in the history's entries, and the backward's allocations (the autograd engine's
  thread) have no Python frame at all.
"""

from __future__ import annotations

import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.misconfigs import MISCONFIGS

GPU = REPO_ROOT / "sample_traces" / "gpu"
# the same GPU run measured the peak with `--ac block` (steps/rank-0.jsonl of its peak-ac run):
# the activation-checkpointing what-if is checked against it
MEASURED_AC_PEAK_BYTES = 1_570_881_024


def test_nccl_run_has_kernels_and_no_misconfiguration() -> None:
    report = analyze_paths([GPU / "healthy-nccl"])
    (rank,) = report.ranks
    assert rank.device == "cuda"
    assert rank.steps and all(s.kernel_count > 0 for s in rank.steps)
    assert all(s.compute_ms > 0 for s in rank.steps)
    assert not {f.id for f in report.findings} & set(MISCONFIGS)


def test_gloo_collectives_on_a_gpu_run_are_communication() -> None:
    report = analyze_paths([GPU / "whole-model-wrap-gloo"])
    assert len(report.ranks) == 2
    for rank in report.ranks:
        # gloo blocks the host for the gathers: most of each step is communication
        assert all(s.comm_ms > 0.5 * s.duration_ms for s in rank.steps)
        assert all(s.kernel_count > 0 for s in rank.steps)
    kinds = {c.kind for c in report.collectives}
    assert {"all_gather", "all_reduce"} <= kinds
    assert "whole-model-wrap" in {f.id for f in report.findings}


def test_real_cuda_oom_against_the_capped_allocator() -> None:
    report = analyze_paths([GPU / "activation-oom"])
    finding = next(f for f in report.findings if f.id == "activation-oom")
    assert finding.expected_gain_bytes and finding.expected_gain_bytes > 0
    (breakdown,) = report.memory_breakdowns
    assert breakdown.oom
    # the capacity is the budget the allocator was capped at, not the H100's 79 GiB
    assert breakdown.capacity_bytes == pytest.approx(3.45 * 2**30, rel=0.01)
    changes = {w.change: w for w in breakdown.what_if}
    # the captured model reshards every block after forward already: not proposed again
    assert "reshard_after_forward=True" not in changes
    ac = changes["activation checkpointing per block"]
    assert ac.predicted_peak_bytes is not None and ac.fits
    assert 0.5 < ac.predicted_peak_bytes / MEASURED_AC_PEAK_BYTES < 2.0
    # the blocks from before the recording are the parameters (1 rank: 102 MiB), inferred
    assert breakdown.preexisting_inferred.startswith("most likely the parameters (1.02 x")
    # allocation sites are the user's Python lines (the harness's model), not CPython's C files
    assert breakdown.top_sites
    assert all(site.site.split(":")[0].endswith(".py") for site in breakdown.top_sites)


def test_a_snapshot_with_cpp_frames_names_python_lines_and_autograd_nodes() -> None:
    report = analyze_paths([GPU / "stacks-all.snapshot.pickle"])
    (breakdown,) = report.memory_breakdowns
    sites = {s.site: s for s in breakdown.top_sites}
    assert "<string>:9 in step" in sites  # the optimizer step's line in the `python -c` script
    assert sites["<string>:9 in step"].category == "OPTIMIZER_STATE"
    assert "AddmmBackward0 (autograd, no Python frame)" in sites
    assert not [s for s in sites if s.startswith("??") or ".cpp:" in s]
    # the stacks are in the history: no "no allocation stacks" warning
    assert not [w for w in report.warnings if "no allocation stacks" in w]
