"""analyzers/frameworks/: recognition, step markers and remedies per framework; the registry; the
misconfiguration list defined once; the FSDP2/FSDP1/DDP remedy code run on a small torch model."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from zdiag.analyzers import frameworks
from zdiag.analyzers.frameworks import (
    BlockSet,
    Framework,
    RunFacts,
    checkpoint_blocks,
    ddp,
    deepspeed,
    fsdp1,
    fsdp2,
)
from zdiag.analyzers.inputs.events import EventKind, classify
from zdiag.analyzers.misconfigs import MISCONFIGS, SCENARIOS
from zdiag.collectors.run_records import Manifest
from zdiag.harness.config import MISCONFIG_PRESETS

STAGES = BlockSet(container="encoder.stages", block_class="ResidualMLP", count=4)
BY_PATH = BlockSet(container="encoder.stages", count=4)
BY_CLASS = BlockSet(block_class="ResidualMLP", count=4)


def facts(fw: str, blocks: BlockSet | None = STAGES, /, **settings: object) -> RunFacts:
    return RunFacts(framework=fw, blocks=blocks, blocks_are_units=False, settings=settings)


# --- registry and recognition ----------------------------------------------------------------


def test_registry_names_are_unique_and_get_falls_back_to_fsdp2() -> None:
    names = [fw.name for fw in frameworks.REGISTRY]
    assert names == ["fsdp2", "fsdp1", "deepspeed", "ddp"]
    assert frameworks.get("fsdp1") is fsdp1.FRAMEWORK
    assert frameworks.get(None) is fsdp2.FRAMEWORK
    assert frameworks.get("no-such-framework") is fsdp2.FRAMEWORK


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("FSDP::all_gather (layers.0)", "fsdp2"),
        ("FSDP::root_pre_forward", "fsdp2"),
        ("FullyShardedDataParallel._pre_forward_unshard", "fsdp1"),
        ("fetch_sub_module", "deepspeed"),
        ("PreBackwardFunctionForModuleBackward", "deepspeed"),
        ("DistributedDataParallel.forward", "ddp"),
        ("aten::mm", None),
        ("ProfilerStep#3", None),
    ],
)
def test_each_framework_recognises_its_own_labels(name: str, expected: str | None) -> None:
    found = frameworks.from_trace(["aten::add", name])
    assert (found.name if found else None) == expected


def test_event_model_classifies_sharding_labels_but_leaves_ddp_labels_alone() -> None:
    assert classify("user_annotation", "FSDP::pre_forward (layers.1)") is EventKind.FSDP_ANNOTATION
    assert classify("user_annotation", "FullyShardedDataParallel.forward") is (
        EventKind.FSDP_ANNOTATION
    )
    assert classify("user_annotation", "DeepSpeedZeRO.fetch") is EventKind.FSDP_ANNOTATION
    # DDP shards nothing: its label stays a user annotation (unchanged from before the registry)
    assert classify("user_annotation", "DistributedDataParallel.forward") is (
        EventKind.USER_ANNOTATION
    )


def test_fsdp2_label_regex_reads_phase_and_module() -> None:
    m = fsdp2.LABEL_RE.match("FSDP::all_gather (encoder.stages.2)")
    assert m and m.group("phase") == "all_gather" and m.group("fqn") == "encoder.stages.2"
    m = fsdp2.LABEL_RE.match("FSDP::forward_prefetch for encoder.stages.3")
    assert m and m.group("target") == "encoder.stages.3"
    assert fsdp1.unit_name(3) == "fsdp1-unit-3"


def test_forward_markers_in_registry_order() -> None:
    assert frameworks.forward_markers() == (fsdp2.FORWARD_MARKER, ddp.FORWARD_MARKER)


def test_from_manifest_reads_run_info_versions_and_harness() -> None:
    assert frameworks.from_manifest(None) is None
    assert frameworks.from_manifest(Manifest(world_size=2)) is None
    harness = Manifest(world_size=2, harness={"prefetch": "off", "zero": 2})
    assert frameworks.from_manifest(harness) is fsdp2.FRAMEWORK
    assert fsdp2.FRAMEWORK.manifest_settings(harness) == {
        "reshard_after_forward": False,
        "forward_prefetch": False,
        "backward_prefetch": False,
        "root_forward_prefetch": False,
    }
    named = Manifest(world_size=2, run_info={"framework": "ddp"})
    assert frameworks.from_manifest(named) is ddp.FRAMEWORK
    ds = Manifest(world_size=2, versions={"torch": "2.6", "deepspeed": "0.16.4"})
    assert frameworks.from_manifest(ds) is deepspeed.FRAMEWORK


# --- adding a framework: one module, one registry line ----------------------------------------


def test_a_registered_framework_feeds_recognition_markers_and_classification(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What `ddp.py` shows, with a made-up framework: building a Framework and adding it to
    REGISTRY is all it takes for recognition, step markers and the event model's regex."""
    import re

    new = Framework(
        name="megatron",
        title="Megatron DDP",
        annotation_re=re.compile(r"^Megatron::"),
        label_re=re.compile(r"^Megatron::"),
        forward_markers=(r"^Megatron::forward$",),
    )
    monkeypatch.setattr(frameworks, "REGISTRY", (*frameworks.REGISTRY, new))
    assert frameworks.from_trace(["Megatron::all_gather"]) is new
    assert frameworks.forward_markers()[-1] == r"^Megatron::forward$"
    assert frameworks.annotation_re().match("Megatron::all_gather")
    assert new.wrap_blocks(facts("megatron")) is None  # no remedy unless the module gives one


# --- remedies: the user's own modules, never a setting the run has ------------------------------


def test_fsdp2_wrap_names_the_container_or_the_class() -> None:
    r = fsdp2.wrap_blocks(facts("fsdp2", BY_PATH))
    assert r and r.code is not None
    assert "for block in model.encoder.stages:\n    fully_shard(block)" in r.code
    assert r.code.endswith("fully_shard(model)")
    r = fsdp2.wrap_blocks(facts("fsdp2", BY_CLASS))
    assert r and r.code and "isinstance(module, ResidualMLP)" in r.code
    assert fsdp2.wrap_blocks(replace(facts("fsdp2"), blocks_are_units=True)) is None
    unknown = fsdp2.wrap_blocks(facts("fsdp2", None))
    assert unknown is not None and unknown.code is None  # never a guessed `model.layers`


def unit_facts(**settings: object) -> RunFacts:
    """FSDP2 facts of a run whose blocks already are its units."""
    return replace(facts("fsdp2", **settings), blocks_are_units=True)


def test_fsdp2_prefetch_proposes_only_the_missing_direction() -> None:
    both = fsdp2.overlap(unit_facts())
    assert both and both.code and both.code.startswith("blocks = model.encoder.stages")
    assert "set_modules_to_forward_prefetch" in both.code
    assert "set_modules_to_backward_prefetch" in both.code
    bwd_only = fsdp2.overlap(unit_facts(forward_prefetch=True, root_forward_prefetch=True))
    assert bwd_only and bwd_only.code
    assert "forward_prefetch" not in bwd_only.code and "backward_prefetch" in bwd_only.code
    chained = unit_facts(forward_prefetch=True, backward_prefetch=True)
    root_only = fsdp2.overlap(replace(chained, first_unit="features"))
    assert root_only and root_only.code == (
        "# the root prefetches the first unit\nmodel.set_modules_to_forward_prefetch([model.features])"
    )
    assert fsdp2.overlap(unit_facts(forward_prefetch=True, backward_prefetch=True,
                                    root_forward_prefetch=True)) is None  # fmt: skip


def test_fsdp2_prefetch_names_only_units_when_the_blocks_are_not_units() -> None:
    """A per-Linear wrap: `set_modules_to_forward_prefetch` raises on a module that is not an
    FSDP unit, so the code wraps the blocks first and the root prefetches the first block, never
    today's first unit (a Linear); the run's prefetch lists between today's units carry over to
    nothing, so every direction is proposed."""
    per_linear = replace(
        facts("fsdp2", forward_prefetch=True, backward_prefetch=True, root_forward_prefetch=True),
        first_unit="encoder.stages.0.up",
    )
    r = fsdp2.overlap(per_linear)
    assert r and r.code and r.text.startswith("Make each block an FSDP unit first")
    lines = r.code.splitlines()
    assert lines.index("for block in model.encoder.stages:") < lines.index(
        "blocks = model.encoder.stages"
    )
    assert "stages[0].up" not in r.code
    assert "model.set_modules_to_forward_prefetch([blocks[0]])" in lines
    assert "    blocks[i].set_modules_to_forward_prefetch([blocks[i + 1]])" in lines
    # units coarser than the blocks (a mixer unit holding the description's expert blocks): no
    # re-wrap; the caller names the units (missing_overlap._remedy)
    experts = BlockSet(
        container="body.mixers.0.experts", more_containers=("body.mixers.1.experts",)
    )
    coarse = replace(facts("fsdp2", experts), first_unit="body.mixers.0")
    r = fsdp2.overlap(coarse)
    assert r and r.code and r.code.startswith("blocks = ") and "fully_shard" not in r.code


def test_deepspeed_overlap_treats_a_zero_prefetch_bucket_as_off() -> None:
    off = deepspeed.overlap(
        facts("deepspeed", None, overlap_comm=True, stage3_prefetch_bucket_size=0,
              stage3_max_live_parameters=1e9)
    )  # fmt: skip
    assert off and off.code and '"stage3_prefetch_bucket_size": 5e8' in off.code
    assert "overlap_comm" not in off.code
    on = facts("deepspeed", None, overlap_comm=True, stage3_prefetch_bucket_size="auto",
               stage3_max_live_parameters=1e9)  # fmt: skip
    assert deepspeed.overlap(on) is None


def test_fsdp2_bf16_and_hsdp_skip_what_the_run_has() -> None:
    r = fsdp2.bf16_comm(facts("fsdp2"))
    assert r and r.code and "MixedPrecisionPolicy(param_dtype=torch.bfloat16" in r.code
    assert fsdp2.bf16_comm(facts("fsdp2", param_dtype="bfloat16")) is None
    multi = replace(facts("fsdp2"), nnodes=2, world_size=16)
    r = fsdp2.hybrid_shard(multi)
    assert r and r.code and "(2, 8)" in r.code
    assert fsdp2.hybrid_shard(replace(multi, settings={"hsdp": True})) is None
    assert fsdp2.hybrid_shard(facts("fsdp2")) is None  # single node: nothing to propose


def test_fsdp1_wrap_uses_module_wrap_policy_with_the_block_class() -> None:
    r = fsdp1.wrap_blocks(facts("fsdp1", BY_CLASS))
    assert r and r.code and "auto_wrap_policy=ModuleWrapPolicy({ResidualMLP})" in r.code
    assert "fully_shard" not in r.code  # FSDP1 runs get FSDP1 code
    r = fsdp1.wrap_blocks(facts("fsdp1", BY_PATH))
    assert r and r.code and "blocks = set(model.encoder.stages)" in r.code
    assert "CustomPolicy" in r.code
    assert fsdp1.wrap_blocks(replace(facts("fsdp1"), blocks_are_units=True)) is None


OWN = {"forward_prefetch": True, "use_orig_params": True, "sharding_strategy": "SHARD_GRAD_OP",
       "backward_prefetch": "NONE", "limit_all_gathers": True}  # fmt: skip


def test_fsdp1_wrap_keeps_the_runs_own_arguments() -> None:
    """Pasted in place of the user's `FSDP(...)`, the wrap keeps the settings the run made that
    differ from FSDP's defaults (a default the run also has is not written)."""
    r = fsdp1.wrap_blocks(facts("fsdp1", BY_CLASS, **OWN))
    assert r and r.code
    for arg in ("forward_prefetch=True", "use_orig_params=True",
                "sharding_strategy=ShardingStrategy.SHARD_GRAD_OP", "backward_prefetch=None"):  # fmt: skip
        assert arg in r.code
    assert "from torch.distributed.fsdp import ShardingStrategy" in r.code
    assert "limit_all_gathers" not in r.code  # FSDP's default
    plain = fsdp1.wrap_blocks(facts("fsdp1", BY_CLASS))
    assert plain and plain.code and "forward_prefetch" not in plain.code


def test_fsdp1_prefetch_never_repeats_a_flag_the_run_sets() -> None:
    r = fsdp1.overlap(facts("fsdp1", None))
    assert r and r.code
    for flag in (
        "forward_prefetch=True",
        "BackwardPrefetch.BACKWARD_PRE",
        "limit_all_gathers=True",
    ):
        assert flag in r.code and flag in r.text
    r = fsdp1.overlap(facts("fsdp1", BY_CLASS, backward_prefetch="BACKWARD_PRE"))
    assert r and r.code and "BACKWARD_PRE" not in r.code and "BackwardPrefetch" not in r.code
    assert "forward_prefetch=True" in r.code and "ModuleWrapPolicy({ResidualMLP})" in r.code
    full = dict(forward_prefetch=True, backward_prefetch="BACKWARD_PRE", limit_all_gathers=True)
    assert fsdp1.overlap(facts("fsdp1", None, **full)) is None
    assert fsdp1.bf16_comm(facts("fsdp1", param_dtype="torch.bfloat16")) is None
    r = fsdp1.hybrid_shard(replace(facts("fsdp1"), nnodes=2))
    assert r and r.code and "ShardingStrategy.HYBRID_SHARD" in r.code


def test_deepspeed_remedies_are_config_keys_it_does_not_have() -> None:
    assert not deepspeed.FRAMEWORK.wraps_units
    assert deepspeed.FRAMEWORK.wrap_blocks(facts("deepspeed")) is None
    r = deepspeed.overlap(facts("deepspeed"))
    assert r and r.code
    for key in ("overlap_comm", "stage3_prefetch_bucket_size", "stage3_max_live_parameters"):
        assert f'"{key}"' in r.code
    r = deepspeed.overlap(facts("deepspeed", overlap_comm=True, stage3_prefetch_bucket_size=1e8))
    assert r and r.code == '"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9}'
    done = dict(overlap_comm=True, stage3_prefetch_bucket_size=1e8, stage3_max_live_parameters=1e9)
    assert deepspeed.overlap(facts("deepspeed", **done)) is None
    assert deepspeed.bf16_comm(facts("deepspeed", bf16=True)) is None
    r = deepspeed.hybrid_shard(replace(facts("deepspeed"), nnodes=2, world_size=16))
    assert r and r.code and '"zero_hpz_partition_size": 8' in r.code


def test_ddp_remedies_are_its_constructor_arguments() -> None:
    assert not ddp.FRAMEWORK.shards_parameters and ddp.FRAMEWORK.wrap_blocks(facts("ddp")) is None
    r = ddp.overlap(facts("ddp"))
    assert r and r.code
    for arg in ("bucket_cap_mb=", "gradient_as_bucket_view=True", "static_graph=True"):
        assert arg in r.code
    r = ddp.overlap(facts("ddp", bucket_cap_mb=50, static_graph=True))
    assert r and r.code and r.code.endswith("model = DDP(model, gradient_as_bucket_view=True)")
    done = dict(bucket_cap_mb=25, gradient_as_bucket_view=True, static_graph=True)
    assert ddp.overlap(facts("ddp", **done)) is None
    assert ddp.bf16_comm(facts("ddp", comm_hook="bf16_compress_hook")) is None


def test_checkpoint_remedy_names_the_blocks() -> None:
    r = checkpoint_blocks(BY_PATH, fsdp2.FRAMEWORK.checkpoint_note)
    assert r and r.code and "blocks = set(model.encoder.stages)" in r.code
    assert r.code.endswith("# before fully_shard")
    r = checkpoint_blocks(BY_CLASS)
    assert r and r.code and "isinstance(m, ResidualMLP)" in r.code
    assert checkpoint_blocks(None) is None


# --- the remedy code runs on the model it names --------------------------------------------------

_MODEL = """
import os, torch, torch.nn as nn, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)

class ResidualMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
    def forward(self, x):
        return x + torch.relu(self.fc(x))

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(ResidualMLP() for _ in range(3))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(16, 1)
    def forward(self, x):
        for stage in self.encoder.stages:
            x = stage(x)
        return self.head(x)

def step(model):
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()

# FSDP1 needs an accelerator (and device placement this generic check does not do): FSDP(...) binds its arguments to the real signature and
# applies the auto-wrap policy as FSDP would, recording the modules it would wrap.
import inspect
import torch.distributed.fsdp as fsdp_pkg
REAL_FSDP = fsdp_pkg.FullyShardedDataParallel
FSDP1_WRAPPED = []
def checking_fsdp(module, *args, **kwargs):
    inspect.signature(REAL_FSDP.__init__).bind(None, module, *args, **kwargs)
    policy = kwargs.get("auto_wrap_policy")
    if policy is not None and policy is not Ellipsis:
        FSDP1_WRAPPED.append(sorted(n for n, m in module.named_modules()
                                    if m in policy._run_policy(module, set(), {})))
    return module
fsdp_pkg.FullyShardedDataParallel = checking_fsdp
"""


def _run(cases: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """Exec each case's code on a fresh `model` (world size 1, gloo) in one subprocess; returns
    case -> "ok" or the exception."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "remedies.py"
    script.write_text(
        _MODEL
        + textwrap.dedent(
            """
            import json, sys, traceback
            out = {}
            for name, code in json.loads(sys.argv[1]).items():
                FSDP1_WRAPPED.clear()
                model = Net()
                try:
                    exec(code, {**globals(), "model": model})
                    step(model)
                    out[name] = "ok" if not FSDP1_WRAPPED else json.dumps(FSDP1_WRAPPED)
                except Exception:
                    out[name] = traceback.format_exc(limit=2)
            print(json.dumps(out))
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**__import__("os").environ, "PORT": str(port)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_remedy_code_runs_on_the_model_it_names(tmp_path: Path) -> None:
    """FSDP2, checkpointing and DDP code runs a forward/backward after the change; FSDP1 code
    (which needs an accelerator to run) binds to FSDP's real signature and its policy wraps
    exactly the blocks."""
    pytest.importorskip("torch")

    def code(r: frameworks.Remedy | None) -> str:
        assert r is not None and r.code is not None
        return r.code

    cases = {}
    for label, blocks in (("path", BY_PATH), ("class", BY_CLASS)):
        f2 = facts("fsdp2", blocks)
        wrap = code(fsdp2.wrap_blocks(f2))
        cases[f"fsdp2 wrap {label}"] = wrap
        # the blocks are not units (a finer wrap): the prefetch code wraps them itself, and the
        # root never prefetches today's first unit, a Linear (FSDP2 raises on a non-unit)
        per_linear = replace(f2, first_unit="encoder.stages.0.fc")
        cases[f"fsdp2 wrap+prefetch {label}"] = code(fsdp2.overlap(per_linear))
        cases[f"fsdp2 bf16 {label}"] = code(fsdp2.bf16_comm(f2))
        cases[f"fsdp1 wrap {label}"] = code(fsdp1.wrap_blocks(facts("fsdp1", blocks)))
        cases[f"checkpoint {label}"] = code(checkpoint_blocks(blocks))
    cases["fsdp1 prefetch"] = code(fsdp1.overlap(facts("fsdp1", BY_CLASS)))
    cases["fsdp1 wrap own settings"] = code(fsdp1.wrap_blocks(facts("fsdp1", BY_CLASS, **OWN)))
    cases["ddp overlap"] = code(ddp.overlap(facts("ddp")))
    results = _run(cases, tmp_path)
    stages = ["encoder.stages.0", "encoder.stages.1", "encoder.stages.2"]
    fsdp1_ok = json.dumps([stages])  # the policy wraps the blocks; the root is FSDP itself
    expected = {n: fsdp1_ok if n.startswith("fsdp1") else "ok" for n in cases}
    assert results == expected


# --- the misconfiguration list is defined once ---------------------------------------------------


def test_harness_presets_are_the_scenarios() -> None:
    assert tuple(MISCONFIG_PRESETS) == SCENARIOS
    assert SCENARIOS[1:] == MISCONFIGS


def spelled_lists(path: Path) -> list[int]:
    """Lines of `path` with a tuple/list/set literal holding every misconfiguration id."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            strings = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            if set(MISCONFIGS) <= strings:
                hits.append(node.lineno)
    return hits


def test_no_other_python_file_spells_the_misconfiguration_list() -> None:
    home = REPO_ROOT / "analyzers" / "misconfigs.py"
    assert spelled_lists(home)  # the check sees the one definition
    found = {
        str(p.relative_to(REPO_ROOT)): spelled_lists(p)
        for folder in ("analyzers", "collectors", "tui", "zdiag", "bench", "tests", "examples")
        if (REPO_ROOT / folder).is_dir() and not (REPO_ROOT / folder).is_symlink()
        for p in (REPO_ROOT / folder).rglob("*.py")
        if p != home
    }
    assert {p: lines for p, lines in found.items() if lines} == {}


def test_the_spelling_check_catches_a_copy(tmp_path: Path) -> None:
    copy = tmp_path / "copy.py"
    copy.write_text(f"CHOICES = {MISCONFIGS!r}\n")
    assert spelled_lists(copy) == [1]


@pytest.mark.parametrize(
    ("marker", "source"),
    [
        ("DistributedDataParallel.forward", "forward marker"),
        ("FSDP::root_pre_forward", "forward marker"),
        ("FSDP::pre_forward (layers.0)", "whole trace"),  # once per unit, not per step
    ],
)
def test_steps_split_at_a_registered_framework_forward_marker(
    marker: str, source: str, tmp_path: Path
) -> None:
    """Without ProfilerStep or optimizer markers, steps run from one forward label to the next:
    the labels come from the registry (DDP's from ddp.py)."""
    from support.traces import TraceBuilder
    from zdiag.analyzers.inputs.loader import load_rank_trace
    from zdiag.analyzers.rank.steps import find_steps

    b = TraceBuilder(gpu_name=None)
    for k in range(3):
        b.annotation(marker, 1000.0 * k, 400.0)
        b.cpu_op("aten::mm", 1000.0 * k + 500, 100.0)
    windows, _ = find_steps(load_rank_trace(b.write(tmp_path / "rank-0.json.gz")))
    assert windows.source == source
    if source == "forward marker":
        assert (windows.start_us - windows.start_us[0]).tolist() == [0.0, 1000.0, 2000.0]
