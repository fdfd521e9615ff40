"""Pipeline stages and schedules recorded at construction (collectors/pipeline_capture.py): fake
stage/schedule classes in fake modules named as torch's, the post-import finder on a module
imported after install, contained failures, and the description (schema 1.2, role "pp")."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from zdiag.collectors import pipeline_capture as pc
from zdiag.collectors.model_schema import (
    MAX_PIPELINE_STAGES,
    MODEL_SCHEMA_VERSION,
    DeviceMeshInfo,
    MeshDim,
    ModelDescription,
    PipelineInfo,
)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)  # 40 float32 parameters: 160 bytes


def _fake_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """Modules named as torch's with a stage base class and two schedule bases."""
    stage_mod = types.ModuleType(pc.STAGE_MODULE)
    sched_mod = types.ModuleType(pc.SCHEDULE_MODULE)

    class _PipelineStageBase:
        def __init__(self, submod: Any, stage_index: int, num_stages: int, group: Any) -> None:
            if stage_index >= num_stages:
                raise ValueError("Stage index out of range")
            self.submod, self.stage_index, self.num_stages = submod, stage_index, num_stages
            self.group, self.group_rank = group, stage_index % 2

    class PipelineStage(_PipelineStageBase):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.after_base = True

    class PipelineScheduleSingle:
        def __init__(self, stage: Any, n_microbatches: int) -> None:
            self._stage, self._n_microbatches, self._num_stages = stage, n_microbatches, 2

    class ScheduleGPipe(PipelineScheduleSingle):
        pass

    class PipelineScheduleMulti:
        def __init__(self, stages: list[Any], n_microbatches: int) -> None:
            self._stages, self._n_microbatches, self._num_stages = stages, n_microbatches, 4

    class ScheduleInterleaved1F1B(PipelineScheduleMulti):
        pass

    stage_mod._PipelineStageBase = _PipelineStageBase  # type: ignore[attr-defined]
    stage_mod.PipelineStage = PipelineStage  # type: ignore[attr-defined]
    sched_mod.PipelineScheduleSingle = PipelineScheduleSingle  # type: ignore[attr-defined]
    sched_mod.ScheduleGPipe = ScheduleGPipe  # type: ignore[attr-defined]
    sched_mod.PipelineScheduleMulti = PipelineScheduleMulti  # type: ignore[attr-defined]
    sched_mod.ScheduleInterleaved1F1B = ScheduleInterleaved1F1B  # type: ignore[attr-defined]
    return stage_mod, sched_mod


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, types.ModuleType]:
    """The fake modules, loaded under torch's names; groups resolve to members [0, 1], "3"."""
    mods = _fake_modules()
    for mod in mods:
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(pc, "_group_members", lambda group: ((0, 1), "3"))
    return mods


def test_stages_and_schedules_are_recorded(fake: Any) -> None:
    stage_mod, sched_mod = fake
    rec = pc.PipelineRecorder().install()
    try:
        stage = stage_mod.PipelineStage(_Model(), 1, 2, None)
        assert stage.after_base  # the subclass's own __init__ still runs after the base
        sched_mod.ScheduleGPipe(stage, 8)
        other = stage_mod.PipelineStage(_Model(), 3, 4, None)
        sched_mod.ScheduleInterleaved1F1B([stage, other], 16)
    finally:
        rec.uninstall()
    info = rec.recorded()
    assert info is not None and rec.error is None
    first = info.stages[0]
    assert (first.stage_index, first.num_stages, first.group_rank) == (1, 2, 1)
    assert first.group_ranks == (0, 1) and first.group_name == "3"
    assert (first.submodule_class, first.param_count, first.param_bytes) == ("_Model", 40, 160)
    gpipe, inter = info.schedules
    assert (gpipe.cls, gpipe.n_microbatches, gpipe.stage_indexes) == ("ScheduleGPipe", 8, (1,))
    assert (inter.cls, inter.n_microbatches, inter.stage_indexes) == (
        "ScheduleInterleaved1F1B",
        16,
        (1, 3),
    )
    # uninstalled: the constructors are torch's again and record nothing
    assert not hasattr(stage_mod._PipelineStageBase.__init__, "__zdiag_pipeline_original__")
    stage_mod.PipelineStage(_Model(), 0, 2, None)
    assert len(rec.stages) == 2


def test_constructor_errors_pass_through_and_recorder_errors_switch_it_off(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    stage_mod, sched_mod = fake
    rec = pc.PipelineRecorder().install()
    try:
        with pytest.raises(ValueError, match="out of range"):
            stage_mod.PipelineStage(_Model(), 2, 2, None)
        assert rec.stages == [] and rec.error is None
        monkeypatch.setattr(pc, "_group_members", lambda group: 1 / 0)
        stage = stage_mod.PipelineStage(_Model(), 0, 2, None)  # training goes on
        assert stage.stage_index == 0
        assert rec.error is not None and rec.error.startswith("ZeroDivisionError")
        assert not rec.active
        sched_mod.ScheduleGPipe(stage, 4)  # off: nothing recorded any more
        assert rec.recorded() is None
    finally:
        rec.uninstall()


def test_caps(fake: Any) -> None:
    stage_mod, _ = fake
    rec = pc.PipelineRecorder().install()
    try:
        for _ in range(MAX_PIPELINE_STAGES + 3):
            stage_mod.PipelineStage(nn.Identity(), 0, 2, None)
    finally:
        rec.uninstall()
    assert len(rec.stages) == MAX_PIPELINE_STAGES and rec.dropped == 3


def test_modules_imported_after_install_are_wrapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "zdiag_fake_stage.py").write_text(
        "class _PipelineStageBase:\n"
        "    def __init__(self):\n"
        "        self.stage_index, self.num_stages, self.group = 0, 2, None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(pc, "STAGE_MODULE", "zdiag_fake_stage")
    monkeypatch.setattr(pc, "TARGETS", {"zdiag_fake_stage": ("_PipelineStageBase",)})
    monkeypatch.setattr(pc, "_group_members", lambda group: ((0, 1), "1"))
    monkeypatch.delitem(sys.modules, "zdiag_fake_stage", raising=False)
    rec = pc.PipelineRecorder().install()
    try:
        assert rec._finder in sys.meta_path
        import zdiag_fake_stage  # type: ignore[import-not-found]

        zdiag_fake_stage._PipelineStageBase()
    finally:
        rec.uninstall()
        sys.modules.pop("zdiag_fake_stage", None)
    assert [s.stage_index for s in rec.stages] == [0]
    assert rec._finder is None and all(
        not isinstance(f, pc._PostImportFinder) for f in sys.meta_path
    )


def test_description_gets_the_pipeline_and_the_pp_role() -> None:
    info = PipelineInfo(stages=(pc.PipelineStageInfo(0, 2, 0, (0, 1), "3"),))
    desc = ModelDescription(
        mesh=DeviceMeshInfo(
            shape=(2, 2),
            dim_names=("dp", "pp"),
            ranks=(0, 1, 2, 3),
            dims=(MeshDim("dp", 2, "shard", (0, 2)), MeshDim("pp", 2, "unused", (0, 1))),
        )
    )
    out = pc.with_pipeline(desc, info)
    assert out.pipeline == info
    assert out.mesh is not None and [d.role for d in out.mesh.dims] == ["shard", "pp"]
    assert pc.with_pipeline(desc, None) is desc
    # written as 1.2, read back; a 1.1 file (no pipeline) still loads
    assert MODEL_SCHEMA_VERSION == "zdiag.model/1.3"
    back = ModelDescription.from_json(out.to_json())
    assert back == out
    old = {k: v for k, v in desc.to_json().items() if k != "pipeline"}
    old["schema"] = "zdiag.model/1.1"
    assert ModelDescription.from_json(old).pipeline is None
    broken = {**out.to_json(), "pipeline": {"stages": "nope"}}
    assert ModelDescription.from_json(broken).pipeline == PipelineInfo()
    assert dataclasses.replace(out, pipeline=None).pipeline is None


def test_an_unlabelled_schedules_micro_batches_get_ranges() -> None:
    """Schedule1F1B wraps its actions in no range: its stage's chunks get `Forward <i>` /
    `Backward <i>` (what pipeline_times reads), on this object only, results untouched."""
    import torch

    from zdiag.collectors.pipeline_capture import label_micro_batches

    class Stage:
        def forward_one_chunk(self, fwd_chunk_id: int, args: object = None) -> int:
            return fwd_chunk_id * 10

        def backward_one_chunk(self, bwd_chunk_id: int, loss: object = None) -> str:
            return f"b{bwd_chunk_id}"

    stage = Stage()
    label_micro_batches(stage)
    label_micro_batches(stage)  # twice: wrapped once
    with torch.profiler.profile() as prof:
        assert stage.forward_one_chunk(3, ()) == 30
        assert stage.forward_one_chunk(fwd_chunk_id=4) == 40
        assert stage.backward_one_chunk(3) == "b3"
    names = [e.name for e in prof.events()]
    assert names.count("Forward 3") == 1 and "Forward 4" in names and "Backward 3" in names
    assert not hasattr(Stage().forward_one_chunk, "__wrapped__")  # the class is untouched


def test_the_loss_function_is_recorded_by_an_importable_name() -> None:
    import torch.nn.functional as F

    from zdiag.collectors.pipeline_capture import importable_name

    assert importable_name(F.cross_entropy) == "torch.nn.functional:cross_entropy"
    assert importable_name(lambda out, y: out) == ""
    assert importable_name(None) == ""
