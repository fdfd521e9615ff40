"""CUDA memory snapshots: categories from allocation stacks, and activation-oom from a real CUDA OOM.

The snapshots are made by `tests/cpu_snapshot.py` from a real FSDP2 harness run on CPU (no GPU
here): real Python stacks in the layout `torch.cuda.memory._snapshot()` documents.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO_ROOT
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.inputs.cuda_snapshot import read_snapshot
from zdiag.analyzers.memory import categories
from zdiag.analyzers.memory.memory_snapshot import categorize, summarize_snapshot
from zdiag.analyzers.memory.stack_categorizer import Categorizer
from zdiag.errors import InputError
from zdiag.harness.model import ModelArgs, Transformer

MIB = 1024**2
# The capture's harness shape (tests/cpu_snapshot.py), stopped in the forward of block 3.
SHAPE = ModelArgs(layers=4, dim=64, heads=4, vocab=512, seq=128)
STOP_LAYER = 3
# torch's CUDA out-of-memory wording (c10/cuda/CUDACachingAllocator.cpp), with a fraction cap.
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 768.00 KiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 78.80 GiB is free. Including non-PyTorch memory, this process has 390.00 MiB "
    "memory in use. 20.00 MiB allowed; Of the allocated memory 20.48 MiB is allocated by "
    "PyTorch, and 1.52 MiB is reserved by PyTorch but unallocated."
)


def _capture(tmp_path: Path, name: str, *args: str) -> Path:
    out = tmp_path / f"{name}.pickle"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "cpu_snapshot.py"), str(out), *args],
        check=True,
        capture_output=True,
        timeout=120,
        env=env,
    )
    return out


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("snapshots")
    return {
        "none": _capture(tmp, "none", "--stop-layer", str(STOP_LAYER)),
        "block": _capture(tmp, "block", "--stop-layer", str(STOP_LAYER), "--ac", "block"),
        "no-frames": _capture(tmp, "no-frames", "--no-frames"),
    }


def _param_bytes(module: torch.nn.Module, recurse: bool = True) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=recurse))


@pytest.mark.slow
def test_categories_match_the_model_state_of_the_real_run(snapshots: dict[str, Path]) -> None:
    mem = summarize_snapshot(read_snapshot(snapshots["none"]))
    cats = mem.category_bytes
    with torch.device("meta"):
        model = Transformer(SHAPE)
    total = _param_bytes(model)
    root = total - sum(_param_bytes(layer) for layer in model.layers)
    # World size 1: the sharded parameters are the whole model. Built before the allocator
    # history starts (the first forward), they have no stack: UNKNOWN, with the token batches.
    # A batch is one int64 (batch, seq + 1) tensor, sliced into inputs and labels; two are alive
    # (the first, made before the history, and the second step's).
    batch_bytes = 8 * (SHAPE.seq + 1) * 8
    assert cats["UNKNOWN"] == total + 2 * batch_bytes
    assert "MODEL_STATE" not in cats
    # AdamW keeps two moments of each parameter (plus one 4-byte step counter per parameter).
    n_params = len(list(model.parameters()))
    assert cats["OPTIMIZER_STATE"] == 2 * total + 4 * n_params
    # Stopped in block 3's forward: the root unit and block 3 are gathered, the rest resharded.
    assert cats["PARAMETER_UNSHARDED"] == root + _param_bytes(model.layers[STOP_LAYER])
    # Blocks 0-2 saved their activations for backward: the largest category.
    assert cats["ACTIVATION"] > 0.5 * mem.in_use_bytes
    assert mem.oom_request_bytes and mem.has_stacks


@pytest.mark.slow
def test_checkpointing_keeps_only_block_inputs(snapshots: dict[str, Path]) -> None:
    full = summarize_snapshot(read_snapshot(snapshots["none"])).category_bytes["ACTIVATION"]
    ac = summarize_snapshot(read_snapshot(snapshots["block"])).category_bytes["ACTIVATION"]
    block_input = 8 * SHAPE.seq * SHAPE.dim * 4  # batch x seq x dim fp32
    assert ac < full / 4
    assert ac >= STOP_LAYER * block_input


def test_categorize_rules() -> None:
    def f(filename: str, name: str) -> dict[str, Any]:
        return {"filename": filename, "line": 1, "name": name}

    module_call = f("/x/torch/nn/modules/module.py", "_call_impl")
    assert categorize([]) == "UNKNOWN"
    assert categorize([f("/x/torch/optim/adamw.py", "_init_group"), module_call]) == (
        "OPTIMIZER_STATE"
    )
    gather = f("/x/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_all_gather")
    assert categorize([gather, module_call]) == "PARAMETER_UNSHARDED"
    assert categorize([f("/x/torch/utils/checkpoint.py", "recompute_fn"), module_call]) == (
        "ACTIVATION"
    )
    assert categorize([f("", "torch::autograd::Engine::thread_main()")]) == "AUTOGRAD_DETAIL"
    assert categorize([module_call]) == "ACTIVATION"
    # C++ frames of a forward op (recorded with stacks="all") do not make it backward.
    forward_cpp = f("", "torch::autograd::VariableType::(anonymous namespace)::mm(...)")
    assert categorize([forward_cpp, module_call]) == "ACTIVATION"
    assert categorize([f("/home/me/train.py", "main")]) == "UNKNOWN"


def test_every_stack_categorizer_reads_the_one_rule_table() -> None:
    """The OOM summary (`categorize`) and the breakdown (`Categorizer`) give a stack the same
    category, communication buffers included; the Kineto categorizer's rules come from the same
    table, in the same precedence."""
    cases = [
        [{"filename": "/x/torch/distributed/distributed_c10d.py", "name": "all_gather"}],
        [
            {"filename": "/x/torch/distributed/fsdp/_fsdp_collectives.py", "name": "unshard"},
            {"filename": "/x/torch/distributed/distributed_c10d.py", "name": "all_gather"},
        ],
        [{"filename": "/x/torch/nn/modules/module.py", "name": "_call_impl"}],
        [{"filename": "/home/me/train.py", "name": "main"}],
    ]
    got = [categorize(frames) for frames in cases]
    assert got == [Categorizer().category(frames) for frames in cases]
    assert got == ["COMM_BUFFER", "PARAMETER_UNSHARDED", "ACTIVATION", "UNKNOWN"]
    # each source's display order is its rules' order in the table (reports list categories so)
    assert categories.STACK_CATEGORIES == (
        *("OPTIMIZER_STATE", "PARAMETER_UNSHARDED", "GRADIENT", "COMM_BUFFER", "ACTIVATION"),
        *("AUTOGRAD_DETAIL", "MODEL_STATE", "UNKNOWN", "PREEXISTING"),
    )
    assert categories.RANGE_CATEGORIES == (
        *("OPTIMIZER_STATE", "PARAMETER_UNSHARDED", "GRADIENT", "COMM_BUFFER"),
        *("AUTOGRAD_DETAIL", "ACTIVATION", "UNKNOWN", "PREEXISTING"),
    )


def _cuda_oom_run(tmp_path: Path, snapshot: Path | None) -> Path:
    """The recorded CPU activation-oom run, its OOM records reworded as a CUDA OOM (which names
    no categories) and its memory timelines removed: only the snapshot can tell what filled it."""
    run = tmp_path / "cuda-oom"
    shutil.copytree(REPO_ROOT / "sample_traces" / "activation-oom", run)
    manifest = json.loads((run / "manifest.json").read_text())
    for entry in manifest["ranks"]:
        rank = entry["rank"]
        timeline = entry.pop("memory_timeline", None)
        if timeline:
            (run / timeline).unlink()
        entry["memory_timeline"] = None
        entry["error"] = f"OutOfMemoryError: {CUDA_OOM}"
        record_path = run / entry["oom_record"]
        record = json.loads(record_path.read_text())
        record.update(error=CUDA_OOM, memory_budget_bytes=None, memory_timeline=None)
        if snapshot is not None:
            rel = f"memory/rank-{rank}.snapshot.pickle"
            shutil.copy(snapshot, run / rel)
            entry["memory_snapshot"] = record["memory_snapshot"] = rel
        record_path.write_text(json.dumps(record))
    (run / "manifest.json").write_text(json.dumps(manifest))
    for trace in (run / "traces").glob("*.json.gz"):  # nor its Kineto memory events
        doc = json.loads(gzip.decompress(trace.read_bytes()))
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("name") != "[memory]"]
        trace.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return run


@pytest.mark.slow
def test_a_cuda_oom_is_diagnosed_from_its_snapshot(
    tmp_path: Path, snapshots: dict[str, Path]
) -> None:
    report = analyze_paths([_cuda_oom_run(tmp_path, snapshots["none"])])
    finding = next(f for f in report.findings if f.id == "activation-oom")
    assert finding.evidence["source"] == "oom record + snapshot"
    assert finding.evidence["capacity_bytes"] == 20 * MIB  # the "allowed" cap, not the GPU
    assert finding.evidence["activation_share"] > 0.5
    assert finding.expected_gain_bytes and finding.expected_gain_bytes > 0


@pytest.mark.slow
def test_a_checkpointed_run_is_not_blamed_on_activations(
    tmp_path: Path, snapshots: dict[str, Path]
) -> None:
    report = analyze_paths([_cuda_oom_run(tmp_path, snapshots["block"])])
    assert "activation-oom" not in {f.id for f in report.findings}
    # ... because the snapshot was read and its activations are small, not because it was not.
    assert not [w for w in report.warnings if "snapshot" in w]


@pytest.mark.slow
def test_the_snapshot_is_read_on_the_device_the_rank_trained_on(
    tmp_path: Path, snapshots: dict[str, Path]
) -> None:
    """A stray context on cuda:0 (more memory in use than nothing) must not be read for a rank
    that trained on cuda:1."""
    data = read_snapshot(snapshots["none"])
    real = data["segments"][0]
    stray_block = {"size": 4 * real["total_size"], "state": "active_allocated", "frames": []}
    stray = dict(real, device=0, blocks=[stray_block])
    data["segments"] = [stray, dict(real, device=1)]
    data["device_traces"] = [[], data["device_traces"][0]]
    two = tmp_path / "two-devices.pickle"
    two.write_bytes(pickle.dumps(data))
    run = _cuda_oom_run(tmp_path, two)
    manifest = json.loads((run / "manifest.json").read_text())
    for entry in manifest["ranks"]:
        entry["device"] = "cuda:1"
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert "activation-oom" in {f.id for f in analyze_paths([run]).findings}
    for entry in manifest["ranks"]:
        entry["device"] = None  # unknown: the busiest device (the stray one) is read
    (run / "manifest.json").write_text(json.dumps(manifest))
    report = analyze_paths([run])
    assert "activation-oom" not in {f.id for f in report.findings}
    assert any("no allocation stacks" in w for w in report.warnings)


@pytest.mark.slow
def test_a_snapshot_without_stacks_says_what_to_do(
    tmp_path: Path, snapshots: dict[str, Path]
) -> None:
    report = analyze_paths([_cuda_oom_run(tmp_path, snapshots["no-frames"])])
    assert "activation-oom" not in {f.id for f in report.findings}
    assert any("--profile-memory" in w and "no allocation stacks" in w for w in report.warnings)


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/zdiag-snapshot-pwned",))


def test_a_pickle_naming_a_function_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = Path("/tmp/zdiag-snapshot-pwned")
    marker.unlink(missing_ok=True)
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "x": _Evil()}))
    with pytest.raises(InputError, match="not a readable CUDA memory snapshot"):
        read_snapshot(path)
    assert not marker.exists()


@pytest.mark.slow
def test_a_truncated_snapshot_is_a_warning_in_the_analysis(
    tmp_path: Path, snapshots: dict[str, Path]
) -> None:
    run = _cuda_oom_run(tmp_path, snapshots["none"])
    snap = run / "memory" / "rank-0.snapshot.pickle"
    snap.write_bytes(snap.read_bytes()[:1000])
    report = analyze_paths([run])
    assert any(
        "memory snapshot skipped" in w and "rank-0.snapshot.pickle" in w for w in report.warnings
    )
