"""The built-in FSDP2 harness: options, model, FSDP units, emulated OOM, and real 2-rank gloo runs.

The 2-rank tests start `torchrun --standalone --nproc-per-node 2 -m zdiag.harness` as a user would.
The overlap test runs the healthy default and `--prefetch off` under plain torch.profiler and
checks with interval math that gloo's all-gathers overlap main-thread compute only when healthy.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import REPO_ROOT
from zdiag.errors import ConfigError
from zdiag.harness.config import HarnessConfig, parse_config
from zdiag.harness.memory_budget import GIB, MemoryBudget
from zdiag.harness.model import ModelArgs, Transformer, synthetic_batch
from zdiag.harness.sharding import apply_fsdp, describe_units

TINY = ["--layers", "2", "--dim", "32", "--heads", "4", "--seq", "16", "--batch", "2"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _torchrun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        [*cmd, *args],
        cwd=REPO_ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--layers", "0"], "--layers"),
        (["--dim", "250"], "--dim"),
        (["--heads", "-1"], "--heads"),
        (["--steps", "0"], "--steps"),
        (["--vocab", "1"], "--vocab"),
        (["--memory-budget-gb", "0"], "--memory-budget-gb"),
        (["--memory-budget-gb", "-2"], "--memory-budget-gb"),
        (["--lr", "0"], "--lr"),
    ],
)
def test_bad_values_raise_config_error_naming_the_option(argv: list[str], option: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(argv)
    assert option in info.value.message


def test_dataclass_validates_choices_too() -> None:
    with pytest.raises(ConfigError, match="--wrap"):
        HarnessConfig(wrap="everything")
    with pytest.raises(ConfigError, match="--zero"):
        HarnessConfig(zero=1)


@pytest.mark.slow  # starts a program
def test_bad_option_is_one_line_exit_2_without_traceback() -> None:
    for argv in (["--dim", "250"], ["--wrap", "nope"], ["--steps", "x"]):
        proc = subprocess.run(
            [sys.executable, "-m", "zdiag.harness", *argv],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "error" in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr


def test_misconfig_presets_set_knobs_and_explicit_options_win() -> None:
    assert parse_config([]).wrap == "block"
    assert parse_config([]).prefetch == "explicit"
    assert parse_config(["--misconfig", "whole-model-wrap"]).wrap == "whole"
    assert parse_config(["--misconfig", "tiny-layer-wrap"]).wrap == "leaf"
    assert parse_config(["--misconfig", "missing-overlap"]).prefetch == "off"
    oom = parse_config(["--misconfig", "activation-oom"])
    assert oom.ac == "none" and oom.memory_budget_gb is not None
    assert oom.seq * oom.batch > HarnessConfig().seq * HarnessConfig().batch
    explicit = parse_config(["--misconfig", "activation-oom", "--seq", "64"])
    assert explicit.seq == 64 and explicit.misconfig == "activation-oom"


# ---- model --------------------------------------------------------------------------------------
def test_model_shapes_and_torchtitan_names() -> None:
    args = ModelArgs(layers=2, dim=32, heads=4, vocab=50, seq=16)
    model = Transformer(args)
    inputs, labels = synthetic_batch(
        3, 16, 50, torch.Generator().manual_seed(0), torch.device("cpu")
    )
    assert inputs.shape == labels.shape == (3, 16)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert model(inputs).shape == (3, 16, 50)
    names = {name for name, _ in model.named_modules()}
    for expected in (
        "tok_embeddings",
        "layers.0",
        "layers.1.attention.wq",
        "layers.1.feed_forward.w2",
        "layers.0.attention_norm",
        "layers.0.ffn_norm",
        "norm",
        "output",
    ):
        assert expected in names


# ---- FSDP units (a 1-rank gloo group in this process) ---------------------------------------------
@pytest.fixture
def one_rank_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded(argv: list[str]) -> tuple[Transformer, HarnessConfig, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh

    cfg = parse_config([*TINY, *argv])
    args = ModelArgs(layers=cfg.layers, dim=cfg.dim, heads=cfg.heads, vocab=cfg.vocab, seq=cfg.seq)
    model = Transformer(args)
    units = apply_fsdp(model, cfg, init_device_mesh("cpu", (1,)))
    assert units == describe_units(model)
    total = sum(p.numel() for p in model.parameters())
    assert sum(u.param_count for u in units) == total
    assert sum(u.param_bytes for u in units) == total * 4
    return model, cfg, [u.name for u in units]


@pytest.mark.usefixtures("one_rank_group")
def test_wrap_modes_produce_expected_fsdp_units() -> None:
    _, _, block = _sharded(["--wrap", "block"])
    assert block == ["", "layers.0", "layers.1"]
    _, _, whole = _sharded(["--wrap", "whole"])
    assert whole == [""]
    _, _, leaf = _sharded(["--wrap", "leaf"])
    per_block = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"]
    per_block += ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    per_block += ["attention_norm", "ffn_norm"]
    assert len(leaf) == 1 + 2 * 9 + 3
    assert set(leaf) == {"", "tok_embeddings", "norm", "output"} | {
        f"layers.{i}.{n}" for i in range(2) for n in per_block
    }


@pytest.mark.usefixtures("one_rank_group")
def test_one_rank_training_step_runs_for_every_mode() -> None:
    for argv in (
        ["--prefetch", "implicit", "--zero", "2"],
        ["--prefetch", "off", "--wrap", "leaf"],
        ["--ac", "block", "--precision", "bf16"],
    ):
        model, cfg, _ = _sharded(argv)
        inputs, labels = synthetic_batch(2, 16, cfg.vocab, torch.Generator(), torch.device("cpu"))
        loss = torch.nn.functional.cross_entropy(
            model(inputs).flatten(0, 1).float(), labels.flatten()
        )
        loss.backward()
        assert torch.isfinite(loss)
        assert all(p.grad is not None for p in model.parameters())


@pytest.mark.usefixtures("one_rank_group")
def test_memory_budget_raises_real_oom_and_checkpointing_lowers_the_peak() -> None:
    def peak(ac: str, budget_gb: float) -> int:
        model, cfg, _ = _sharded(["--ac", ac, "--seq", "128", "--batch", "8"])
        budget = MemoryBudget(int(budget_gb * GIB), model)
        budget.install_checkpoint_accounting(model.layers)
        inputs, labels = synthetic_batch(8, 128, cfg.vocab, torch.Generator(), torch.device("cpu"))
        with budget.track():
            loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        del loss
        assert budget.activation_bytes == 0  # everything saved was released by backward
        return budget.peak_bytes

    no_ac, with_ac = peak("none", 1.0), peak("block", 1.0)
    assert with_ac < no_ac
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        peak("none", (no_ac + with_ac) / 2 / GIB)


# ---- real 2-rank gloo runs -----------------------------------------------------------------------
@pytest.mark.dist
def test_two_rank_healthy_run_exits_zero_with_one_line_per_step() -> None:
    proc = _torchrun(
        "-m",
        "zdiag.harness",
        "--steps",
        "3",
        "--wrap",
        "leaf",
        "--zero",
        "2",
        "--seq",
        "64",
        "--layers",
        "2",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["0", "1", "2"]  # rank 0 only, 0-based
    assert "2 rank(s) on cpu" in proc.stdout and "22 FSDP units" in proc.stdout


@pytest.mark.dist
def test_two_rank_activation_oom_exits_nonzero_with_out_of_memory_error() -> None:
    proc = _torchrun("-m", "zdiag.harness", "--misconfig", "activation-oom", "--steps", "2")
    assert proc.returncode != 0
    assert "torch.OutOfMemoryError: Emulated device out of memory" in proc.stderr
    assert "step 0 " not in proc.stdout  # out of memory during the first forward


PROFILE_SCRIPT = """
import os, sys
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule
from zdiag.harness.config import parse_config
from zdiag.harness.train import train

out = sys.argv[1]
prof = profile(
    activities=[ProfilerActivity.CPU],
    schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
    on_trace_ready=lambda p: p.export_chrome_trace(f"{out}/rank{os.environ['RANK']}.json.gz"),
)
register_optimizer_step_post_hook(lambda *a: prof.step())
prof.start()
train(parse_config(sys.argv[2:]))
prof.stop()
"""

COMPUTE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product", "aten::mul")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_fraction(trace: Path, comm_prefix: str) -> float:
    """Share of gloo collective time (worker threads) during main-thread compute ops."""
    with gzip.open(trace, "rt") as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    main_tid = next(e["pid"] for e in events if isinstance(e.get("pid"), int))
    gathers = _union(
        [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith(comm_prefix)]
    )
    compute = _union(
        [
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if e.get("tid") == main_tid and e["name"].startswith(COMPUTE_OPS)
        ]
    )
    gather_us = sum(end - start for start, end in gathers)
    assert gather_us > 0, f"no {comm_prefix} in {trace}"
    assert any(e["name"].startswith("FSDP::all_gather (layers.0)") for e in events)
    return _intersection(gathers, compute) / gather_us


@pytest.mark.dist
@pytest.mark.slow
def test_healthy_default_overlaps_gathers_with_compute_and_prefetch_off_does_not(
    tmp_path: Path,
) -> None:
    script = tmp_path / "profile_harness.py"
    script.write_text(PROFILE_SCRIPT)
    fractions: dict[str, list[float]] = {}
    comm_fractions: dict[str, list[float]] = {}
    for name, extra in (("healthy", []), ("off", ["--prefetch", "off"])):
        out = tmp_path / name
        out.mkdir()
        proc = _torchrun(str(script), str(out), "--steps", "3", *extra)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        traces = [out / f"rank{r}.json.gz" for r in (0, 1)]
        fractions[name] = [overlap_fraction(t, "gloo:all_gather") for t in traces]
        comm_fractions[name] = [overlap_fraction(t, "gloo:") for t in traces]
    # gathers: prefetched on gloo's thread while the main thread computes
    assert min(fractions["healthy"]) > 0.15, fractions
    assert max(fractions["off"]) < 0.05, fractions
    # all communication (gathers and the reduce-scatters, which gloo runs as all_reduce)
    assert min(comm_fractions["healthy"]) > 0.1, comm_fractions
    assert max(comm_fractions["off"]) < 0.05, comm_fractions
