"""What detectors may take as known about the model: from the run's model description, or inferred.

A run recorded by `zdiag run` / `zdiag.profile` holds `model/rank-<N>.json` (schema `zdiag.model/1`,
captured from the live model: see collectors/model_capture.py). `facts_from_run_dir` loads it.
Traces recorded elsewhere have none: `inferred_facts` builds what the trace labels give (FSDP2's
`FSDP::pre_forward (<fqn>)` unit names, bytes from the collectives when the caller has them), and
every answer then carries `inferred=True` so a report can say which facts were inferred.

## The block to wrap: the granularity rule

`ModelFacts.block_candidates()` ranks the model's repeated block classes; the first is the unit a
recommendation should wrap (`for stage in model.encoder.stages: fully_shard(stage)`, FSDP1
`ModuleWrapPolicy({ResidualMLP})`). From the description's repeated sets (containers with at least
two direct children of one class), per block class over all its containers:

1. Never a leaf layer: a child with no submodules that is a torch.nn built-in (`Linear`, `Conv2d`,
   `Embedding`, `LayerNorm`, ...) or whose class name says it is one (`*Linear*`, `*Conv*`,
   `*Embedding*`, `*Norm*`). A user's own leaf block with raw parameters (an expert holding
   `w1`, `w2`) stays a candidate.
2. Never a generic container (`Sequential`, `ModuleList`, `ModuleDict`): those group blocks, they
   are not one. Blocks without parameters are dropped.
3. `coverage` = the bytes in all blocks of that class / the model's parameter bytes;
   `block_share` = the largest block's bytes / the model's.
4. Blocks with `block_share < MIN_BLOCK_SHARE` are *too fine* (each unit would gather a sliver, and
   launch and hook overheads dominate): they rank after every other candidate.
5. Among the rest, the classes whose coverage is within `COVERAGE_TIE` of the best coverage tie;
   the tie goes to the class with the most blocks (the finest granularity that still covers the
   model: 12 `ConvUnit` inside 4 `Stage` rather than the 4 stages). The others follow by coverage.

With an inferred description the block classes are unknown: candidates are the containers whose
children are FSDP2 units, ranked by the same rule with bytes from the collectives when known, else
by count (rule 1 cannot be checked).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from zdiag.errors import InputError

from ...collectors.model_schema import (
    MODEL_SCHEMA,
    DdpConfig,
    DeepSpeedConfig,
    Fsdp1Instance,
    Fsdp2Unit,
    ModelDescription,
    RepeatedSet,
)
from ...collectors.rundir import model_description_relpath
from ..frameworks.fsdp1 import unit_name as fsdp1_unit_name
from .mesh_facts import MeshFacts, mesh_facts
from .pipeline_facts import PipelineFacts, pipeline_facts
from .reader import Reader
from .run_dir import read_run_json

MIN_BLOCK_SHARE = 0.002  # a block under 0.2 % of the model's parameter bytes is too fine
COVERAGE_TIE = 0.10  # coverages this close to the best count as a tie (finest class wins)

GENERIC_CONTAINERS = frozenset({"Sequential", "ModuleList", "ModuleDict", "ParameterList"})
_LEAF_NAME_RE = re.compile(r"Linear|Conv|Embedding|Norm", re.IGNORECASE)
_FSDP2_LABEL_RE = re.compile(r"^FSDP::[a-z_]+(?: \((?P<fqn>[^)]*)\))?$")


@dataclass(frozen=True)
class BlockCandidate:
    """A repeated block class, with every container that holds it."""

    child_class: str  # "" when inferred (the class is unknown)
    child_module: str
    containers: tuple[str, ...]  # container paths ("" = the model itself)
    count: int  # blocks over all containers
    bytes_per_block_max: int | None
    total_bytes: int | None
    coverage: float | None  # total_bytes / model bytes (None: bytes unknown)
    block_share: float | None  # bytes_per_block_max / model bytes
    too_fine: bool


@dataclass(frozen=True)
class ModelFacts:
    """The model description and the questions detectors ask of it."""

    description: ModelDescription
    source: str = ""  # the file read, or "trace labels"
    notes: tuple[str, ...] = field(default=())

    @property
    def inferred(self) -> bool:
        """True when the facts come from trace labels, not from the live model."""
        return self.description.inferred

    @property
    def framework(self) -> str:
        """fsdp2, fsdp1, deepspeed, ddp or none."""
        return self.description.framework

    @property
    def fsdp2_units(self) -> tuple[Fsdp2Unit, ...]:
        """FSDP2 units with their bytes and settings."""
        return self.description.fsdp2_units

    @property
    def fsdp1_instances(self) -> tuple[Fsdp1Instance, ...]:
        """FSDP1 instances with their flat-parameter bytes and settings."""
        return self.description.fsdp1

    @property
    def deepspeed(self) -> DeepSpeedConfig | None:
        """The DeepSpeed engine's ZeRO settings, when the run used one."""
        return self.description.deepspeed

    @property
    def ddp(self) -> DdpConfig | None:
        """The DDP wrapper's settings, when the run used one."""
        return self.description.ddp

    @property
    def mesh(self) -> MeshFacts | None:
        """The device mesh (dimensions, roles, every rank's groups, the TP plan); None when the
        description has none (no DeviceMesh, or a description written before `zdiag.model/1.1`)."""
        d = self.description
        return mesh_facts(d.mesh, d.dtensor_modules, d.process_groups, rank=d.rank)

    @property
    def pipeline(self) -> PipelineFacts | None:
        """The pipeline stages and schedule, every stage's ranks; None when the description
        has no pipeline stage (none built, or a description written before `zdiag.model/1.2`)."""
        return pipeline_facts(self.description.pipeline, self.mesh)

    @property
    def optimizer_classes(self) -> tuple[str, ...]:
        """Optimizer class names in the order they were seen (the driver first)."""
        return tuple(o.cls for o in self.description.optimizers)

    @property
    def unit_bytes(self) -> dict[str, int | None]:
        """Unsharded bytes per FSDP unit path (FSDP2 units, else FSDP1 instances)."""
        if self.description.fsdp2_units:
            return {u.path: u.unsharded_bytes for u in self.description.fsdp2_units}
        return {i.path: i.flat_param_bytes for i in self.description.fsdp1}

    def trace_unit_paths(self) -> dict[str, str]:
        """{unit name in a trace's FSDP ledger: the unit's module path}. FSDP2 units are named by
        their path already; FSDP1 labels name no module, so the ledger names the k-th forward
        gather of a step `fsdp1-unit-<k>`: the k-th instance, in module pre-order, that holds
        parameters (FSDP1's forward unshards the root first, then each wrapped module as the
        forward reaches it, which is pre-order for a model run front to back)."""
        if self.description.fsdp2_units:
            return {u.path: u.path for u in self.description.fsdp2_units}
        holding = [i for i in self.description.fsdp1 if i.flat_param_bytes > 0]
        return {fsdp1_unit_name(k): i.path for k, i in enumerate(holding)}

    def trace_unit_bytes(self) -> dict[str, int]:
        """{unit name in a trace's FSDP ledger: unsharded parameter bytes}, for the collectives
        a trace recorded without shapes; units whose bytes are unknown are left out."""
        sizes = self.unit_bytes
        return {
            name: b
            for name, path in self.trace_unit_paths().items()
            if (b := sizes.get(path)) is not None and b > 0
        }

    def summary(self) -> dict[str, object]:
        """What the Report says about these facts: where they come from, which were captured
        from the live model and which were inferred (or unknown)."""
        d = self.description
        known = {
            "framework": d.framework != "none" or not d.inferred,
            "module tree": bool(d.modules),
            "repeated blocks": bool(d.repeated),
            "unit bytes": any(b is not None for b in self.unit_bytes.values()),
            "framework settings": bool(
                d.fsdp1 or d.deepspeed or d.ddp or (d.fsdp2_units and not d.inferred)
            ),
            "optimizer": bool(d.optimizers),
        }
        facts = [k for k, v in known.items() if v]
        return {
            "source": "inferred from trace labels" if d.inferred else "captured from the model",
            "file": self.source,
            "framework": d.framework,
            "model_class": d.model_class or None,
            "captured": [] if d.inferred else facts,
            "inferred": facts if d.inferred else [],
            "unknown": [k for k, v in known.items() if not v],
        }

    def definition_key(self, path: str) -> tuple[int, ...] | None:
        """A sort key putting module paths in definition order (the order a forward taken
        front to back runs them), None when the description does not place `path`. The
        description collapses same-class siblings past the first few (`body.mixers.2` is left
        out when `body.mixers.0` is kept), so an index counts by its number and a named child
        by where its first indexed sibling's subtree (each index read as 0) lists it."""
        order = {m.path: k for k, m in enumerate(self.description.modules)}
        key: list[int] = []
        template: list[str] = []
        for part in path.split(".") if path else ():
            if part.isdigit():
                key.append(int(part))
                template.append("0")
                continue
            template.append(part)
            where = order.get(".".join(template))
            if where is None:
                return None
            key.append(where)
        return tuple(key)

    def block_candidates(self) -> list[BlockCandidate]:
        """Repeated block classes, best first, by the granularity rule in the module docstring."""
        return rank_blocks(self.description)

    def best_block(self) -> BlockCandidate | None:
        """The block class a wrap recommendation should name, or None when there is none."""
        ranked = self.block_candidates()
        return ranked[0] if ranked else None


# ------------------------------------------------------------------------- loading
def load_description(run_dir: str | Path, rel: str) -> ModelDescription:
    """Read the run-dir file `rel` (a `model/rank-<N>.json`) through the run-dir contract's reader
    (confined to the run directory, size-capped); InputError when it is not a description."""
    data = read_run_json(run_dir, rel)
    try:
        return ModelDescription.from_json(data)
    except ValueError as exc:
        raise InputError(
            f"{Path(run_dir) / rel} is not a zdiag model description ({exc}); "
            "re-record the run or remove the file."
        ) from None


def facts_from_run_dir(run_dir: str | Path, rank: int | None = None) -> ModelFacts | None:
    """The captured facts of `rank` (default: the lowest rank that wrote one), None when absent."""
    root = Path(run_dir)
    if rank is None:
        folder = (root / model_description_relpath(0)).parent
        ranks = []
        for p in folder.glob("rank-*.json") if folder.is_dir() else ():
            suffix = p.stem.removeprefix("rank-")
            if suffix.isdigit():
                ranks.append(int(suffix))
        if not ranks:
            return None
        rank = min(ranks)
    rel = model_description_relpath(rank)
    if not (root / rel).exists():
        return None
    return ModelFacts(load_description(root, rel), source=str(root / rel))


def inferred_facts(
    labels: Iterable[str],
    *,
    unit_fqns: Iterable[str] = (),
    unit_bytes: Mapping[str, int] | None = None,
    framework: str = "fsdp2",
) -> ModelFacts:
    """Facts inferred from trace labels: FSDP2 unit names (`FSDP::pre_forward (<fqn>)`, the root
    unit as `FSDP::pre_forward`; other labels are ignored) plus `unit_fqns` a caller already has
    (the FSDP ledger's units); `unit_bytes` (unit fqn -> unsharded bytes, e.g. from the gathered
    collectives) fills in bytes where known, the rest stay None (unknown)."""
    fqns: dict[str, None] = {}
    for label in labels:
        m = _FSDP2_LABEL_RE.match(label)
        if m is not None:
            fqns[m.group("fqn") or ""] = None
    for fqn in unit_fqns:
        fqns[fqn] = None
    sizes = dict(unit_bytes or {})
    units = tuple(Fsdp2Unit(path=fqn, cls="", unsharded_bytes=sizes.get(fqn)) for fqn in fqns)
    groups: dict[str, list[str]] = {}
    for fqn in fqns:
        if fqn:
            parent, _, name = fqn.rpartition(".")
            groups.setdefault(parent, []).append(name)
    repeated = []
    for parent, names in groups.items():
        if len(names) < 2:
            continue
        known = [sizes.get(f"{parent}.{n}" if parent else n) for n in names]
        full = [b for b in known if b is not None]
        all_known = len(full) == len(known)
        repeated.append(
            RepeatedSet(
                path=parent,
                child_class="",
                count=len(names),
                child_names=tuple(names[:8]),
                bytes_per_child_min=min(full) if all_known else None,
                bytes_per_child_max=max(full) if all_known else None,
                total_bytes=sum(full) if all_known else None,
                depth=parent.count(".") + (2 if parent else 1),
            )
        )
    total = sum(sizes.get(f, 0) for f in fqns) if fqns and all(f in sizes for f in fqns) else 0
    description = ModelDescription(
        framework=framework if fqns else "none",
        param_bytes=total,
        fsdp2_units=units if framework == "fsdp2" else (),
        fsdp2_units_total=len(units) if framework == "fsdp2" else 0,
        repeated=tuple(repeated),
        notes=("inferred from trace labels: block classes and settings are unknown",),
        inferred=True,
    )
    return ModelFacts(description, source="trace labels")


# ------------------------------------------------------------------------- the rule
def is_leaf_layer(rep: RepeatedSet) -> bool:
    """Rule 1: the children are leaf layers (a torch.nn built-in, or named like one)."""
    if rep.child_modules != 1:
        return False
    builtin = rep.child_module.startswith("torch.nn.modules")
    return builtin or bool(_LEAF_NAME_RE.search(rep.child_class))


def rank_blocks(desc: ModelDescription) -> list[BlockCandidate]:
    """Rank the repeated block classes of `desc` (see the module docstring for the rule)."""
    by_class: dict[tuple[str, str], list[RepeatedSet]] = {}
    for rep in desc.repeated:
        if desc.inferred:
            key = ("", rep.path)  # classes unknown: one candidate per container
        else:
            if is_leaf_layer(rep) or rep.child_class in GENERIC_CONTAINERS:
                continue
            if not rep.bytes_per_child_max:
                continue
            key = (rep.child_module, rep.child_class)
        by_class.setdefault(key, []).append(rep)
    model_bytes = desc.param_bytes or 0
    cands = []
    for (module, cls), reps in by_class.items():
        sizes = [r.total_bytes for r in reps]
        per_block = [r.bytes_per_child_max for r in reps]
        total = sum(s for s in sizes if s is not None) if None not in sizes else None
        biggest = max(b for b in per_block if b is not None) if None not in per_block else None
        coverage = total / model_bytes if total is not None and model_bytes > 0 else None
        share = biggest / model_bytes if biggest is not None and model_bytes > 0 else None
        cands.append(
            BlockCandidate(
                child_class=cls if not desc.inferred else "",
                child_module=module if not desc.inferred else "",
                containers=tuple(r.path for r in reps),
                count=sum(r.count for r in reps),
                bytes_per_block_max=biggest,
                total_bytes=total,
                coverage=coverage,
                block_share=share,
                too_fine=share is not None and share < MIN_BLOCK_SHARE,
            )
        )
    return _order(cands)


def _order(cands: list[BlockCandidate]) -> list[BlockCandidate]:
    fine = [c for c in cands if not c.too_fine]
    coarse_order = sorted(fine, key=lambda c: (-(c.coverage or 0.0), -c.count, c.containers))
    if coarse_order and all(c.coverage is not None for c in coarse_order):
        best = coarse_order[0].coverage or 0.0
        tied = [c for c in coarse_order if (c.coverage or 0.0) >= best - COVERAGE_TIE]
        winner = max(tied, key=lambda c: (c.count, c.coverage or 0.0))
        coarse_order.remove(winner)
        coarse_order.insert(0, winner)
    elif coarse_order:  # bytes unknown (inferred): the container with the most units
        coarse_order.sort(key=lambda c: (-c.count, c.containers))
    too_fine = sorted(
        (c for c in cands if c.too_fine), key=lambda c: (-(c.coverage or 0.0), c.containers)
    )
    return coarse_order + too_fine


def python_path(module_path: str, root: str = "model") -> str:
    """`encoder.stages` -> `model.encoder.stages`; `layers.0` -> `model.layers[0]`."""
    out = root
    for part in module_path.split(".") if module_path else ():
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out


_DESCRIPTION_NAME = re.compile(r"rank-\d+\.json")


def _is_description(path: str | Path, head: bytes) -> bool:
    """A run directory's `model/rank-<N>.json` whose first bytes name the schema."""
    p = Path(path)
    return (
        p.parent.name == "model"
        and _DESCRIPTION_NAME.fullmatch(p.name) is not None
        and MODEL_SCHEMA.encode() in head
    )


READER = Reader(
    name="model-description",
    kind="model-description",
    what=f"model description ({MODEL_SCHEMA}, a run directory's model/rank-<N>.json)",
    sniff=_is_description,
    read=load_description,
)
