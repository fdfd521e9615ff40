"""The run's pipeline parallelism as detectors read it: stages, schedule, which rank runs which.

Built from a model description (`zdiag.model/1.2`, collectors/pipeline_capture.py says what is
captured); descriptions without pipeline stages give None. One rank's description is enough to
place every stage: a stage's pipeline group lists its members in group-rank order, and torch
puts stage `s` on group rank `s % group size` (V-shaped schedules, `ScheduleZBVZeroBubble` and
`ScheduleDualPipeV`: stage `s` and stage `2 * size - 1 - s` share a rank). The other pipelines
(one per data-parallel replica) are the groups along the mesh dimension whose role is "pp";
without a mesh, only the captured rank's own pipeline is known.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...collectors.model_schema import PipelineInfo, PipelineScheduleInfo, PipelineStageInfo
from .mesh_facts import MeshFacts

V_SCHEDULES = frozenset({"ScheduleZBVZeroBubble", "ScheduleDualPipeV"})


@dataclass(frozen=True)
class PipelineFacts:
    """The pipeline of a run (module docstring)."""

    num_stages: int
    schedule: PipelineScheduleInfo | None  # the captured rank's first schedule
    groups: tuple[tuple[int, ...], ...]  # each pipeline's members, group-rank order
    stages: tuple[PipelineStageInfo, ...]  # the captured rank's own stages

    @property
    def n_microbatches(self) -> int | None:
        """Micro-batches per step of the schedule, None when no schedule was captured."""
        return self.schedule.n_microbatches if self.schedule is not None else None

    def stage_rank_position(self, stage: int, size: int) -> int:
        """The group rank that runs `stage` in a pipeline group of `size` members."""
        if self.schedule is not None and self.schedule.cls in V_SCHEDULES:
            return stage if stage < size else 2 * size - 1 - stage
        return stage % size

    def ranks_of_stage(self, stage: int) -> tuple[int, ...]:
        """The global ranks that run `stage`, one per pipeline."""
        out = []
        for group in self.groups:
            if group:
                out.append(group[self.stage_rank_position(stage, len(group))])
        return tuple(sorted(out))


def pipeline_facts(pipeline: PipelineInfo | None, mesh: MeshFacts | None) -> PipelineFacts | None:
    """The pipeline facts of a description's parts; None without a captured stage."""
    if pipeline is None or not pipeline.stages:
        return None
    first = pipeline.stages[0]
    groups: tuple[tuple[int, ...], ...] = (first.group_ranks,) if first.group_ranks else ()
    if mesh is not None:
        own = frozenset(first.group_ranks)
        for dim in mesh.dims_with_role("pp"):
            if any(frozenset(g) == own for g in dim.groups):
                groups = dim.groups
                break
    return PipelineFacts(
        num_stages=first.num_stages,
        schedule=pipeline.schedules[0] if pipeline.schedules else None,
        groups=groups,
        stages=pipeline.stages,
    )
