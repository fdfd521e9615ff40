"""The model description (issue 12 part 1): captured from the live model at the first forward by
`zdiag run` and `zdiag.profile`, read back by analyzers/inputs/model_facts.py without torch.

Real processes: FSDP2, FSDP1 and DDP on 2 gloo ranks, one plain process, `zdiag.profile` in a
custom loop and a planted failure, all on a user-style model whose repeated blocks live at
`encoder.stages` (tests/data/model_description/train_model.py). DeepSpeed is not installed: its
part is checked on a fake engine that has DeepSpeed's documented accessors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conftest import REPO_ROOT
from zdiag.analyzers.inputs.model_facts import (
    MIN_BLOCK_SHARE,
    ModelFacts,
    facts_from_run_dir,
    inferred_facts,
    python_path,
    rank_blocks,
)
from zdiag.collectors.framework_settings import describe_optimizer
from zdiag.collectors.model_capture import describe_model
from zdiag.collectors.model_schema import (
    MAX_MODULES,
    MODEL_SCHEMA,
    ModelDescription,
    RepeatedSet,
)
from zdiag.errors import InputError

pytestmark = pytest.mark.slow  # real processes or engines: seconds per test (make integration)

SCRIPT = REPO_ROOT / "tests" / "data" / "model_description" / "train_model.py"
TIMEOUT_S = 240


def run_script(tmp_path: Path, mode: str, *, nproc: int = 1) -> tuple[Path, dict[str, Any]]:
    """`zdiag run [--nproc-per-node N] train_model.py MODE`; returns the run dir and the facts the
    script computed from its own model."""
    run_dir, facts = tmp_path / "run", tmp_path / "facts.json"
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    cmd = [sys.executable, "-m", "zdiag", "run", "--out", str(run_dir), "--no-profile", *launch]
    cmd += [str(SCRIPT), mode, str(facts)]
    if mode == "profile":  # zdiag.profile in a custom loop, without zdiag run
        cmd = [sys.executable, str(SCRIPT), mode, str(facts), str(run_dir)]
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, json.loads(facts.read_text())


def check_user_model(run_dir: Path, expected: dict[str, Any], framework: str) -> ModelDescription:
    """What every mode must get right: framework, bytes, the repeated blocks, the optimizer."""
    facts = facts_from_run_dir(run_dir)
    assert facts is not None and not facts.inferred
    desc = facts.description
    assert desc.framework == framework
    assert desc.param_bytes == expected["param_bytes"]
    assert desc.model_class == "TabularResNet"
    stages = next(r for r in desc.repeated if r.path == "encoder.stages")
    assert (stages.child_class, stages.count) == ("ResidualMLP", expected["stages"])
    assert stages.bytes_per_child_max == expected["block_bytes"]
    best = facts.best_block()
    assert best is not None and best.child_class == "ResidualMLP"
    assert best.containers == ("encoder.stages",)
    assert facts.optimizer_classes == ("AdamW",)
    assert expected["forward_pre_hooks_left"] == 0  # removed after the first iteration
    # paths are the user's: no wrapper attribute names
    assert all(
        "_fsdp_wrapped_module" not in m.path and "module." not in m.path for m in desc.modules
    )
    return desc


# ------------------------------------------------------------------------- real processes
def test_single_process_without_distributed(tmp_path: Path) -> None:
    run_dir, expected = run_script(tmp_path, "none")
    desc = check_user_model(run_dir, expected, "none")
    assert desc.fsdp2_units == () and desc.fsdp1 == () and desc.ddp is None
    assert (run_dir / "model" / "rank-0.json").is_file()
    assert not list((run_dir / "model").glob(".*"))  # no temporary file left behind


def test_profile_api_in_a_custom_loop(tmp_path: Path) -> None:
    run_dir, expected = run_script(tmp_path, "profile")
    check_user_model(run_dir, expected, "none")  # AdamW seen although steps are marked by hand


def test_a_failing_description_never_reaches_training(tmp_path: Path) -> None:
    run_dir, _ = run_script(tmp_path, "broken")
    assert not (run_dir / "model" / "rank-0.json").exists()
    part = json.loads((run_dir / "manifest.d" / "rank-0.json").read_text())
    assert part["exit_code"] == 0 and part["steps"] == 3
    assert any("model description failed" in e for e in part["collector_errors"])


@pytest.mark.dist
def test_fsdp2_units_settings_and_prefetch(tmp_path: Path) -> None:
    run_dir, expected = run_script(tmp_path, "fsdp2", nproc=2)
    desc = check_user_model(run_dir, expected, "fsdp2")
    units = {u.path: u for u in desc.fsdp2_units}
    assert set(units) == {""} | {f"encoder.stages.{i}" for i in range(6)}
    block = units["encoder.stages.0"]
    assert block.cls == "ResidualMLP"
    assert block.unsharded_bytes == expected["block_bytes"]
    assert block.sharded_bytes == expected["block_bytes"] // 2  # 2 ranks, even split here
    assert block.reshard_after_forward is False and block.reshard_after_forward_auto is False
    assert units[""].reshard_after_forward is False  # root with the default: off at lazy init
    assert units[""].reshard_after_forward_auto is True
    assert block.forward_prefetch == ("encoder.stages.1", "encoder.stages.2")
    assert units["encoder.stages.3"].backward_prefetch == ("encoder.stages.2",)
    assert units["encoder.stages.1"].forward_prefetch == ()
    assert block.mixed_precision is not None
    assert block.mixed_precision.reduce_dtype == "float32"
    assert block.mixed_precision.param_dtype is None
    assert block.mesh_shape == (2,) and not block.hsdp
    assert block.missing == ()
    assert sum(u.unsharded_bytes or 0 for u in units.values()) == expected["param_bytes"]
    # every rank wrote its own description
    assert (run_dir / "model" / "rank-1.json").is_file()


@pytest.mark.dist
def test_fsdp1_instances_seen_through_the_wrappers(tmp_path: Path) -> None:
    run_dir, expected = run_script(tmp_path, "fsdp1", nproc=2)
    desc = check_user_model(run_dir, expected, "fsdp1")
    inst = {i.path: i for i in desc.fsdp1}
    assert set(inst) == {""} | {f"encoder.stages.{i}" for i in range(6)}
    block = inst["encoder.stages.0"]
    assert block.cls == "ResidualMLP" and not block.root and inst[""].root
    assert block.flat_param_bytes == expected["block_bytes"]
    assert block.sharded_bytes == expected["block_bytes"] // 2
    assert block.sharding_strategy == "FULL_SHARD"
    assert block.backward_prefetch == "BACKWARD_PRE"
    assert block.forward_prefetch is True and block.limit_all_gathers is False
    assert block.mixed_precision is None
    assert desc.wrappers == ("FullyShardedDataParallel",)


@pytest.mark.dist
def test_ddp_settings(tmp_path: Path) -> None:
    run_dir, expected = run_script(tmp_path, "ddp", nproc=2)
    desc = check_user_model(run_dir, expected, "ddp")
    assert desc.ddp is not None
    assert desc.ddp.bucket_cap_bytes == 1024 * 1024
    assert desc.ddp.gradient_as_bucket_view is True
    assert desc.ddp.find_unused_parameters is False
    assert desc.ddp.static_graph is False
    assert desc.ddp.comm_hook == "allreduce_hook"
    assert desc.wrappers == ("DistributedDataParallel",)


# ------------------------------------------------------------------------- in-process pieces
class FakeZeroOptimizer:
    """Stands in for DeepSpeed's ZeRO optimizer wrapper (not a torch Optimizer)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.param_groups = [{"params": params}]


class DeepSpeedEngine(nn.Module):
    """A fake engine with DeepSpeed's documented accessors (DeepSpeed is not installed here)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.optimizer = FakeZeroOptimizer(list(module.parameters()))

    def zero_optimization_stage(self) -> int:
        return 3

    def zero_reduce_bucket_size(self) -> int:
        return 500_000_000

    def zero_allgather_bucket_size(self) -> int:
        return 200_000_000

    def zero_prefetch_bucket_size(self) -> int:
        return 50_000_000

    def zero_param_persistence_threshold(self) -> int:
        return 100_000

    def zero_overlap_comm(self) -> bool:
        return True

    def bfloat16_enabled(self) -> bool:
        return True

    def fp16_enabled(self) -> bool:
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)  # type: ignore[no-any-return]


class Cell(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)  # type: ignore[no-any-return]


class Trunk(nn.Module):
    def __init__(self, dim: int = 8, n: int = 4) -> None:
        super().__init__()
        self.cells = nn.Sequential(*(Cell(dim) for _ in range(n)))


def test_deepspeed_engine_fake_and_zero3_numel() -> None:
    model = Trunk()
    true_bytes = sum(p.numel() * 4 for p in model.parameters())
    for p in model.parameters():  # ZeRO-3: the local tensor is empty, ds_numel the full size
        p.ds_numel = p.numel()  # type: ignore[attr-defined]
        p.data = torch.empty(0)
    desc = describe_model(DeepSpeedEngine(model))
    assert desc.framework == "deepspeed"
    assert desc.param_bytes == true_bytes
    ds = desc.deepspeed
    assert ds is not None and ds.zero_stage == 3 and ds.overlap_comm is True
    assert (ds.reduce_bucket_size, ds.prefetch_bucket_size) == (500_000_000, 50_000_000)
    assert ds.param_persistence_threshold == 100_000 and ds.bf16 is True and ds.fp16 is False
    assert ds.max_live_parameters is None  # an accessor the engine lacks: unknown, no error
    assert desc.optimizers[0].cls == "FakeZeroOptimizer"
    assert desc.wrappers == ("DeepSpeedEngine",) and desc.model_class == "Trunk"
    cells = next(r for r in desc.repeated if r.path == "cells")
    assert (cells.child_class, cells.count) == ("Cell", 4)


def test_module_cap_and_collapsed_repeats() -> None:
    model = nn.Sequential(*(Trunk(dim=2, n=3) for _ in range(400)))  # 2001 modules
    desc = describe_model(model)
    assert desc.modules_total == 1 + 400 * (2 + 3 * 2)
    assert len(desc.modules) <= MAX_MODULES
    assert len(desc.modules) + desc.modules_dropped == desc.modules_total
    assert desc.modules[0].collapsed_children == 398
    assert desc.modules[0].total_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert any("left out" in n for n in desc.notes)
    assert len(json.dumps(desc.to_json())) < 1_000_000


def test_tied_parameters_count_once_and_optimizer_options() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    desc = describe_model(model)
    assert desc.param_count == 40
    opt = describe_optimizer(torch.optim.AdamW(model.parameters(), lr=0.5, foreach=False))
    assert opt.cls == "AdamW" and opt.param_count == 40 and ("foreach", "False") in opt.options


def test_schema_module_does_not_import_torch() -> None:
    code = (
        "import sys; import zdiag.collectors.model_schema, zdiag.analyzers.inputs.model_facts; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_from_json_is_tolerant_and_checks_the_schema() -> None:
    desc = describe_model(Trunk())
    data = json.loads(json.dumps(desc.to_json()))
    assert ModelDescription.from_json(data) == desc
    data["a_future_key"] = {"x": 1}
    data["modules"][0]["another"] = 2
    data["param_bytes"] = "not a number"  # malformed: keeps the default
    del data["rank"]
    back = ModelDescription.from_json(data)
    assert back.param_bytes == 0 and back.modules == desc.modules and back.rank == 0
    with pytest.raises(ValueError, match="schema"):
        ModelDescription.from_json({**data, "schema": "zdiag.model/2"})
    with pytest.raises(ValueError, match="schema"):
        ModelDescription.from_json({**data, "schema": "zdiag.model/10"})
    assert ModelDescription.from_json({**data, "schema": "zdiag.model/1.1"}).modules == desc.modules
    assert MODEL_SCHEMA == "zdiag.model/1"


def test_a_corrupt_file_is_an_input_error(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "rank-0.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        facts_from_run_dir(tmp_path)
    (tmp_path / "model" / "rank-0.json").write_text('{"schema": "zdiag.manifest/1"}')
    with pytest.raises(InputError, match="not a zdiag model description"):
        facts_from_run_dir(tmp_path, rank=0)
    assert facts_from_run_dir(tmp_path / "elsewhere") is None


# ------------------------------------------------------------------------- the granularity rule
def rep(path: str, cls: str, count: int, per_child: int, **kw: Any) -> RepeatedSet:
    return RepeatedSet(
        path=path,
        child_class=cls,
        child_module=kw.pop("module", "user.model"),
        count=count,
        child_modules=kw.pop("child_modules", 5),
        bytes_per_child_min=per_child,
        bytes_per_child_max=per_child,
        total_bytes=per_child * count,
    )


def test_rule_never_picks_leaf_layers_or_generic_containers() -> None:
    desc = ModelDescription(
        param_bytes=1000,
        repeated=(
            rep("", "Sequential", 4, 240, module="torch.nn.modules.container"),
            rep("blocks.0", "Linear", 2, 100, module="torch.nn.modules.linear", child_modules=1),
            rep("stages.0", "ConvUnit", 3, 80),
            rep("stages.1", "ConvUnit", 3, 80),
            rep("stages.2", "ConvUnit", 3, 80),
            rep("stages.3", "ConvUnit", 3, 80),
            rep("", "FusedLinear", 2, 10, module="apex", child_modules=1),
        ),
    )
    ranked = rank_blocks(desc)
    assert [c.child_class for c in ranked] == ["ConvUnit"]
    assert ranked[0].count == 12 and ranked[0].coverage == pytest.approx(0.96)
    assert ranked[0].containers == ("stages.0", "stages.1", "stages.2", "stages.3")


def test_rule_prefers_the_finest_class_that_still_covers_the_model() -> None:
    # 4 Stage blocks of 3 ConvUnit each: same coverage, the finer ConvUnit wins
    stages = ModelDescription(
        param_bytes=1000,
        repeated=(
            rep("body", "Stage", 4, 240),
            *(rep(f"body.{i}", "ConvUnit", 3, 80) for i in range(4)),
        ),
    )
    assert [c.child_class for c in rank_blocks(stages)] == ["ConvUnit", "Stage"]
    # 8 layers of 64 tiny experts: each expert under MIN_BLOCK_SHARE, the layers win
    expert = int(1_000_000 * MIN_BLOCK_SHARE / 2)
    moe = ModelDescription(
        param_bytes=1_000_000,
        repeated=(
            rep("layers", "MoELayer", 8, 120_000),
            *(rep(f"layers.{i}.experts", "Expert", 64, expert, child_modules=1) for i in range(8)),
        ),
    )
    ranked = rank_blocks(moe)
    assert [c.child_class for c in ranked] == ["MoELayer", "Expert"]
    assert ranked[1].too_fine and not ranked[0].too_fine


def test_user_leaf_block_with_raw_parameters_stays_a_candidate() -> None:
    desc = ModelDescription(
        param_bytes=1000, repeated=(rep("experts", "Expert", 4, 240, child_modules=1),)
    )
    assert [c.child_class for c in rank_blocks(desc)] == ["Expert"]


def test_inferred_facts_from_fsdp2_labels() -> None:
    labels = [
        "FSDP::pre_forward",
        "FSDP::pre_forward (trunk.cells.0)",
        "FSDP::all_gather (trunk.cells.0)",
        "FSDP::pre_forward (trunk.cells.1)",
        "FSDP::pre_forward (trunk.cells.2)",
        "ProfilerStep#3",
    ]
    facts = inferred_facts(labels, unit_bytes={"trunk.cells.0": 4096})
    assert facts.inferred and facts.framework == "fsdp2"
    assert [u.path for u in facts.fsdp2_units] == [
        "",
        "trunk.cells.0",
        "trunk.cells.1",
        "trunk.cells.2",
    ]
    assert facts.unit_bytes["trunk.cells.0"] == 4096
    assert facts.unit_bytes["trunk.cells.1"] is None  # unknown, never 0
    best = facts.best_block()
    assert best is not None and best.containers == ("trunk.cells",) and best.count == 3
    assert best.child_class == "" and best.total_bytes is None
    assert python_path("trunk.cells") == "model.trunk.cells"
    assert python_path("layers.0.mlp") == "model.layers[0].mlp"


def test_hooks_leave_loops_without_an_optimizer_and_with_accumulation(tmp_path: Path) -> None:
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optimizer_mod

    from zdiag.collectors.model_capture import ModelCapture

    def hooks() -> tuple[int, int]:
        return (
            len(module_mod._global_forward_pre_hooks),
            len(optimizer_mod._global_optimizer_post_hooks),
        )

    before = hooks()
    model = Trunk()
    x = torch.randn(2, 8)
    errors: list[str] = []
    # no torch optimizer: the forward hook goes at the model's second forward
    capture = ModelCapture(tmp_path / "a", 0, errors.append).arm()
    model.cells(x)
    model.cells(x)
    assert hooks()[0] == before[0] and capture.written
    capture.disarm()
    assert hooks() == before
    # gradient accumulation: 2 forwards, a step, then a forward removes both hooks
    capture = ModelCapture(tmp_path / "b", 0, errors.append).arm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model.cells(x).sum().backward()
    opt.step()
    assert hooks()[0] == before[0] + 1  # re-armed once, to remove the step hook
    model.cells(x)
    assert hooks() == before and not errors
    desc = ModelDescription.from_json(json.loads(capture.path.read_text()))
    assert [o.cls for o in desc.optimizers] == ["SGD"] and desc.model_class == "Sequential"


def test_fsdp2_unit_degrades_when_private_attributes_are_missing() -> None:
    """An older torch whose FSDP state lacks the private attributes read on 2.13: fewer fields,
    each listed in `missing`, never an error."""
    from zdiag.collectors.framework_settings import fsdp2_unit

    class OldState:
        pass

    class Unit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def _get_fsdp_state(self) -> OldState:
            return OldState()

    unit = fsdp2_unit(Unit(), "encoder.stages.0", Unit, nested=False, paths={})
    assert unit.path == "encoder.stages.0"
    assert unit.unsharded_bytes == 20 * 4  # from the module's own parameters
    assert unit.reshard_after_forward is None and unit.forward_prefetch is None
    assert {"_fsdp_param_group", "_states_to_forward_prefetch", "post_forward_mesh_info"} <= set(
        unit.missing
    )


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_in, self.w_out = nn.Linear(16, 64), nn.Linear(64, 16)


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(16, 48)
        self.experts = nn.ModuleList(_Expert() for _ in range(4))


def test_wrap_levels_offer_the_mixers_around_the_chosen_experts() -> None:
    """`zdiag plan` replays each level of blocks: the detectors' choice first, then the
    repeated class that holds it (the mixers around the experts), as block sets with the
    user's container paths."""
    from zdiag.analyzers.detectors.facts import model_block_set, wrap_levels

    model = nn.Module()
    model.body = nn.Module()
    model.body.mixers = nn.ModuleList(_Mixer() for _ in range(3))
    facts = ModelFacts(describe_model(model))
    levels = wrap_levels(facts)
    containers = [model_block_set(facts, level).containers for level in levels]  # type: ignore[union-attr]
    assert ("body.mixers",) in containers
    assert any(c[0].endswith(".experts") for c in containers)
    assert len(containers) == len(set(containers)) == 2


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(_Layer() for _ in range(5))
        self.head = nn.Linear(8, 10)


def test_definition_key_orders_paths_the_description_collapsed() -> None:
    """Paths under siblings the description left out are placed by their index, and named
    children by where the first sibling's subtree lists them; unknown names are not placed."""
    facts = ModelFacts(describe_model(_Stack()))
    listed = {m.path for m in facts.description.modules}
    assert "layers.4" not in listed and "layers.4.experts" not in listed
    paths = ["head", "layers.4.experts", "layers.1.experts.2", "layers.4.attn", "embed", ""]
    keys = {p: facts.definition_key(p) for p in paths}
    assert None not in keys.values()
    assert sorted(paths, key=lambda p: keys[p] or ()) == [
        "",
        "embed",
        "layers.1.experts.2",
        "layers.4.attn",
        "layers.4.experts",
        "head",
    ]
    assert facts.definition_key("layers.4.nowhere") is None
