"""The mesh dimensions a run communicates over, with their roles (`Report.comm_dimensions`).

The map splits each multi-group rank's communication by dimension label
(`rank/comm_dimensions.py`, `StepBreakdown.comm_by_dimension`); the reduce names each label's
role, from the first source that tells:

- the captured mesh (`inputs/mesh_facts.py`): a dimension FSDP shards over is "dp-shard", one it
  replicates over "dp-replicate", a tensor-parallel one "tp";
- the dimension's name: "tp"/"tensor..." -> "tp", "cp"/"context..." -> "cp", "ep"/"expert..." ->
  "ep", "pp"/"pipe..." -> "pp", a name holding "shard" -> "dp-shard", "replicate" ->
  "dp-replicate", "dp"/"fsdp"/"data..." -> "dp";
- its collective kinds: only point-to-point -> "pp", all-gathers with reduce-scatters ->
  "dp-shard";

else "other". Also each dimension's group size (the most common over its ranks, from the trace
headers' `pg_config`), its collective kinds, its ranks and its mean per-step communication.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np
from msgspec import UNSET, UnsetType

from ..inputs.mesh_facts import MeshFacts
from ..rank.comm_dimensions import OTHER, dimension_label, dimension_labels
from ..rank.summary import RankSummary
from ..report import CommDimension

MESH_ROLES = {"shard": "dp-shard", "replicate": "dp-replicate", "tp": "tp"}
_NAME_ROLES = (
    (re.compile(r"^(tp|tensor.*)$"), "tp"),
    (re.compile(r"^(cp|context.*)$"), "cp"),
    (re.compile(r"^(ep|expert.*)$"), "ep"),
    (re.compile(r"^(pp|pipe.*)$"), "pp"),
    (re.compile(r"shard"), "dp-shard"),
    (re.compile(r"replicate"), "dp-replicate"),
    (re.compile(r"^(dp|fsdp|data.*)$"), "dp"),
)


def dimension_role(name: str, kinds: Sequence[str], mesh: MeshFacts | None) -> tuple[str, str]:
    """(role, source) of a dimension label (module docstring)."""
    dim = mesh.dim(name) if mesh is not None else None
    if dim is not None and dim.role in MESH_ROLES:
        return MESH_ROLES[dim.role], "mesh"
    if name != OTHER:
        for rx, role in _NAME_ROLES:
            if rx.search(name.lower()):
                return role, "name"
    kind_set = set(kinds)
    if kind_set and kind_set <= {"send_recv"}:
        return "pp", "kinds"
    if {"all_gather", "reduce_scatter"} <= kind_set:
        return "dp-shard", "kinds"
    return "other", ""


def comm_dimensions(
    summaries: Sequence[RankSummary], mesh: MeshFacts | None = None
) -> list[CommDimension] | UnsetType:
    """The run's communication dimensions, in first-seen order; UNSET when no rank's steps are
    split by dimension (single-group runs)."""
    per_step: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(dict)
    for s in summaries:
        for step in s.steps:
            if isinstance(step.comm_by_dimension, UnsetType):
                continue
            for d in step.comm_by_dimension:
                per_step[d.dimension].setdefault(s.rank, []).append((d.comm_ms, d.exposed_comm_ms))
    if not per_step:
        return UNSET
    kinds, sizes = _kinds_and_sizes(summaries)
    out = []
    for name, by_rank in per_step.items():
        means = np.array([np.mean(v, axis=0) for v in by_rank.values()])
        dim_kinds = sorted(kinds.get(name, ()))
        role, source = dimension_role(name, dim_kinds, mesh)
        size = sizes[name].most_common(1)[0][0] if sizes.get(name) else None
        out.append(
            CommDimension(
                name=name,
                role=role,
                role_source=source,
                group_size=size,
                kinds=dim_kinds,
                ranks=sorted(by_rank),
                comm_ms_per_step=round(float(means[:, 0].mean()), 6),
                exposed_comm_ms_per_step=round(float(means[:, 1].mean()), 6),
            )
        )
    return out


def _kinds_and_sizes(
    summaries: Sequence[RankSummary],
) -> tuple[dict[str, set[str]], dict[str, Counter[int]]]:
    """Per dimension label, the collective kinds its calls carried (all ranks) and the sizes of
    its groups (one count per rank declaring one)."""
    kinds: dict[str, set[str]] = defaultdict(set)
    sizes: dict[str, Counter[int]] = defaultdict(Counter)
    for s in summaries:
        infos = s.facts.process_groups
        cols = s.collectives.columns(s.rank)
        labels = dimension_labels(infos, cols.groups)
        pairs = set(zip(cols.group.tolist(), cols.kind.tolist(), strict=True))
        for g, k in pairs:
            kinds[labels[g]].add(cols.kinds[k])
        for info in infos:
            size = len(info.ranks) if info.ranks is not None else info.size
            if size:
                sizes[dimension_label(info)][size] += 1
    return kinds, sizes
