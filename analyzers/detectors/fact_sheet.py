"""One fact sheet per run: what every detector knows about the run besides its measurements.

Built once, with the detectors' context (`DetectorContext.sheet`), from the run's values: the
framework (the captured model description's, else the first FSDP/ZeRO ledger's, the manifest's,
a trace's labels; FSDP2 when nothing says), the captured description (None when the detectors
infer the configuration from trace labels), the settings the run has in each framework's option
names, the repeated blocks the description names, the device (CPU-only or not), whether
parameter gathers can overlap compute there, nodes, world size, hosts, the harness's options and
the device mesh (its dimensions, their roles and every rank's group along each).
Detectors read it; none re-derives these facts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import frameworks
from ..frameworks import BlockSet, Framework, RunFacts
from ..inputs.mesh_facts import MeshFacts
from ..inputs.model_facts import ModelFacts
from ..rank.fsdp_ledger import RankLedger
from ..report import StepBreakdown
from .facts import model_block_set, model_blocks_are_units, model_fsdp_mesh, model_settings

if TYPE_CHECKING:
    from ...collectors.run_records import Manifest
    from ..rank.rank_analysis import RankFacts


@dataclass(frozen=True)
class RunFactSheet:
    """The run's facts, derived once (module docstring).

    - `framework`: the framework remedies speak (never None: FSDP2 when nothing says).
    - `known_framework`: the framework when something says it (description, manifest, a
      trace's labels); None when unknown.
    - `model`: the model description captured from the live model; None when absent or
      inferred (`inferred` is then True: the detectors read trace labels instead).
    - `settings`: framework name -> the settings the run has, in that framework's option names
      (the manifest's, then the description's over them).
    - `model_blocks` / `model_blocks_are_units`: the blocks to wrap the description names, and
      whether each already is a unit (None: not known).
    - `first_unit`: the first FSDP2 unit after the root the trace gathers (None without one).
    - `nnodes` / `world_size`: from the manifest, else the traces (None when unknown).
    - `hosts`: the ranks' host names (the manifest's, else the traces'; None where unknown).
    - `nodes`: the ranks of each node, nodes in order of their lowest rank: by the manifest's
      node ranks (two launchers on one machine share a host name, not a node rank), else by the
      ranks' host names; () when unknown.
    - `cpu_only`: every rank trained on a CPU (False when unknown).
    - `cpu_gathers_overlap`: on a CPU, a gather can run under compute (ZeRO-3's async ops,
      FSDP2's unshard async op, zdiag's harness which sets it).
    - `harness`: zdiag's harness options from the manifest ({} for other scripts).
    - `mesh`: the device mesh the captured description holds (None without one: a model with no
      DeviceMesh, an older description, or no description).
    """

    framework: Framework
    known_framework: Framework | None = None
    model: ModelFacts | None = None
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    model_blocks: BlockSet | None = None
    model_blocks_are_units: bool | None = None
    first_unit: str | None = None
    nnodes: int | None = None
    world_size: int | None = None
    hosts: frozenset[str | None] = frozenset({None})
    nodes: tuple[tuple[int, ...], ...] = ()
    cpu_only: bool = False
    cpu_gathers_overlap: bool = False
    harness: Mapping[str, Any] = field(default_factory=dict)
    mesh: MeshFacts | None = None

    @property
    def inferred(self) -> bool:
        """Whether the configuration is inferred from trace labels (no captured description)."""
        return self.model is None

    def gathers_can_overlap(self, device: str | None = None) -> bool:
        """Whether an FSDP/ZeRO gather can run under compute: on an accelerator (its own
        stream); on a CPU only as `cpu_gathers_overlap` says. `device` is a ledger's device
        ("cpu", "cuda:0"); None: judged from the whole run."""
        if not (device.startswith("cpu") if device else self.cpu_only):
            return True
        return self.cpu_gathers_overlap

    def run_facts(
        self,
        fw: Framework | None = None,
        blocks: BlockSet | None = None,
        are_units: bool | None = None,
    ) -> RunFacts:
        """The RunFacts remedies take, for framework `fw` (default: the run's). The captured
        description's blocks replace the inferred `blocks` / `are_units` when it names some."""
        fw = fw or self.framework
        if self.model_blocks is not None:
            blocks, are_units = self.model_blocks, self.model_blocks_are_units
        return RunFacts(
            framework=fw.name,
            blocks=blocks,
            blocks_are_units=are_units,
            settings=dict(self.settings.get(fw.name, {})),
            first_unit=self.first_unit,
            nnodes=self.nnodes,
            world_size=self.world_size,
            nodes=self.nodes,
            device_type="cpu" if self.cpu_only else "cuda",
            mesh=model_fsdp_mesh(self.model) if self.model is not None else None,
        )


def build_fact_sheet(
    *,
    ledgers: Mapping[int, RankLedger],
    breakdowns: Mapping[int, Sequence[StepBreakdown]],
    facts: Mapping[int, RankFacts],
    manifest: Manifest | None,
    model: ModelFacts | None,
) -> RunFactSheet:
    """The fact sheet of one run's values (what the detectors' context holds)."""
    captured = model if model is not None and not model.inferred else None
    fsdp = [lg for _, lg in sorted(ledgers.items()) if lg.framework and lg.records]
    known = _known_framework(captured, manifest, facts.values())
    name = fsdp[0].framework if fsdp else None
    if name and not (captured is not None and captured.framework in frameworks.BY_NAME):
        framework = frameworks.get(name)
    else:
        framework = known or frameworks.get(None)
    blocks = model_block_set(captured) if captured is not None else None
    cpu = _cpu_only(manifest, breakdowns)
    harness = dict(manifest.harness or {}) if manifest is not None else {}
    return RunFactSheet(
        framework=framework,
        known_framework=known,
        model=captured,
        settings=_settings(manifest, captured),
        model_blocks=blocks,
        model_blocks_are_units=(
            model_blocks_are_units(captured, blocks)
            if captured is not None and blocks is not None
            else None
        ),
        first_unit=(
            next((u for u in fsdp[0].unit_order if u), None)
            if fsdp and fsdp[0].framework == "fsdp2"
            else None
        ),
        nnodes=_nnodes(manifest, facts.values()),
        world_size=_world_size(manifest, facts.values()),
        hosts=_hosts(manifest, facts.values()),
        nodes=_nodes(manifest, facts),
        cpu_only=cpu,
        cpu_gathers_overlap=_cpu_gathers_overlap(known, captured, harness),
        harness=harness,
        mesh=captured.mesh if captured is not None else None,
    )


def _known_framework(
    model: ModelFacts | None, manifest: Manifest | None, facts: Iterable[RankFacts]
) -> Framework | None:
    """The captured description's framework, else the manifest's, else the first a trace's
    labels show; None when nothing says."""
    if model is not None and model.framework in frameworks.BY_NAME:
        return frameworks.get(model.framework)
    found = frameworks.from_manifest(manifest)
    if found is not None:
        return found
    for f in facts:
        if f.framework:
            return frameworks.get(f.framework)
    return None


def _settings(manifest: Manifest | None, model: ModelFacts | None) -> dict[str, Mapping[str, Any]]:
    """Per framework, the settings the manifest records, with the description's over them."""
    from_model = model_settings(model) if model is not None else {}
    out: dict[str, Mapping[str, Any]] = {}
    for fw in frameworks.REGISTRY:
        base = fw.manifest_settings(manifest) if manifest is not None else {}
        out[fw.name] = {**base, **from_model}
    return out


def _cpu_only(manifest: Manifest | None, breakdowns: Mapping[int, Sequence[StepBreakdown]]) -> bool:
    """Whether every rank trained on a CPU: the manifest's devices when it names every rank's,
    else the traces (steps measured and not one device kernel in them). False when unknown."""
    devices = [e.device for e in manifest.ranks] if manifest is not None else []
    if devices and all(d is not None for d in devices):
        return not any(str(d).startswith("cuda") for d in devices)
    steps = [b for bds in breakdowns.values() for b in bds]
    return bool(steps) and not any(b.kernel_count > 0 for b in steps)


def _cpu_gathers_overlap(
    known: Framework | None, model: ModelFacts | None, harness: Mapping[str, Any]
) -> bool:
    """Whether a gather overlaps compute on a CPU: ZeRO-3 issues its all-gathers with
    `async_op=True` (gloo's worker thread runs a prefetched one while the training thread
    computes); FSDP2 when its unshard async op is set (captured in the description; zdiag's
    harness sets it)."""
    if known is not None and known.name == "deepspeed":
        return True
    if model is not None:
        return any(u.unshard_async_op for u in model.fsdp2_units)
    return bool(harness)


def _world_size(manifest: Manifest | None, facts: Iterable[RankFacts]) -> int | None:
    """World size from the manifest or the traces."""
    if manifest is not None:
        return manifest.world_size
    return next((f.world_size for f in facts if f.world_size), None)


def _nnodes(manifest: Manifest | None, facts: Iterable[RankFacts]) -> int | None:
    """Number of nodes (manifest `nnodes`, else distinct hosts), None when unknown."""
    if manifest is not None:
        return manifest.nnodes
    hosts = {f.host for f in facts if f.host}
    return len(hosts) if hosts else None


def _nodes(
    manifest: Manifest | None, facts: Mapping[int, RankFacts]
) -> tuple[tuple[int, ...], ...]:
    """The ranks of each node (see `RunFactSheet.nodes`); () when some rank's node is unknown."""
    keys: dict[int, object] = {}
    if manifest is not None and manifest.ranks:
        by_node = all(e.node_rank is not None for e in manifest.ranks)
        keys = {e.rank: e.node_rank if by_node else e.host for e in manifest.ranks}
    else:
        keys = {rank: f.host for rank, f in facts.items()}
    if not keys or None in keys.values():
        return ()
    nodes: dict[object, list[int]] = {}
    for rank in sorted(keys):
        nodes.setdefault(keys[rank], []).append(rank)
    return tuple(tuple(ranks) for ranks in nodes.values())


def _hosts(manifest: Manifest | None, facts: Iterable[RankFacts]) -> frozenset[str | None]:
    """The ranks' host names: the manifest's, else the traces' (None where unknown)."""
    if manifest is not None and manifest.ranks:
        return frozenset(e.host for e in manifest.ranks)
    found = frozenset(f.host for f in facts)
    return found or frozenset({None})
