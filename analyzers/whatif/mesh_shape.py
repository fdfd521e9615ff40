"""Another HSDP mesh shape: the run's data-parallel ranks as R replicas of S-way sharding.

FSDP2 on a 2-D mesh (replicate, shard) gathers parameters and reduce-scatters gradients inside a
shard group of S ranks, then all-reduces each rank's gradient shard across the R replicas; flat
FSDP is R = 1, and R x 1 keeps whole copies (each "gather" is a copy on one rank).
`zdiag whatif --mesh-shape R,S` re-times the run's FSDP collectives for another split of the
same ranks (R x S = the run's R0 x S0):

- **The groups.** The shard group is the process group the FSDP all-gathers ran on, the
  replicate group the one of the FSDP reduces that are not on it. Their sizes come from the
  traces' process-group table (`distributedInfo.pg_config`), else the captured mesh, else the
  world (a run with no replicate group shards over all of it).
- **The cost.** FSDP issues no collective on a group of one rank: S = 1 drops the gathers and
  reduce-scatters. A ring collective over p ranks costs (p - 1) latencies and moves (p - 1) / p of
  its bytes per rank (an all-reduce twice both). Each gather and reduce-scatter keeps its
  measured duration, split into the lane's fitted latency and the rest, each part scaled by its
  factor from S0 to S; each replicate all-reduce likewise from R0 to R, its bytes part also by
  S0 / S (the shard it carries grows as the shards get fewer). A replicate all-reduce the run
  did not have (from a flat run) is costed from the reduce-scatter it follows: the same link (a
  latency and a time per byte on the wire), 2 (R - 1) latencies and 2 (R - 1) / R of the shard's
  bytes. It queues behind that reduce-scatter on its lane and is awaited where it was. R = 1
  removes them.
- **The optimizer** steps over the rank's shard: its measured progress (the profiler's
  `Optimizer.step#` ranges) is scaled by S0 / S.
- **Memory.** The sharded parameters, their gradients and the optimizer's states scale by
  S0 / S; the gathered units do not change (`mesh_memory_delta`).

- **The fabric.** On a multi-node run (`Fabric`: the ranks per node), a group of consecutive
  ranks (the shard group; the replicate group strides over them) crosses nodes when it holds
  more ranks than a node. A collective whose group moves inside one node from a group that
  crossed nodes moves its bytes INTRA_NODE_SPEEDUP times faster (`--intra-node-speedup`), and
  the reverse that many times slower; its latencies stay. A single-node run, or one whose nodes
  are not known, keeps every group's measured link.

Limits: one link speed per side of a node boundary, stated, not measured: a run whose groups
all cross nodes (flat FSDP over nodes) never used the links inside one. Bandwidth shared between
groups running at once, NCCL's tree algorithms and the optimizer's per-tensor overhead are not
modelled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from ..inputs.mesh_facts import MeshFacts
from ..rank.fsdp_ledger import GATHER_FAMILY
from ..rank.step_model import ModelOp, StepModel
from . import counterfactuals as cf
from .platform import CommFit, latency_part

REDUCE_FAMILY = "reduce"

ADAM_STATES = 2
"""Optimizer states per parameter of the Adam family (exp_avg, exp_avg_sq)."""

_STATES = {
    "Adam": ADAM_STATES,
    "AdamW": ADAM_STATES,
    "NAdam": ADAM_STATES,
    "RAdam": ADAM_STATES,
    "Adamax": ADAM_STATES,
    "Adadelta": 2,
    "Adagrad": 1,
    "RMSprop": 1,
}


INTRA_NODE_SPEEDUP = 2.0
"""How much faster a group inside one node moves bytes than one crossing nodes, by default: a
floor (NVLink or PCIe inside a node against the network between nodes is often 5-20x)."""


@dataclass(frozen=True)
class Fabric:
    """Where the ranks sit: `ranks_per_node` consecutive ranks per node, and how much faster
    a group inside one node moves bytes than one crossing nodes."""

    ranks_per_node: int
    intra_node_speedup: float = INTRA_NODE_SPEEDUP

    def crosses(self, shape: tuple[int, int], group: str) -> bool:
        """Whether the `group` ("shard" or "replicate") of a (replicate, shard) mesh laid out
        row-major crosses nodes: the shard group's S consecutive ranks when S > ranks per
        node; a replicate group (ranks S apart) when it has two or more and R x S > ranks per
        node."""
        r, s = shape
        if group == "shard":
            return s > self.ranks_per_node
        return r > 1 and r * s > self.ranks_per_node

    def link(self, before: bool, after: bool) -> float:
        """The factor on a collective's bytes time when its group goes from crossing nodes
        (`before`) to `after`."""
        return link_factor(before, after, self.intra_node_speedup)


def link_factor(before: bool, after: bool, speedup: float) -> float:
    """The factor on a collective's bytes time when its group goes from crossing nodes
    (`before`) to `after`, a group inside one node moving bytes `speedup` times as fast."""
    if before == after:
        return 1.0
    return 1 / speedup if before else speedup


class MeshShapeError(ValueError):
    """The run cannot be replayed on another mesh shape (the message says why)."""


@dataclass(frozen=True)
class DpGroups:
    """One rank's data-parallel groups: the shard group (its process-group name and size) and
    the replicate group (None and 1 when the run shards over all its data-parallel ranks)."""

    shard_group: str
    shard: int
    replicate_group: str | None
    replicate: int

    @property
    def shape(self) -> tuple[int, int]:
        """(replicate, shard)."""
        return (self.replicate, self.shard)


def _group(lane: str) -> str:
    return lane.rsplit("|", 1)[0]


def dp_groups(
    models: Sequence[StepModel],
    sizes: Mapping[str, int],
    *,
    world: int | None = None,
    mesh: MeshFacts | None = None,
) -> DpGroups:
    """The data-parallel groups of one rank's steps (see the module docstring); `sizes` maps
    the rank's process-group names to their sizes. MeshShapeError when they cannot be told."""
    ops = [op for m in models for op in m.ops]
    gathers = {_group(op.lane) for op in ops if op.family == GATHER_FAMILY}
    if not gathers and any(op.family == REDUCE_FAMILY for op in ops):
        raise MeshShapeError(
            "the run keeps a whole copy of the model on each rank (FSDP reduces but no "
            "all-gather: shard groups of one rank), so its traces show no gather to re-time for "
            "another shape; replay a run that shards"
        )
    if not gathers:
        raise MeshShapeError(
            "the shard and replicate groups are those of the FSDP all-gathers and reduces, and "
            "the traces hold none (FSDP and HSDP runs only)"
        )
    if len(gathers) > 1:
        raise MeshShapeError(
            "the FSDP all-gathers run on several process groups "
            f"({', '.join(sorted(gathers))}): modules sharded over different meshes have no one "
            "mesh shape to change"
        )
    shard_group = gathers.pop()
    replicas = {_group(op.lane) for op in ops if op.family == REDUCE_FAMILY} - {shard_group}
    if len(replicas) > 1:
        raise MeshShapeError(
            f"the FSDP reduces run on several replicate groups ({', '.join(sorted(replicas))})"
        )
    replicate_group = replicas.pop() if replicas else None
    by_role = {d.role: d.size for d in mesh.dims} if mesh is not None else {}
    shard = sizes.get(shard_group) or by_role.get("shard")
    if shard is None and replicate_group is None:
        shard = world
    replicate = 1
    if replicate_group is not None:
        replicate = sizes.get(replicate_group) or by_role.get("replicate") or 0
    if not shard or not replicate:
        raise MeshShapeError(
            "the traces do not say how many ranks the FSDP groups hold (no process-group table "
            "in their headers and no captured mesh); record the run with torch 2.2 or later, "
            "or with 'zdiag run'"
        )
    return DpGroups(shard_group, shard, replicate_group, replicate)


def check_shape(groups: DpGroups, shape: tuple[int, int]) -> None:
    """MeshShapeError unless `shape` (replicate, shard) splits the run's data-parallel ranks."""
    r, s = shape
    n = groups.replicate * groups.shard
    if r < 1 or s < 1 or r * s != n:
        raise MeshShapeError(
            f"the run's FSDP spans {n} ranks ({groups.replicate} x {groups.shard}, replicate x "
            f"shard), so a mesh shape R,S needs R x S = {n} (got {r},{s})"
        )
    if (r, s) == groups.shape:
        raise MeshShapeError(f"the run is already {r} x {s} (replicate x shard)")
    if groups.shard < 2:
        raise MeshShapeError(
            "the run's shard groups hold one rank, so its gathers show nothing of the links "
            "another shape would use"
        )


def _ring(p0: int, p: int) -> tuple[float, float]:
    """The latency and bytes factors of a ring collective going from p0 to p ranks (p0 >= 2)."""
    return (p - 1) / (p0 - 1), ((p - 1) / p) / ((p0 - 1) / p0)


def _rescaled(
    op: ModelOp, fits: Mapping[str, CommFit], p0: int, p: int, share: float, link: float = 1.0
) -> ModelOp:
    """`op` on a group of p ranks instead of p0, carrying `share` times its bytes, its bytes
    moving `link` times as slowly."""
    a = latency_part(op, fits)
    ra, rb = _ring(p0, p)
    nbytes = int(op.bytes * share) if op.bytes > 0 else op.bytes
    dur = a * ra + (op.dur_us - a) * rb * share * link
    return msgspec.structs.replace(op, dur_us=dur, bytes=nbytes)


def _replicate_reduce(
    rs: ModelOp,
    fits: Mapping[str, CommFit],
    groups: DpGroups,
    shape: tuple[int, int],
    delay_us: float,
    link: float = 1.0,
) -> ModelOp:
    """The replicate all-reduce a flat run's reduce-scatter `rs` gains (module docstring), its
    bytes moving `link` times as slowly as the reduce-scatter's."""
    r, s = shape
    s0 = groups.shard
    c = 2 if rs.kind == "all_reduce" else 1  # gloo reduces a gradient by an all-reduce
    a = latency_part(rs, fits)
    link_alpha = a / (c * (s0 - 1))
    link_bytes_us = (rs.dur_us - a) / (c * (s0 - 1) / s0)  # the whole message at link rate
    dur = 2 * (r - 1) * link_alpha + 2 * (r - 1) / r * link_bytes_us / s * link
    return ModelOp(
        kind="all_reduce",
        lane=rs.lane,
        issue_pos_us=rs.issue_pos_us,
        after=-1,
        delay_us=delay_us,
        dur_us=dur,
        wait_pos_us=rs.wait_pos_us,
        bytes=rs.bytes // s if rs.bytes > 0 else -1,
        unit=rs.unit,
        family=REDUCE_FAMILY,
        phase=rs.phase,
        start_us=rs.start_us + rs.dur_us,
    )


def reshaped(
    model: StepModel,
    groups: DpGroups,
    shape: tuple[int, int],
    fits: Mapping[str, CommFit],
    fabric: Fabric | None = None,
) -> StepModel:
    """The step on the mesh shape (replicate, shard) = `shape` (see the module docstring);
    `fabric`: the run's nodes (None: one link speed for every group)."""
    r, s = shape

    def link(before: str, after: str) -> float:
        if fabric is None:
            return 1.0
        return fabric.link(fabric.crosses(groups.shape, before), fabric.crosses(shape, after))

    ops = _Ops()
    floor = min((op.delay_us for op in model.ops if op.family), default=0.0)
    for op in model.ops:
        group = _group(op.lane)
        in_shard = bool(op.family) and group == groups.shard_group
        if in_shard and groups.replicate == 1 and r > 1 and op.family == REDUCE_FAMILY:
            # a flat run's reduce-scatter gains the replicate all-reduce after it
            queued = op.after >= 0
            if s > 1:
                ops.add(_rescaled(op, fits, groups.shard, s, 1.0, link("shard", "shard")))
                queued = True
            ar = _replicate_reduce(op, fits, groups, shape, floor, link("shard", "replicate"))
            ops.add(ar, queued=queued)
            continue
        if in_shard:
            if s == 1:
                continue  # FSDP issues no collective on a group of one rank
            ops.add(_rescaled(op, fits, groups.shard, s, 1.0, link("shard", "shard")))
        elif op.family == REDUCE_FAMILY and group == groups.replicate_group:
            if r > 1:
                share = groups.shard / s
                ops.add(
                    _rescaled(op, fits, groups.replicate, r, share, link("replicate", "replicate"))
                )
        else:
            ops.add(op)
    changed = msgspec.structs.replace(model, ops=ops.ops)
    factor = groups.shard / s
    if factor > 1:
        changed = cf.expanded(changed, [(p + n, n * (factor - 1)) for p, n in model.optimizer])
    elif factor < 1:
        changed = cf.compressed(
            changed, [(p + n * factor, n * (1 - factor)) for p, n in model.optimizer]
        )
    return msgspec.structs.replace(
        changed, optimizer=[(p, n * factor) for p, n in changed.optimizer]
    )


def all_reduced_once(model: StepModel, groups: DpGroups) -> tuple[StepModel, int]:
    """The step with each unit's replicate all-reduces kept in its last micro-batch only (HSDP
    with gradient accumulation: `set_requires_all_reduce(False)` before the last; the
    reduce-scatters still run each time and their shards accumulate), and how many went."""
    last: dict[str, int] = {}
    for j, op in enumerate(model.ops):
        if op.family == REDUCE_FAMILY and _group(op.lane) == groups.replicate_group:
            k = last.get(op.unit)
            if k is None or op.issue_pos_us >= model.ops[k].issue_pos_us:
                last[op.unit] = j
    ops = _Ops()
    for j, op in enumerate(model.ops):
        replicate = op.family == REDUCE_FAMILY and _group(op.lane) == groups.replicate_group
        if not replicate or last.get(op.unit) == j:
            ops.add(op)
    return msgspec.structs.replace(model, ops=ops.ops), len(model.ops) - len(ops.ops)


class _Ops:
    """A step's ops being rebuilt: an op that queued on its lane (`after` >= 0) queues behind
    the latest op kept on that lane (the replay reads only whether it queued; the index keeps
    the model readable)."""

    def __init__(self) -> None:
        self.ops: list[ModelOp] = []
        self._last: dict[str, int] = {}

    def add(self, op: ModelOp, *, queued: bool | None = None) -> None:
        """Append `op` (`queued`: whether it queues on its lane; None: as it did)."""
        behind = (
            self._last.get(op.lane, -1) if (op.after >= 0 if queued is None else queued) else -1
        )
        self._last[op.lane] = len(self.ops)
        self.ops.append(msgspec.structs.replace(op, after=behind))


def optimizer_states(classes: Sequence[str]) -> tuple[int, str]:
    """States per parameter of the run's optimizers (0 when unknown), and what was assumed."""
    if not classes:
        return 0, "the optimizer is unknown, its states not counted"
    known = [_STATES.get(c) for c in classes]
    if any(k is None for k in known):
        odd = ", ".join(c for c, k in zip(classes, known, strict=True) if k is None)
        return 0, f"{odd}'s states not counted (SGD's momentum would be one more copy)"
    states = max(k for k in known if k is not None)
    return states, f"{', '.join(classes)}'s {states} state(s)"


def mesh_memory_delta(
    param_bytes: int | None,
    groups: DpGroups,
    shape: tuple[int, int],
    classes: Sequence[str],
    *,
    gathered: bool = False,
) -> tuple[int | None, str]:
    """The peak-memory change per rank of `shape`: the sharded parameters, gradients and
    optimizer states grow by S0 / S (`param_bytes`: the model's parameters, unsharded; summed
    from the FSDP gathers' messages when `gathered`, so in the gathered dtype)."""
    if not param_bytes:
        return None, "unknown: the run's parameter bytes are not known (no captured model)"
    states, said = optimizer_states(classes)
    copies = 2 + states
    delta = param_bytes * copies * (1 / shape[1] - 1 / groups.shard)
    what = "parameters, gradients and optimizer states" if states else "parameters and gradients"
    return int(delta), (
        f"{what} ({copies} copies of "
        f"{param_bytes / 2**20:.1f} MiB) sharded over {shape[1]} ranks instead of "
        f"{groups.shard}; {said}"
        + ("; the parameters' bytes summed from the FSDP gathers (their dtype)" if gathered else "")
    )
