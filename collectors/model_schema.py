"""The model description a rank records at its first forward (schema `zdiag.model/1`).

Versions within the major schema: `zdiag.model/1` (the first), `zdiag.model/1.1` (adds the device
mesh, the DTensor placements per module and the process groups: `mesh`, `dtensor_modules`,
`process_groups`, and `Fsdp2Unit.mesh_roles`), `zdiag.model/1.2` (adds the pipeline stages and
schedules the script built, `pipeline`, and the mesh role "pp"), `zdiag.model/1.3` (adds what the
first forward saved for backward, by repeated block, `activations`, with `zdiag run
--profile-memory`). Files of any load with any reader.

Standard library only: the collectors write it (`model_capture.py`, which imports torch) and the
analyzers read it (`analyzers/inputs/model_facts.py`, which never imports torch) through these same types.

Bytes are logical: a parameter's full (unsharded) size times its element size, whatever the
sharding (FSDP2 DTensors, FSDP1 flat parameters, DeepSpeed ZeRO-3 `ds_numel`); a shared (tied)
parameter counts once, for the first module that holds it in `named_modules` order. Paths are the
user's own module paths, with wrappers (DDP, DeepSpeed's engine, FSDP1, activation checkpointing,
torch.compile) seen through: `encoder.stages.0`, never `_fsdp_wrapped_module.encoder...`.

`from_json` is tolerant: unknown keys are ignored, missing ones take their defaults, so a reader
loads files written by older and newer writers of the same major schema. A different major schema
raises ValueError.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

MODEL_SCHEMA = "zdiag.model/1"  # the major schema: readers accept it and any `.minor` of it
MODEL_SCHEMA_VERSION = MODEL_SCHEMA + ".3"  # what this writer writes

# Bounds that keep one rank's file small (a few hundred KB at most); what they drop is counted.
MAX_MODULES = 1000  # module tree entries kept
KEEP_REPEATED_CHILDREN = 2  # of N same-class siblings, the first ones keep their subtree
MAX_REPEATED_SETS = 256  # the largest (by bytes) are kept
MAX_FSDP_UNITS = 1024
MAX_PREFETCH_NAMES = 16
MAX_DTENSOR_MODULES = 512
MAX_PROCESS_GROUPS = 64
MAX_PIPELINE_STAGES = 64  # stages recorded per rank (interleaved schedules hold a few each)
MAX_PIPELINE_SCHEDULES = 16

MESH_ROLES = ("shard", "replicate", "tp", "pp", "unused")

FRAMEWORKS = ("fsdp2", "fsdp1", "deepspeed", "ddp", "none")


@dataclass(frozen=True)
class ModuleNode:
    """One module of the tree (pre-order). `own_*` count parameters registered on the module
    itself, `total_*` its whole subtree. `collapsed_children`: same-class children whose subtrees
    were left out (after the first `KEEP_REPEATED_CHILDREN`); they are still counted in totals."""

    path: str  # "" for the model itself
    cls: str  # class name (FSDP2's dynamic FSDP<Class> is reported as <Class>)
    module: str = ""  # the class's Python module
    depth: int = 0
    own_params: int = 0
    own_bytes: int = 0
    total_params: int = 0
    total_bytes: int = 0
    children: int = 0
    collapsed_children: int = 0
    wrappers: tuple[str, ...] = ()  # e.g. ("FullyShardedDataParallel", "CheckpointWrapper")
    fsdp2_unit: bool = False


@dataclass(frozen=True)
class RepeatedSet:
    """A container with at least two direct children of one class (e.g. `encoder.stages` holding 6
    `ResidualMLP`). Computed on the whole tree, before any cap; inside repeated blocks each block's
    own sets are listed (`layers.0.experts`, `layers.1.experts`, ...). Byte fields are None when
    unknown (an inferred description)."""

    path: str  # the container ("" when the model itself holds them)
    child_class: str  # "" when unknown (inferred from trace labels)
    child_module: str = ""
    count: int = 0
    child_names: tuple[str, ...] = ()  # the first few child names (attribute or index)
    child_modules: int | None = None  # modules in one child's subtree, itself included (1: leaf)
    bytes_per_child_min: int | None = None
    bytes_per_child_max: int | None = None
    params_per_child_max: int | None = None
    total_bytes: int | None = None
    container_class: str = ""
    depth: int = 0  # depth of the children


@dataclass(frozen=True)
class BlockActivations:
    """One repeated block's share of what the model's forward saved for backward."""

    path: str  # the block ("transformer.h.3")
    saved_bytes: int  # saved while its forward ran (innermost block), parameters left out
    input_bytes: int  # its forward's tensor inputs: what activation checkpointing keeps


@dataclass(frozen=True)
class ActivationSizes:
    """What one forward of the model saved for backward (`activation_probe.py`), each storage
    once, parameters and their views left out; measured with `zdiag run --profile-memory`."""

    saved_bytes: int = 0
    tensors: int = 0
    outside_blocks_bytes: int = 0  # saved outside every repeated block (embeddings, the head)
    containers: tuple[str, ...] = ()  # the containers whose children are the blocks
    blocks: tuple[BlockActivations, ...] = ()
    blocks_dropped: int = 0  # past MAX_PROBED_BLOCKS


@dataclass(frozen=True)
class Precision:
    """A mixed-precision policy (FSDP2 MixedPrecisionPolicy or FSDP1 MixedPrecision); dtypes as
    torch names ("bfloat16"), None where the policy leaves the original dtype."""

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    output_dtype: str | None = None
    buffer_dtype: str | None = None
    cast_forward_inputs: bool | None = None


@dataclass(frozen=True)
class Fsdp2Unit:
    """One `fully_shard` unit. None means torch did not expose the value (see `missing`)."""

    path: str
    cls: str  # "" when unknown
    param_count: int | None = None  # None: unknown (an inferred description)
    sharded_bytes: int | None = None  # this rank's local shards
    unsharded_bytes: int | None = None
    dtype: str | None = None  # storage dtype of the parameters
    reshard_after_forward: bool | int | None = None  # int: resharded to that group size
    reshard_after_forward_auto: bool | None = None  # the user passed None (torch's default)
    forward_prefetch: tuple[str, ...] | None = None  # set_modules_to_forward_prefetch
    backward_prefetch: tuple[str, ...] | None = None
    mixed_precision: Precision | None = None
    offload_policy: str | None = None
    mesh_shape: tuple[int, ...] = ()  # the unit's own (data-parallel) mesh, not a TP mesh
    mesh_dim_names: tuple[str, ...] = ()
    mesh_roles: tuple[str, ...] = ()  # per dimension: "shard" or "replicate" (HSDP: both)
    hsdp: bool = False
    unshard_async_op: bool | None = None
    missing: tuple[str, ...] = ()  # private torch attributes not found on this torch version


@dataclass(frozen=True)
class MeshDim:
    """One dimension of the device mesh, as the capturing rank sees it."""

    name: str  # "" for an unnamed dimension
    size: int
    role: str = "unused"  # one of MESH_ROLES: what FSDP or the user's DTensors do over it
    group_ranks: tuple[int, ...] = ()  # global ranks of this rank's group along the dimension
    group_name: str | None = None  # c10d's name of that group here (names differ across ranks)


@dataclass(frozen=True)
class DeviceMeshInfo:
    """The run's device mesh (the root of every mesh its FSDP2 units and DTensors use).
    `ranks` is the layout, row-major: with shape (2, 2), ranks (0, 1, 2, 3) put 0 and 1 in one
    row. Every rank's group along a dimension follows from it."""

    shape: tuple[int, ...] = ()
    dim_names: tuple[str, ...] = ()
    device_type: str = ""
    ranks: tuple[int, ...] = ()
    dims: tuple[MeshDim, ...] = ()


@dataclass(frozen=True)
class DTensorParam:
    """One DTensor parameter: its placements, one per dimension of its mesh ("S(0)", "R", ...)."""

    name: str
    placements: tuple[str, ...] = ()


@dataclass(frozen=True)
class DTensorModule:
    """A module whose own parameters the user placed over mesh dimensions FSDP does not use (the
    tensor-parallel plan): `style` is "colwise" or "rowwise" (from the weight's sharded dimension),
    "replicate", or "other"."""

    path: str
    cls: str
    mesh_dims: tuple[str, ...] = ()  # the dimension names of the parameters' mesh
    tp_dims: tuple[str, ...] = ()  # the dimensions the user placed them over
    style: str = ""
    params: tuple[DTensorParam, ...] = ()


@dataclass(frozen=True)
class ProcessGroupInfo:
    """A process group this rank belongs to: c10d's name, its description (`mesh_shard`,
    `default_pg`, ...) and its members (global ranks)."""

    name: str
    desc: str = ""
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class PipelineStageInfo:
    """One `torch.distributed.pipelining` stage this rank built (`PipelineStage`, or the tracing
    frontend's `_PipelineStage`): its index among `num_stages`, its pipeline group (members as
    global ranks, in group-rank order; the stage runs on member `group_rank`), and the submodule
    it runs (class, parameters and logical bytes as the model description counts them)."""

    stage_index: int
    num_stages: int
    group_rank: int = 0
    group_ranks: tuple[int, ...] = ()
    group_name: str | None = None
    submodule_class: str = ""
    param_count: int | None = None
    param_bytes: int | None = None


@dataclass(frozen=True)
class PipelineScheduleInfo:
    """One pipeline schedule this rank built: its class (`ScheduleGPipe`, `Schedule1F1B`,
    `ScheduleInterleaved1F1B`, ...), micro-batches per step and the stages it drives here."""

    cls: str
    module: str = ""
    n_microbatches: int = 0
    stage_indexes: tuple[int, ...] = ()
    num_stages: int = 0
    # the loss function passed to it, "module:qualname" when it is importable by that name
    # (a module-level function: `torch.nn.functional:cross_entropy`), else ""
    loss_fn: str = ""


@dataclass(frozen=True)
class PipelineInfo:
    """The pipeline parallelism of this rank: the stages and schedules it built."""

    stages: tuple[PipelineStageInfo, ...] = ()
    schedules: tuple[PipelineScheduleInfo, ...] = ()


@dataclass(frozen=True)
class Fsdp1Instance:
    """One FullyShardedDataParallel (FSDP1) instance."""

    path: str  # the wrapped module's path
    cls: str  # the wrapped module's class
    root: bool = False
    flat_param_count: int = 0  # unsharded numel, padding excluded
    flat_param_bytes: int = 0  # unsharded
    sharded_bytes: int = 0  # this rank's shard of the flat parameter(s)
    dtype: str | None = None
    sharding_strategy: str | None = None
    forward_prefetch: bool | None = None
    backward_prefetch: str | None = None  # "BACKWARD_PRE" | "BACKWARD_POST" | None
    limit_all_gathers: bool | None = None
    use_orig_params: bool | None = None
    cpu_offload: bool | None = None
    mixed_precision: Precision | None = None
    auto_wrap_policy: str | None = None  # torch does not keep it: None unless visible


@dataclass(frozen=True)
class DeepSpeedConfig:
    """A DeepSpeed engine's ZeRO settings (from the engine's documented accessors)."""

    engine_class: str = ""
    zero_stage: int | None = None
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    prefetch_bucket_size: int | None = None
    param_persistence_threshold: int | None = None
    max_live_parameters: int | None = None
    overlap_comm: bool | None = None
    contiguous_gradients: bool | None = None
    bf16: bool | None = None
    fp16: bool | None = None
    gradient_accumulation_steps: int | None = None
    micro_batch_size: int | None = None


@dataclass(frozen=True)
class DdpConfig:
    """A DistributedDataParallel wrapper's settings."""

    bucket_cap_bytes: int | None = None
    find_unused_parameters: bool | None = None
    gradient_as_bucket_view: bool | None = None
    static_graph: bool | None = None
    broadcast_buffers: bool | None = None
    comm_hook: str | None = None  # the registered communication hook's function name


@dataclass(frozen=True)
class OptimizerInfo:
    """An optimizer seen stepping (or the DeepSpeed engine's optimizer)."""

    cls: str
    module: str = ""
    param_groups: int = 0
    param_count: int = 0
    options: tuple[tuple[str, str], ...] = ()  # foreach, fused, capturable, lr, ... as strings


@dataclass(frozen=True)
class ModelDescription:
    """What one rank knows for sure about its model, framework and optimizer."""

    schema: str = MODEL_SCHEMA_VERSION
    rank: int = 0
    captured_at: str = ""
    torch_version: str = ""
    model_class: str = ""
    model_module: str = ""
    framework: str = "none"  # one of FRAMEWORKS: the outermost sharding/replication in use
    wrappers: tuple[str, ...] = ()  # around the model itself (DDP, engine, FSDP1 root, compile)
    param_count: int = 0
    param_bytes: int = 0
    modules: tuple[ModuleNode, ...] = ()
    modules_total: int = 0  # in the whole tree (modules holds at most MAX_MODULES)
    modules_dropped: int = 0  # left out of `modules` (collapsed repeats and the cap)
    repeated: tuple[RepeatedSet, ...] = ()
    fsdp2_units: tuple[Fsdp2Unit, ...] = ()
    fsdp2_units_total: int = 0
    fsdp1: tuple[Fsdp1Instance, ...] = ()
    deepspeed: DeepSpeedConfig | None = None
    ddp: DdpConfig | None = None
    optimizers: tuple[OptimizerInfo, ...] = ()
    mesh: DeviceMeshInfo | None = None  # None: no device mesh (or a description before 1.1)
    dtensor_modules: tuple[DTensorModule, ...] = ()
    process_groups: tuple[ProcessGroupInfo, ...] = ()
    pipeline: PipelineInfo | None = None  # None: no pipeline stage built (or before 1.2)
    # what the first forward saved for backward, by block (None: not measured, or before 1.3)
    activations: ActivationSizes | None = None
    notes: tuple[str, ...] = ()  # what was dropped or unknown, in words
    inferred: bool = False  # True: built from trace labels, not captured from the live model

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists)."""
        return _to_json(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelDescription:
        """Load a description; ValueError for another major schema or a non-object."""
        if not isinstance(data, Mapping):
            raise ValueError("a model description must be a JSON object")
        schema = str(data.get("schema", ""))
        if schema != MODEL_SCHEMA and not schema.startswith(MODEL_SCHEMA + "."):
            raise ValueError(f"model description schema {schema!r} is not {MODEL_SCHEMA!r}")
        return _from_json(cls, data)


# ------------------------------------------------------------------------- (de)serialization
T = TypeVar("T")


def _to_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    return value


def _from_json(cls: type[T], data: Mapping[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            continue
        try:
            kwargs[f.name] = _convert(hints[f.name], data[f.name])
        except (TypeError, ValueError):
            continue  # a malformed value keeps the default
    return cls(**kwargs)


def _convert(tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        errors: list[Exception] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value)
            except (TypeError, ValueError) as exc:
                errors.append(exc)
        raise ValueError(f"no variant of {tp} fits {value!r}: {errors}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v) for v in value)
        return tuple(_convert(a, v) for a, v in zip(args, value, strict=True))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise TypeError(f"expected an object for {tp.__name__}")
        return _from_json(tp, value)
    if tp is bool:
        if not isinstance(value, bool):
            raise TypeError("expected a boolean")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError("expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise TypeError("expected a string")
        return value
    return value


__all__ = [
    "FRAMEWORKS",
    "KEEP_REPEATED_CHILDREN",
    "MAX_DTENSOR_MODULES",
    "MAX_FSDP_UNITS",
    "MAX_MODULES",
    "MAX_PIPELINE_SCHEDULES",
    "MAX_PIPELINE_STAGES",
    "MAX_PREFETCH_NAMES",
    "MAX_PROCESS_GROUPS",
    "MAX_REPEATED_SETS",
    "MESH_ROLES",
    "MODEL_SCHEMA",
    "MODEL_SCHEMA_VERSION",
    "DTensorModule",
    "DTensorParam",
    "DdpConfig",
    "DeepSpeedConfig",
    "DeviceMeshInfo",
    "Fsdp1Instance",
    "Fsdp2Unit",
    "MeshDim",
    "ModelDescription",
    "ModuleNode",
    "OptimizerInfo",
    "PipelineInfo",
    "PipelineScheduleInfo",
    "PipelineStageInfo",
    "Precision",
    "ProcessGroupInfo",
    "RepeatedSet",
]
