"""The pipeline stages and schedules a rank builds (`torch.distributed.pipelining`), recorded as
they are constructed.

A stage or schedule object lives outside the model (the script holds it), so the model
description cannot find it from the model. `PipelineRecorder.install()` wraps the constructors
torch runs for every stage and schedule instead (torch 2.13, all public classes reach them):

- `stage._PipelineStageBase.__init__` (`PipelineStage` and the tracing frontend's
  `_PipelineStage` call it first): after it returns, `stage_index`, `num_stages`, `group`
  (None: the default group), `group_rank` and `submod` are set. The group's members come from
  the public `torch.distributed.get_process_group_ranks`.
- `schedules.PipelineScheduleSingle.__init__` (`ScheduleGPipe`, `Schedule1F1B`; `_stage`) and
  `schedules.PipelineScheduleMulti.__init__` (`ScheduleInterleaved1F1B`, `ScheduleLoopedBFS`,
  the zero-bubble schedules; `_stages`), with `_n_microbatches` from their common base.

Importing `torch.distributed.pipelining` costs about half a second, so the recorder never
imports it: when the modules are already loaded it wraps them at once, otherwise an import
finder (first on `sys.meta_path`, one string test per import while installed) wraps each class
right after its module runs. It must never slow, block or break training: nothing is done per
micro-batch or step, only once per stage or schedule built (for a schedule torch does not
label, `Schedule1F1B`, one `record_function` range per micro-batch action:
`label_micro_batches`); the constructor's own result and exceptions pass through untouched;
the recorder's own errors are caught, switch it off and are kept in `error` (the session
reports them once as a collector note). At most `MAX_PIPELINE_STAGES` stages and `MAX_PIPELINE_SCHEDULES` schedules are kept.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from .framework_settings import user_class
from .model_schema import (
    MAX_PIPELINE_SCHEDULES,
    MAX_PIPELINE_STAGES,
    DeviceMeshInfo,
    ModelDescription,
    PipelineInfo,
    PipelineScheduleInfo,
    PipelineStageInfo,
)

STAGE_MODULE = "torch.distributed.pipelining.stage"
SCHEDULE_MODULE = "torch.distributed.pipelining.schedules"
TARGETS: dict[str, tuple[str, ...]] = {
    STAGE_MODULE: ("_PipelineStageBase",),
    SCHEDULE_MODULE: ("PipelineScheduleSingle", "PipelineScheduleMulti"),
}
"""Module -> the classes whose `__init__` is wrapped."""
_WRAPPED = "__zdiag_pipeline_original__"


class PipelineRecorder:
    """Records each pipeline stage and schedule constructed while installed."""

    def __init__(self) -> None:
        """A recorder that records nothing until `install`."""
        self.active = False
        self.error: str | None = None  # the first error of the recording (it then stops)
        self.stages: list[PipelineStageInfo] = []
        self.schedules: list[PipelineScheduleInfo] = []
        self.dropped = 0  # stages and schedules beyond the caps
        self._patched: list[tuple[type, Any]] = []  # (class, original __init__)
        self._finder: _PostImportFinder | None = None

    # ----------------------------------------------------------------- install
    def install(self) -> PipelineRecorder:
        """Wrap the constructors of the loaded pipelining modules, and of those imported later."""
        self.active = True
        pending = []
        for name in TARGETS:
            module = sys.modules.get(name)
            if module is not None:
                self.patch(module)
            else:
                pending.append(name)
        if pending:
            self._finder = _PostImportFinder(frozenset(pending), self.patch)
            sys.meta_path.insert(0, self._finder)
        return self

    def uninstall(self) -> None:
        """Put the original constructors back and drop the import finder."""
        self.active = False
        if self._finder is not None:
            try:
                sys.meta_path.remove(self._finder)
            except ValueError:
                pass
            self._finder = None
        for cls, original in self._patched:
            if getattr(cls.__dict__.get("__init__"), _WRAPPED, None) is original:
                cls.__init__ = original  # type: ignore[misc]
        self._patched = []

    def patch(self, module: ModuleType) -> None:
        """Wrap `__init__` of the target classes `module` defines (contained)."""
        try:
            for cls_name in TARGETS.get(module.__name__, ()):
                cls = getattr(module, cls_name, None)
                init = cls.__dict__.get("__init__") if isinstance(cls, type) else None
                if cls is None or init is None or hasattr(init, _WRAPPED):
                    continue
                record = (
                    self._record_stage if module.__name__ == STAGE_MODULE else self._record_schedule
                )
                cls.__init__ = self._wrap(init, record)
                self._patched.append((cls, init))
        except Exception as exc:
            self._fail(exc)

    def _wrap(
        self, init: Callable[..., None], record: Callable[[Any], None]
    ) -> Callable[..., None]:
        recorder = self

        @functools.wraps(init)
        def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
            init(obj, *args, **kwargs)
            if recorder.active:
                record(obj)

        setattr(__init__, _WRAPPED, init)
        return __init__

    # ----------------------------------------------------------------- recording
    def _record_stage(self, stage: Any) -> None:
        try:
            if len(self.stages) >= MAX_PIPELINE_STAGES:
                self.dropped += 1
                return
            self.stages.append(describe_stage(stage))
        except Exception as exc:
            self._fail(exc)

    def _record_schedule(self, schedule: Any) -> None:
        try:
            if len(self.schedules) >= MAX_PIPELINE_SCHEDULES:
                self.dropped += 1
                return
            self.schedules.append(describe_schedule(schedule))
            if type(schedule).__name__ in UNLABELLED_SCHEDULES:
                label_micro_batches(getattr(schedule, "_stage", None))
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.active = False
        if self.error is None:
            self.error = f"{type(exc).__name__}: {exc}"

    def recorded(self) -> PipelineInfo | None:
        """What was recorded so far; None when no stage or schedule was built."""
        if not self.stages and not self.schedules:
            return None
        return PipelineInfo(stages=tuple(self.stages), schedules=tuple(self.schedules))


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the watched modules it lets the other finders find the spec and
    wraps its loader so that `then(module)` runs right after the module's code."""

    def __init__(self, names: frozenset[str], then: Callable[[ModuleType], None]) -> None:
        self.names = names
        self.then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenLoader(spec.loader, self.then)
                return spec
        return None


class _ThenLoader(importlib.abc.Loader):
    """A loader that runs `then(module)` after the wrapped loader executed the module."""

    def __init__(self, loader: Any, then: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.then(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self.loader, name)


# ------------------------------------------------------------------------- what is recorded
UNLABELLED_SCHEDULES = frozenset({"Schedule1F1B"})
"""Schedules whose micro-batch actions torch (2.13) wraps in no `record_function` range
(ScheduleGPipe labels `Forward <i>` / `Backward <i>`, the runtime schedules `PP:<action>`)."""


def label_micro_batches(stage: Any) -> None:
    """Wrap this stage object's `forward_one_chunk` / `backward_one_chunk` in the ranges
    ScheduleGPipe uses (`Forward <i>`, `Backward <i>`), so its pipeline phase can be timed:
    one `record_function` per micro-batch action (a few microseconds each, a no-op without a
    profiler). Only this object is changed, not the class."""
    if stage is None:
        return
    from torch.profiler import record_function

    for method, label in (("forward_one_chunk", "Forward"), ("backward_one_chunk", "Backward")):
        bound = getattr(stage, method, None)
        if bound is None or hasattr(bound, _WRAPPED):
            continue

        def labelled(*args: Any, _run: Any = bound, _label: str = label, **kw: Any) -> Any:
            chunk = args[0] if args else kw.get("fwd_chunk_id", kw.get("bwd_chunk_id", "?"))
            with record_function(f"{_label} {chunk}"):
                return _run(*args, **kw)

        setattr(labelled, _WRAPPED, bound)
        setattr(stage, method, labelled)


def _group_members(group: Any) -> tuple[tuple[int, ...], str | None]:
    """A process group's members (global ranks, group-rank order) and c10d name."""
    import torch.distributed as dist

    if group is None:
        group = dist.distributed_c10d._get_default_group()
    ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
    name = getattr(group, "group_name", None)
    return ranks, str(name) if name is not None else None


def _param_sizes(module: Any) -> tuple[int, int]:
    """(parameters, logical bytes) of a module: a DTensor's (FSDP2) global size, each once."""
    count = nbytes = 0
    for p in module.parameters():
        numel = int(p.numel())
        count += numel
        nbytes += numel * p.dtype.itemsize
    return count, nbytes


def describe_stage(stage: Any) -> PipelineStageInfo:
    """The record of a constructed pipeline stage."""
    ranks, name = _group_members(getattr(stage, "group", None))
    submod = getattr(stage, "submod", None)
    count = nbytes = None
    cls = ""
    if submod is not None:
        cls = user_class(submod).__name__
        count, nbytes = _param_sizes(submod)
    return PipelineStageInfo(
        stage_index=int(stage.stage_index),
        num_stages=int(stage.num_stages),
        group_rank=int(getattr(stage, "group_rank", 0)),
        group_ranks=ranks,
        group_name=name,
        submodule_class=cls,
        param_count=count,
        param_bytes=nbytes,
    )


def describe_schedule(schedule: Any) -> PipelineScheduleInfo:
    """The record of a constructed pipeline schedule."""
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        one = getattr(schedule, "_stage", None)
        stages = [one] if one is not None else []
    return PipelineScheduleInfo(
        cls=type(schedule).__name__,
        module=type(schedule).__module__,
        n_microbatches=int(getattr(schedule, "_n_microbatches", 0) or 0),
        stage_indexes=tuple(int(s.stage_index) for s in stages),
        num_stages=int(getattr(schedule, "_num_stages", 0) or 0),
        loss_fn=importable_name(getattr(schedule, "_loss_fn", None)),
    )


def importable_name(fn: Any) -> str:
    """ "module:qualname" of a module-level function, class or builtin (what `from module
    import qualname` gives back); "" for lambdas, closures, methods and anything else."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str)) or not qualname.isidentifier():
        return ""
    return f"{module}:{qualname}"[:200]


def with_pipeline(desc: ModelDescription, pipeline: PipelineInfo | None) -> ModelDescription:
    """`desc` with `pipeline`, and the mesh dimension whose group is a stage's pipeline group
    (an "unused" one) given the role "pp"."""
    if pipeline is None or pipeline == desc.pipeline:
        return desc
    return dataclasses.replace(desc, pipeline=pipeline, mesh=_pp_roles(desc.mesh, pipeline))


def _pp_roles(mesh: DeviceMeshInfo | None, pipeline: PipelineInfo) -> DeviceMeshInfo | None:
    if mesh is None:
        return None
    pp_groups = {frozenset(s.group_ranks) for s in pipeline.stages if len(s.group_ranks) > 1}
    dims = tuple(
        dataclasses.replace(d, role="pp")
        if d.role == "unused" and frozenset(d.group_ranks) in pp_groups
        else d
        for d in mesh.dims
    )
    return dataclasses.replace(mesh, dims=dims)


__all__ = [
    "PipelineRecorder",
    "describe_schedule",
    "describe_stage",
    "with_pipeline",
]
