"""The schedule changes a what-if replays (`zdiag whatif`'s options, the findings' remedies)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Change:
    """The schedule changes to replay (None / False: as measured)."""

    prefetch: int | None = None  # FSDP prefetch depth: gathers issued this many units ahead
    reshard_after_forward: bool | None = None  # False: keep gathered units until backward
    wrap: str | None = None  # one unit per child of this module (coarser, or finer: split)
    remove_host_syncs: bool = False  # every host sync the traces show
    remove_model_syncs: bool = False  # the model's own (in its units or forward) only
    unshard_async_op: bool = False  # FSDP2 on CPU/gloo: gathers run on gloo's worker thread
    without_stragglers: tuple[int, ...] = ()  # these ranks arrive with the others
    checkpoint: str | None = None  # activation checkpointing of each child of this module
    micro_batches: int | None = None  # each step's batch split into this many, accumulated
    mesh_shape: tuple[int, int] | None = None  # FSDP's ranks as (replicate, shard)
    all_reduce_once: bool = False  # HSDP: replicate all-reduces in the last micro-batch only
    bf16_reduce: bool = False  # FSDP's gradient reduces in bf16 (MixedPrecisionPolicy)
    bf16_params: bool = False  # FSDP's parameter gathers in bf16 (MixedPrecisionPolicy)
    mesh_order: tuple[str, ...] | None = None  # the captured mesh's dimensions in this order
    # a mesh shape's or order's groups inside one node move bytes this many times faster than
    # across nodes (None: mesh_shape.INTRA_NODE_SPEEDUP); read on multi-node runs only
    intra_node_speedup: float | None = None

    def label(self) -> str:
        """The change in the CLI's words."""
        parts = []
        if self.prefetch is not None:
            parts.append(f"--prefetch {self.prefetch}")
        if self.reshard_after_forward is not None:
            parts.append(f"--reshard-after-forward {'on' if self.reshard_after_forward else 'off'}")
        if self.wrap is not None:
            parts.append(f"--wrap {self.wrap}")
        if self.remove_host_syncs:
            parts.append("--no-host-syncs")
        elif self.remove_model_syncs:
            parts.append("--no-model-syncs")
        if self.unshard_async_op:
            parts.append("--unshard-async-op")
        if self.without_stragglers:
            parts.append("--without-straggler " + ",".join(map(str, self.without_stragglers)))
        if self.checkpoint is not None:
            parts.append(f"--checkpoint {self.checkpoint}")
        if self.micro_batches is not None:
            parts.append(f"--micro-batches {self.micro_batches}")
        if self.mesh_shape is not None:
            parts.append("--mesh-shape {},{}".format(*self.mesh_shape))
        if self.mesh_order is not None:
            parts.append("--mesh-order " + ",".join(self.mesh_order))
        if self.all_reduce_once:
            parts.append("--all-reduce-once")
        if self.bf16_reduce:
            parts.append("--reduce-dtype bf16")
        if self.bf16_params:
            parts.append("--param-dtype bf16")
        if self.intra_node_speedup is not None:
            parts.append(f"--intra-node-speedup {self.intra_node_speedup:g}")
        return " ".join(parts) or "(nothing: the measured schedule)"
