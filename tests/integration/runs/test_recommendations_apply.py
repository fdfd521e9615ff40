"""Every recommendation's code runs on the model it came from (issue 12, part 2).

`tests/support/apply_recommendations.py` (a child process: world size 1, gloo, CPU) builds each
user-zoo model class and the harness's Transformer, wraps it the misconfigured way, describes it
as `zdiag run` does, asks the framework remedies for their code from those facts and executes it
on a fresh model, then runs one forward and backward. One recorded zoo run (`zdiag run`, default
options) checks the same end to end: the finding's code from the report executes on the model.
The facts tests below need no process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.detectors.facts import (
    model_block_set,
    model_blocks_are_units,
    model_settings,
)
from zdiag.analyzers.frameworks import fsdp1, fsdp2
from zdiag.analyzers.inputs.model_facts import ModelFacts
from zdiag.collectors.model_schema import (
    Fsdp1Instance,
    Fsdp2Unit,
    ModelDescription,
    RepeatedSet,
)

CHILD = REPO_ROOT / "tests" / "support" / "apply_recommendations.py"
ZOO = REPO_ROOT / "examples" / "user_zoo"
# blocks per model in the child's small configurations: units after a block wrap = blocks + root
BLOCKS = {"tabular": 3, "trunk": 3, "convnet": 3, "seq2seq": 4, "moe": 2, "recsys": 2, "harness": 3}
# what the wrap code must name: the user's own container paths and classes
NAMES = {
    "tabular": ("model.encoder.stages", "ResidualMLP"),
    "trunk": ("model.trunk.cells", "GatedCell"),
    "convnet": ("model.backbone.stages", "ConvUnit"),
    "seq2seq": ("model.encoder.towers", "EncoderTower, DecoderTower"),  # in definition order
    "moe": ("model.body.mixers", "MoEMixer"),
    "recsys": ("model.interaction.towers", "CrossUnit"),
    "harness": ("model.layers", "TransformerBlock"),
}


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")


def _child(*args: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, str(CHILD), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.dist
def test_every_remedy_runs_on_the_model_it_names() -> None:
    rows = _child()
    failed = [
        (r["model"], r["framework"], r["remedy"], r.get("error")) for r in rows if "error" in r
    ]
    assert failed == []
    seen = {(r["model"], r["framework"], r["remedy"]) for r in rows}
    for model in BLOCKS:
        for framework in ("fsdp2", "fsdp1"):
            for remedy in ("wrap_blocks", "overlap", "bf16_comm", "checkpoint_blocks"):
                assert (model, framework, remedy) in seen
        assert (model, "ddp", "overlap") in seen
    # the root's link alone, to the first block by its path: on the models whose blocks sit in
    # a container
    assert sum(1 for s in seen if s[2] == "root_prefetch") >= 3
    for r in rows:
        assert r["params_with_grad"] > 0  # backward reached the parameters
        if r["framework"] == "ddp":
            continue
        # every block became its own unit, plus the root
        assert r["units"] == BLOCKS[r["model"]] + 1, r
        container, classes = NAMES[r["model"]]
        if r["remedy"] == "wrap_blocks":
            code = r["code"]
            assert (container in code) if r["framework"] == "fsdp2" else (classes in code), code
            assert "Linear" not in code and "Conv2d" not in code  # never a leaf layer


@pytest.mark.dist
def test_a_recorded_zoo_run_s_wrap_finding_runs_on_its_model(tmp_path: Path) -> None:
    """tabular_fsdp1 with every Linear wrapped, under `zdiag run` with default options: the
    report's tiny-layer-wrap names ResidualMLP in FSDP1's API, and that code runs on the model."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "zdiag", "run", "--nproc-per-node", "2", "--out", str(run)]
    cmd += [str(ZOO / "tabular_fsdp1.py"), "--wrap-policy", "linear", "--steps", "5"]
    cmd += ["--depth", "3", "--width", "128", "--hidden", "512"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env(), check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "zdiag", "analyze", str(run), "--json", "-o", str(report)],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["run"]["model_facts"]["source"] == "captured from the model"
    found = {f["id"]: f for f in data["findings"]}
    assert "whole-model-wrap" not in found
    tiny = found.get("tiny-layer-wrap")
    assert tiny is not None, [f["id"] for f in data["findings"]]
    assert "ModuleWrapPolicy({ResidualMLP})" in tiny["code"]
    assert tiny["evidence"]["facts"] == "model description"
    code = tmp_path / "code.py"
    code.write_text(tiny["code"])
    rows = _child("--code", str(code), "tabular", "fsdp1")
    assert len(rows) == 1 and "error" not in rows[0], rows
    assert rows[0]["units"] == BLOCKS["tabular"] + 1


# ---- facts from a description (no process) ----------------------------------------------------
def _rep(path: str, cls: str, count: int, each: int, module: str = "mymodels") -> RepeatedSet:
    return RepeatedSet(
        path=path,
        child_class=cls,
        child_module=module,
        count=count,
        child_names=tuple(str(i) for i in range(count)),
        child_modules=4,
        bytes_per_child_min=each,
        bytes_per_child_max=each,
        total_bytes=count * each,
    )


def _seq2seq(**kw: Any) -> ModelDescription:
    return ModelDescription(
        framework=kw.pop("framework", "fsdp2"),
        param_bytes=1000,
        repeated=(
            _rep("encoder.towers", "EncoderTower", 2, 200),
            _rep("decoder.towers", "DecoderTower", 2, 240),
            _rep("decoder.towers.0.experts", "Expert", 2, 30),
            _rep("decoder.towers.1.experts", "Expert", 2, 30),
        ),
        **kw,
    )


def test_the_wrap_set_takes_every_block_class_at_the_chosen_granularity() -> None:
    blocks = model_block_set(ModelFacts(_seq2seq()))
    assert blocks is not None
    assert set(blocks.containers) == {"encoder.towers", "decoder.towers"}  # experts lie inside
    assert set(blocks.classes) == {"EncoderTower", "DecoderTower"}
    assert blocks.python in (
        "[*model.decoder.towers, *model.encoder.towers]",
        "[*model.encoder.towers, *model.decoder.towers]",
    )
    assert set(blocks.imports) == {
        "from mymodels import EncoderTower",
        "from mymodels import DecoderTower",
    }
    assert blocks.count == 4 and blocks.source == "model description"


def test_blocks_that_already_are_units_get_no_wrap_remedy() -> None:
    units = tuple(
        Fsdp2Unit(path=p, cls="", unsharded_bytes=200)
        for p in (
            "",
            "encoder.towers.0",
            "encoder.towers.1",
            "decoder.towers.0",
            "decoder.towers.1",
        )
    )
    facts = ModelFacts(_seq2seq(fsdp2_units=units))
    blocks = model_block_set(facts)
    assert blocks is not None and model_blocks_are_units(facts, blocks) is True
    ctx = DetectorContext(ledgers={}, model=facts)
    assert fsdp2.wrap_blocks(ctx.sheet.run_facts(fsdp2.FRAMEWORK)) is None
    only_root = ModelFacts(_seq2seq(fsdp2_units=units[:1]))
    assert model_blocks_are_units(only_root, blocks) is False


def test_settings_the_run_has_are_not_proposed() -> None:
    # FSDP2: a prefetch list naming only the unit itself prefetches nothing (not "set")
    units = (
        Fsdp2Unit(path="", cls="M"),
        Fsdp2Unit(path="a.0", cls="B", forward_prefetch=("a.0",), backward_prefetch=("a.1",)),
        Fsdp2Unit(path="a.1", cls="B", forward_prefetch=("a.1",), backward_prefetch=("a.0",)),
    )
    got = model_settings(ModelFacts(ModelDescription(framework="fsdp2", fsdp2_units=units)))
    assert got["forward_prefetch"] is False and got["backward_prefetch"] is True
    # a chain: the last block has nothing to prefetch forward, the first nothing backward
    chain = (
        Fsdp2Unit(path="", cls="M", unshard_async_op=True, forward_prefetch=()),
        Fsdp2Unit(path="a.0", cls="B", forward_prefetch=("a.1",), backward_prefetch=()),
        Fsdp2Unit(path="a.1", cls="B", forward_prefetch=("a.2",), backward_prefetch=("a.0",)),
        Fsdp2Unit(path="a.2", cls="B", forward_prefetch=(), backward_prefetch=("a.1",)),
    )
    got = model_settings(ModelFacts(ModelDescription(framework="fsdp2", fsdp2_units=chain)))
    assert got["forward_prefetch"] is True and got["backward_prefetch"] is True
    assert got["unshard_async_op"] is True
    # ... but its root prefetches nothing: the first block's gather is issued when needed
    assert got["root_forward_prefetch"] is False
    rooted = (replace(chain[0], forward_prefetch=("a.0",)), *chain[1:])
    got = model_settings(ModelFacts(ModelDescription(framework="fsdp2", fsdp2_units=rooted)))
    assert got["root_forward_prefetch"] is True
    # FSDP1: every instance sets all three prefetch settings: no overlap remedy
    inst = Fsdp1Instance(
        path="", cls="M", forward_prefetch=True, backward_prefetch="BACKWARD_PRE",
        limit_all_gathers=True,
    )  # fmt: skip
    facts = ModelFacts(_seq2seq(framework="fsdp1", fsdp1=(inst,)))
    ctx = DetectorContext(ledgers={}, model=facts)
    assert fsdp1.overlap(ctx.sheet.run_facts(fsdp1.FRAMEWORK)) is None
    half = Fsdp1Instance(path="", cls="M", forward_prefetch=False, backward_prefetch=None)
    facts = ModelFacts(_seq2seq(framework="fsdp1", fsdp1=(half,)))
    remedy = fsdp1.overlap(
        DetectorContext(ledgers={}, model=facts).sheet.run_facts(fsdp1.FRAMEWORK)
    )
    assert remedy is not None and remedy.code is not None
    assert "forward_prefetch=True" in remedy.code and "BACKWARD_PRE" in remedy.code
    assert "ModuleWrapPolicy({DecoderTower, EncoderTower})" in remedy.code


def test_fsdp1_trace_units_map_to_instances_in_pre_order() -> None:
    instances = (
        Fsdp1Instance(path="", cls="M", flat_param_bytes=10),
        Fsdp1Instance(path="a.0", cls="L", flat_param_bytes=0),  # nothing to gather: no unit
        Fsdp1Instance(path="a.0.up", cls="L", flat_param_bytes=300),
        Fsdp1Instance(path="a.0.down", cls="L", flat_param_bytes=200),
    )
    facts = ModelFacts(ModelDescription(framework="fsdp1", fsdp1=instances))
    assert facts.trace_unit_paths() == {
        "fsdp1-unit-0": "",
        "fsdp1-unit-1": "a.0.up",
        "fsdp1-unit-2": "a.0.down",
    }
    assert facts.trace_unit_bytes() == {
        "fsdp1-unit-0": 10,
        "fsdp1-unit-1": 300,
        "fsdp1-unit-2": 200,
    }
    unknown = ModelFacts(
        ModelDescription(framework="fsdp2", fsdp2_units=(Fsdp2Unit(path="", cls="M"),))
    )
    assert unknown.trace_unit_bytes() == {}  # unknown stays unknown, never 0


def test_a_damaged_description_is_a_warning_and_the_analysis_infers(tmp_path: Path) -> None:
    from zdiag.analyzers.engine.pipeline import load_model_facts

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "rank-0.json").write_text('{"schema": "zdiag.model/9"}')
    facts, warnings = load_model_facts(tmp_path)
    assert facts is None
    assert len(warnings) == 1 and "model description skipped" in warnings[0]
    assert load_model_facts(None) == (None, [])
