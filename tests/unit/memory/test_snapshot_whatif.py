"""The checkpointing what-if checked against a real harness run with `--ac block`.

Both snapshots come from tests/cpu_snapshot.py --history: the FSDP2 harness (4 blocks, dim 64,
seq 128, batch 8, AdamW) on CPU, every storage an op creates recorded with its Python stack and
freed when it dies, as the CUDA allocator's history records them. The prediction is made from
the run without checkpointing; the measurement is the peak replayed from the run with
`--ac block`, in the same accounting.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT
from zdiag.analyzers.inputs.cuda_snapshot import load_snapshot_data
from zdiag.analyzers.memory.snapshot_breakdown import analyze_snapshot
from zdiag.harness.model import ModelArgs, Transformer

UPPER_BOUND_FACTOR = 1.5
"""The prediction keeps the unchanged peak's backward temporaries, so it may overestimate; it
must never underestimate, and stay within this factor of the measured peak."""


def _history(tmp: Path, name: str, *args: str) -> Path:
    out = tmp / f"{name}.pickle"
    subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "tests" / "cpu_snapshot.py"),
            str(out),
            "--history",
            *args,
        ],
        check=True,
        capture_output=True,
        timeout=180,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("history")
    return {"none": _history(tmp, "none"), "block": _history(tmp, "block", "--ac", "block")}


@pytest.mark.slow
def test_checkpointing_prediction_bounds_the_measured_peak(runs: dict[str, Path]) -> None:
    before, _ = analyze_snapshot(load_snapshot_data(runs["none"]), rank=0)
    after, _ = analyze_snapshot(load_snapshot_data(runs["block"]), rank=0)
    ac = next(w for w in before.what_if if w.change == "activation checkpointing per block")
    assert ac.predicted_peak_bytes is not None and before.peak_bytes and after.peak_bytes
    assert "of 4 blocks" in ac.arithmetic  # the harness has 4 blocks: counted from the stacks
    measured = after.peak_bytes
    assert measured < before.peak_bytes  # checkpointing lowers the real peak
    assert measured <= ac.predicted_peak_bytes <= UPPER_BOUND_FACTOR * measured
    # with checkpointing already on, the prediction does not promise a further saving
    again = next(w for w in after.what_if if w.change == "activation checkpointing per block")
    assert again.saved_bytes == 0


@pytest.mark.slow
def test_harness_history_categories_match_the_model(runs: dict[str, Path]) -> None:
    b, timeline = analyze_snapshot(load_snapshot_data(runs["none"]), rank=0)
    with torch.device("meta"):
        model = Transformer(ModelArgs(layers=4, dim=64, heads=4, vocab=512, seq=128))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # AdamW: two fp32 moments per parameter, plus one step counter per parameter tensor
    moments = 2 * param_bytes
    opt = b.category_bytes["OPTIMIZER_STATE"]
    assert moments <= opt <= moments + 8 * len(list(model.parameters())) * 64
    # the sharded parameters (world size 1: the whole model) were made before the history
    assert b.category_bytes["PREEXISTING"] >= param_bytes
    # the peak is in the step, not at the end, and it is mostly activations
    assert b.peak_at == "replayed" and (b.peak_bytes or 0) > (b.allocated_bytes or 0)
    assert b.peak_category_bytes["ACTIVATION"] > 0.5 * (b.peak_bytes or 0)
    assert timeline is not None and timeline.peak_bytes == b.peak_bytes
