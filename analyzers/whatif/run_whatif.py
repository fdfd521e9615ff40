"""A change applied to every rank's modelled steps: predicted against measured.

`run_whatif(summaries, change, ...)` builds the platform model and the comm fits from the run,
replays each modelled step of each rank twice (as measured, which must give back the measured
step, and changed) and reports per rank the medians over steps: measured and replayed step
time, and the predicted one (the measured median less the median of each step's own change),
and the peak memory with the change's estimated delta
(`counterfactuals.py`). The job's figures are the medians over ranks (the ranks of a
synchronous job run in lock step, each step as long as its slowest part).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..inputs.model_facts import ModelFacts
from ..rank.declared_groups import members_by_name, sizes_by_name
from ..rank.step_model import StepModel, with_unit_paths
from ..rank.summary import RankSummary
from ..run.core_use import HostCores, busiest
from . import change_checks as checks
from . import counterfactuals as cf
from .change import Change as Change
from .change_checks import WhatIfError
from .finer_wrap import (
    SplitError,
    WrapSplit,
    finer_wrap,
    unplaceable,
    wrap_split,
)
from .memory_delta import memory_delta
from .mesh_order import MeshOrderError, Regrouping, check_order, order_notes, regroupings, reordered
from .mesh_shape import INTRA_NODE_SPEEDUP, DpGroups, Fabric, all_reduced_once, reshaped
from .micro_batch import micro_batched
from .platform import CommFit, OverheadFit, Platform, fit_comm, fit_unit_overhead, platform_of
from .replay import Replay, replay


@dataclass(frozen=True)
class RankPrediction:
    """One rank: medians over its modelled steps."""

    rank: int
    steps: int
    measured_ms: float
    replayed_ms: float  # the unchanged replay (checks the model)
    predicted_ms: float
    waited_ms: float  # time the lane waited on collectives, replayed as measured
    predicted_waited_ms: float
    peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None

    @property
    def replay_error(self) -> float:
        """|replayed - measured| / measured."""
        return (
            abs(self.replayed_ms - self.measured_ms) / self.measured_ms if self.measured_ms else 0.0
        )


@dataclass(frozen=True)
class StepReplay:
    """The representative step of one rank, replayed as measured and changed (for the overlay)."""

    rank: int
    model: StepModel
    changed_model: StepModel
    measured: Replay
    changed: Replay


@dataclass(frozen=True)
class WhatIfResult:
    """The replay of one change over a run."""

    change: Change
    platform: Platform
    fits: list[CommFit]
    overhead: OverheadFit | None
    ranks: list[RankPrediction]
    memory_delta_bytes: int | None
    memory_basis: str
    notes: list[str] = field(default_factory=list)
    timeline: StepReplay | None = None
    # the predicted step leaves out costs the run cannot show (a split's per-unit hooks): the
    # step will be at least that long
    lower_bound: bool = False

    @property
    def measured_ms(self) -> float:
        """The job's measured step: median over ranks."""
        return statistics.median(r.measured_ms for r in self.ranks)

    @property
    def predicted_ms(self) -> float:
        """The job's predicted step: median over ranks."""
        return statistics.median(r.predicted_ms for r in self.ranks)

    @property
    def gain_ms(self) -> float:
        """Measured minus predicted step time (> 0: the change is faster)."""
        return self.measured_ms - self.predicted_ms


CORE_SHARING_NOTE = (
    "compute keeps its measured time: gloo's worker thread now runs the gathers beside it and "
    "shares the host's cores, which a blocking run does not show; where the ranks fill the "
    "cores (the step log's cpu_ms near the step times each rank's cores) the gain is an upper "
    "bound (docs/whatif.md)"
)
"""The note on a CPU replay that turns the unshard async op on (docs/whatif.md, limits)."""

CORES_MEASURED = "cores: "
"""The prefix of the note `note_core_use` adds beside CORE_SHARING_NOTE."""


def note_core_use(result: WhatIfResult, hosts: Sequence[HostCores]) -> WhatIfResult:
    """`result`, with the busiest host's measured core use noted where the replay runs gloo's
    worker thread beside compute (CORE_SHARING_NOTE) and the run's step logs measured cores."""
    host = busiest(hosts)
    if CORE_SHARING_NOTE in result.notes and host is not None:
        result.notes.append(
            CORES_MEASURED
            + host.sentence()
            + (": the cores are full, the gain an upper bound" if host.full else ": not full")
        )
    return result


def apply_change(
    model: StepModel,
    change: Change,
    platform: Platform,
    fits: Mapping[str, CommFit],
    overhead: OverheadFit | None = None,
    split: WrapSplit | None = None,
    groups: DpGroups | None = None,
    fabric: Fabric | None = None,
    regroup: Regrouping | None = None,
) -> StepModel:
    """`model` with `change` applied (the wrap first: finer where `split` says, else coarser;
    then checkpointing, reshard, micro-batches, prefetch, syncs, and last the replicate
    all-reduces and the mesh shape, on the rank's data-parallel `groups` and the run's
    `fabric`, or the mesh order, on the rank's `regroup`)."""
    if split is not None:
        model = finer_wrap(model, split, fits, platform, overhead)
    elif change.wrap is not None:
        model = cf.coarser_wrap(model, change.wrap, fits, platform, overhead)
    if change.checkpoint is not None:  # placed at the backward gathers, before they may go
        model, _ = cf.checkpointed(model, change.checkpoint)
    if change.reshard_after_forward is False:
        model = cf.no_reshard_after_forward(model)
    if change.micro_batches is not None:
        model = micro_batched(model, change.micro_batches)
    if change.prefetch is not None:
        model = cf.prefetch(model, change.prefetch, platform)
    if change.remove_host_syncs or change.remove_model_syncs:
        model = cf.without_host_syncs(model, model_only=not change.remove_host_syncs)
    if change.bf16_reduce:
        model = cf.half_reduce_bytes(model, fits)
    if change.bf16_params:
        model = cf.half_gather_bytes(model, fits)
    if change.all_reduce_once and groups is not None:
        model, _ = all_reduced_once(model, groups)
    if change.mesh_shape is not None and groups is not None:
        model = reshaped(model, groups, change.mesh_shape, fits, fabric)
    if regroup is not None:
        model = reordered(model, regroup, fits)
    return model


def fabric_of(nodes: Sequence[Sequence[int]], change: Change) -> Fabric | None:
    """The run's fabric for a mesh shape: its nodes' size when it has two or more nodes of one
    size (None: a single node, unknown nodes, or nodes of different sizes)."""
    sizes = {len(n) for n in nodes}
    if len(nodes) < 2 or len(sizes) != 1:
        return None
    speedup = change.intra_node_speedup or INTRA_NODE_SPEEDUP
    return Fabric(sizes.pop(), speedup)


def run_whatif(
    summaries: Sequence[RankSummary],
    change: Change,
    *,
    framework: str | None = None,
    unshard_async_op: bool | None = None,
    peaks: Mapping[int, int] | None = None,
    model: ModelFacts | None = None,
    nodes: Sequence[Sequence[int]] = (),
) -> WhatIfResult:
    """The replay of `change` over the run of `summaries` (see the module docstring); `model`,
    the captured model, names FSDP units by module path (FSDP1 names its units by position in
    a trace) and gives a finer wrap its blocks' sizes; `nodes` (each node's ranks) give a mesh
    shape the links inside and across nodes."""
    modelled = [s for s in summaries if s.step_models]
    paths = model.trace_unit_paths() if model is not None else {}
    return replay_change(
        {s.rank: with_unit_paths(s.step_models, paths) for s in modelled},
        modelled[0].device if modelled else "unknown",
        change,
        framework=framework,
        unshard_async_op=unshard_async_op,
        peaks=peaks,
        model=model,
        group_sizes={s.rank: sizes_by_name(s.facts.process_groups) for s in modelled},
        group_members={s.rank: members_by_name(s.facts.process_groups) for s in modelled},
        world=next((s.world_size for s in modelled if s.world_size), None),
        nodes=nodes,
    )


def replay_change(
    models_by_rank: Mapping[int, Sequence[StepModel]],
    device: str,
    change: Change,
    *,
    framework: str | None = None,
    unshard_async_op: bool | None = None,
    peaks: Mapping[int, int] | None = None,
    overlap: tuple[bool, str] | None = None,
    model: ModelFacts | None = None,
    group_sizes: Mapping[int, Mapping[str, int]] | None = None,
    group_members: Mapping[int, Mapping[str, tuple[int, ...]]] | None = None,
    world: int | None = None,
    nodes: Sequence[Sequence[int]] = (),
) -> WhatIfResult:
    """The replay of `change` over each rank's step models (`run_whatif` on summaries);
    `overlap` overrides the platform's judgement of whether gathers can overlap (and why);
    `model`, the captured model, gives a finer wrap its blocks' sizes and a mesh shape the
    parameter bytes and the optimizer; `group_sizes` (per rank, its process groups' sizes by
    name) and `world` give a mesh shape the groups' sizes, `nodes` (each node's ranks) its
    links inside and across nodes; `group_members` (per rank, its process groups' ranks by
    name) tell a mesh order which dimension each collective's group is."""
    by_rank = {r: list(ms) for r, ms in models_by_rank.items() if ms}
    if not by_rank:
        raise WhatIfError(
            "no rank has a modelled step (the traces hold no step, or the summaries were "
            "written by an older zdiag); run 'zdiag analyze --no-cache' on traces with steps"
        )
    models = [m for ms in by_rank.values() for m in ms]
    notes: list[str] = []
    missing = [r for r in change.without_stragglers if r not in by_rank]
    if missing:
        raise WhatIfError(
            f"rank {missing[0]} has no modelled step in this run (modelled ranks: "
            f"{', '.join(map(str, sorted(by_rank)))}); name a rank the traces hold"
        )
    if change.without_stragglers and not set(by_rank) - set(change.without_stragglers):
        raise WhatIfError(
            "removing a straggler needs at least one other modelled rank to compare it with; "
            "analyze the traces of more ranks"
        )
    split = None
    if change.wrap is not None and not cf.units_under(models, change.wrap):
        units = sorted({op.unit for m in models for op in m.ops if op.family})
        try:
            split = wrap_split(model, change.wrap, units)
        except SplitError as exc:
            raise WhatIfError(str(exc)) from exc
        why = next((w for m in models if (w := unplaceable(m, split.unit))), None)
        if why is not None:
            raise WhatIfError(
                f"splitting the unit '{split.unit or '(root)'}' needs its passes, and it {why}: "
                "its blocks cannot be placed"
            )
        notes.append(
            f"finer wrap: {len(split.blocks)} blocks split out of the unit "
            f"'{split.unit or '(root)'}' ({1 - split.rest_share:.0%} of its parameters), placed "
            "evenly over its forward and backward (docs/whatif.md)"
        )
    if change.checkpoint is not None:
        notes += checks.checkpoint_notes(models, change.checkpoint)
    if change.micro_batches is not None:
        notes += checks.micro_batch_notes(models, change.micro_batches)
    regroups = _regroups(by_rank, change, model, nodes, group_members or {}, notes)
    groups: dict[int, DpGroups] = {}
    if change.mesh_shape is not None or change.all_reduce_once:
        groups = checks.mesh_groups(by_rank, change.mesh_shape, group_sizes or {}, world, model)
    if change.all_reduce_once:
        notes += checks.all_reduce_notes(by_rank, groups)
    if change.bf16_reduce:
        notes += checks.bf16_reduce_notes(models, model, device)
    if change.bf16_params:
        notes += checks.bf16_params_notes(models, model, device)
    fabric = None
    if change.mesh_shape is not None:
        fabric = fabric_of(nodes, change)
        spans = {g.replicate * g.shard for g in groups.values()}
        if fabric is not None and spans != {sum(len(n) for n in nodes)}:
            fabric = None  # FSDP beside other dimensions: its groups are not consecutive ranks
            notes.append(
                "FSDP's groups share the mesh with other dimensions: where they sit on the "
                "nodes is not modelled, every group keeps its measured link"
            )
        if fabric is None and change.intra_node_speedup is not None:
            notes.append(
                "--intra-node-speedup changes nothing here: it applies to runs of two or more "
                "nodes of equal size with FSDP over every rank"
            )
        notes += checks.mesh_notes(by_rank, groups, change.mesh_shape, fabric)
    if (change.prefetch or change.reshard_after_forward is False or change.wrap) and not any(
        op.family for m in models for op in m.ops
    ):
        notes.append("the traces hold no FSDP collective: the FSDP changes change nothing here")
    platform = platform_of(
        device,
        models,
        framework=framework,
        unshard_async_op=True if change.unshard_async_op else unshard_async_op,
        overlap=(True, "the change sets the unshard async op")
        if change.unshard_async_op and overlap is not None
        else overlap,
    )
    newly_async = not unshard_async_op and not (overlap is not None and overlap[0])
    if change.unshard_async_op and device == "cpu" and newly_async:
        notes.append(CORE_SHARING_NOTE)
    if change.prefetch and not platform.gathers_overlap:
        notes.append(
            f"prefetch changes nothing here: {platform.reason} (a prefetched gather still "
            "blocks; on GPUs, or with the unshard async op, it would overlap)"
        )
    fits = fit_comm(models)
    overhead = fit_unit_overhead(models)
    lower_bound = split is not None and (overhead is None or overhead.sizes < 2)
    if lower_bound:
        notes.append(
            "the run's one unit shows no per-unit hook cost, so the new units add none: where "
            "every call blocks (CPU) the predicted cost is low by their hooks"
        )
    delta, basis = memory_delta(models, change, split, groups, model)
    changed_by_rank = _changed_models(
        by_rank, change, platform, fits, overhead, split, groups, fabric, regroups
    )
    ranks: list[RankPrediction] = []
    timeline: StepReplay | None = None
    for rank in sorted(changed_by_rank):
        steps = by_rank[rank]
        base = [replay(m) for m in steps]
        changed_models = changed_by_rank[rank]
        changed = [replay(m) for m in changed_models]
        ranks.append(_prediction(rank, steps, base, changed, (peaks or {}).get(rank), delta))
        if timeline is None:
            k = _median_index([m.duration_us for m in steps])
            timeline = StepReplay(rank, steps[k], changed_models[k], base[k], changed[k])
    ranks += _stragglers_as_peers(by_rank, change, ranks, peaks)
    ranks.sort(key=lambda p: p.rank)
    return WhatIfResult(
        change=change,
        platform=platform,
        fits=sorted(fits.values(), key=lambda f: f.lane),
        overhead=overhead,
        ranks=ranks,
        memory_delta_bytes=delta,
        memory_basis=basis,
        notes=notes,
        timeline=timeline,
        lower_bound=lower_bound,
    )


def _changed_models(
    by_rank: Mapping[int, list[StepModel]],
    change: Change,
    platform: Platform,
    fits: Mapping[str, CommFit],
    overhead: OverheadFit | None,
    split: WrapSplit | None = None,
    groups: Mapping[int, DpGroups] | None = None,
    fabric: Fabric | None = None,
    regroups: Mapping[int, Regrouping] | None = None,
) -> dict[int, list[StepModel]]:
    """Each replayed rank's steps with `change` applied (the stragglers it removes are left out:
    `_stragglers_as_peers` gives them their peers' figures)."""
    if change.without_stragglers:
        by_rank = cf.without_stragglers(by_rank, change.without_stragglers)
    return {
        rank: [
            apply_change(
                m,
                change,
                platform,
                fits,
                overhead,
                split,
                (groups or {}).get(rank),
                fabric,
                (regroups or {}).get(rank),
            )
            for m in steps
        ]
        for rank, steps in by_rank.items()
    }


def _regroups(
    by_rank: Mapping[int, list[StepModel]],
    change: Change,
    model: ModelFacts | None,
    nodes: Sequence[Sequence[int]],
    members: Mapping[int, Mapping[str, tuple[int, ...]]],
    notes: list[str],
) -> dict[int, Regrouping]:
    """Each rank under the change's mesh order (empty without one; WhatIfError where the run
    cannot be reordered), its notes appended to `notes`."""
    if change.mesh_order is None:
        return {}
    if change.mesh_shape is not None:
        raise WhatIfError("give --mesh-order or --mesh-shape, not both")
    speedup = change.intra_node_speedup or INTRA_NODE_SPEEDUP
    try:
        mesh = check_order(model.mesh if model is not None else None, change.mesh_order, nodes)
    except MeshOrderError as exc:
        raise WhatIfError(str(exc)) from exc
    ranks = [r for r in by_rank if r in mesh.ranks]
    if not ranks:
        raise WhatIfError("none of the modelled ranks is in the captured mesh")
    out = regroupings(mesh, change.mesh_order, ranks, nodes, members, speedup)
    first = min(out)
    ops = by_rank[first][0].ops
    retimed = sum(1 for op in ops if out[first].regrouped(op.lane) is not None)
    if not retimed:
        raise WhatIfError(
            "no collective's process group is one of the mesh's dimensions (the traces' "
            "process-group table lists no members, or other groups): nothing to re-time"
        )
    notes += order_notes(mesh, change.mesh_order, out[first], len(ops) - retimed, retimed)
    return out


def _prediction(
    rank: int,
    steps: Sequence[StepModel],
    base: Sequence[Replay],
    changed: Sequence[Replay],
    peak: int | None,
    delta: int | None,
) -> RankPrediction:
    """One rank's medians over its steps. The predicted step is the measured median less the
    median of each step's own change (replayed as measured minus changed): pairing a step with
    its own counterfactual keeps one odd step (a gather that waited long on a peer once) from
    deciding the figure, as the median of the changed steps alone would."""
    measured = statistics.median(m.duration_us for m in steps)
    change = statistics.median(
        b.duration_us - c.duration_us for b, c in zip(base, changed, strict=True)
    )
    return RankPrediction(
        rank=rank,
        steps=len(base),
        measured_ms=measured / 1e3,
        replayed_ms=statistics.median(r.duration_us for r in base) / 1e3,
        predicted_ms=(measured - change) / 1e3,
        waited_ms=statistics.median(r.waited_us for r in base) / 1e3,
        predicted_waited_ms=statistics.median(r.waited_us for r in changed) / 1e3,
        peak_bytes=peak,
        predicted_peak_bytes=None if peak is None or delta is None else peak + delta,
    )


def _stragglers_as_peers(
    by_rank: Mapping[int, list[StepModel]],
    change: Change,
    peers: Sequence[RankPrediction],
    peaks: Mapping[int, int] | None,
) -> list[RankPrediction]:
    """The removed stragglers' rows: measured and replayed as they ran, predicted as the median
    of their peers' predictions (what made them slow is gone; they run as the others do)."""
    out = []
    for rank in change.without_stragglers:
        steps = by_rank.get(rank)
        if not steps or not peers:
            continue
        base = [replay(m) for m in steps]
        row = _prediction(rank, steps, base, base, (peaks or {}).get(rank), 0)
        out.append(
            dataclasses.replace(
                row,
                predicted_ms=statistics.median(p.predicted_ms for p in peers),
                predicted_waited_ms=statistics.median(p.predicted_waited_ms for p in peers),
            )
        )
    return out


def _median_index(values: Sequence[float]) -> int:
    order = sorted(range(len(values)), key=lambda k: values[k])
    return order[len(order) // 2]
