"""`zdiag whatif RUN --prefetch 2 --wrap encoder.stages ...`: replay the measured step, changed.

The run (a run directory, trace files or a folder of traces) is analyzed as `zdiag analyze`
does (stored summaries first); each rank's modelled steps are replayed as measured (the model
check: it must give back the measured step) and with the change, and the text gives the
predicted step time and peak memory against the measured ones, per rank. `--json` writes
`zdiag.whatif/1`, `--perfetto FILE` the replayed step as a trace overlay, `--html FILE` a page
with the replayed timeline. The step model and its limits: docs/whatif.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zdiag.errors import ConfigError, InputError

if TYPE_CHECKING:
    from zdiag.analyzers.detectors.context import DetectorContext
    from zdiag.analyzers.report import Report
    from zdiag.analyzers.whatif.run_whatif import Change

EXAMPLES = """\
examples:
  zdiag whatif runs/a --prefetch 2                 # gathers issued two units ahead
  zdiag whatif runs/a --wrap model.layers          # one FSDP unit per child of model.layers
  zdiag whatif runs/a --reshard-after-forward off  # keep gathered units until backward
  zdiag whatif runs/a --no-host-syncs              # the .item() / synchronize calls removed
  zdiag whatif runs/a --prefetch 1 --unshard-async-op   # CPU/gloo: FSDP2's async unshard
  zdiag whatif runs/a --without-straggler 3        # rank 3 arrives with the others
  zdiag whatif runs/a --checkpoint model.layers    # activation checkpointing of each layer
  zdiag whatif runs/a --micro-batches 2            # each batch as 2 accumulated halves
  zdiag whatif runs/a --mesh-shape 2,4             # HSDP: 2 replicas of 4-way sharding
  zdiag whatif runs/a --mesh-shape 4,8 --intra-node-speedup 10   # multi-node: NVLink vs network
  zdiag whatif runs/a --mesh-order dp,tp           # multi-node: the mesh with "tp" last
  zdiag whatif runs/a --all-reduce-once            # HSDP + accumulation: last micro-batch only
  zdiag whatif runs/a --reduce-dtype bf16          # gradients reduced in bf16
  zdiag whatif runs/a --pipeline-microbatches 8    # pipeline stages: 8 micro-batches per step
  zdiag whatif runs/a --pipeline-rebalance         # ... the split pipeline-bubble proposes
  zdiag whatif runs/a --prefetch 2 --json          # zdiag.whatif/1
  zdiag whatif runs/a --prefetch 2 --perfetto replay.json --html replay.html
"""

MAX_PREFETCH = 8
MAX_MICRO_BATCHES = 64


def _depth(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a prefetch depth: {text!r}") from exc
    if not 0 <= value <= MAX_PREFETCH:
        raise argparse.ArgumentTypeError(f"a prefetch depth is 0 to {MAX_PREFETCH}, got {value}")
    return value


def _micro_batches(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number of micro-batches: {text!r}") from exc
    if not 2 <= value <= MAX_MICRO_BATCHES:
        raise argparse.ArgumentTypeError(
            f"micro-batches are 2 to {MAX_MICRO_BATCHES} per step, got {value}"
        )
    return value


def _mesh_shape(text: str) -> tuple[int, int]:
    parts = text.replace("x", ",").split(",")
    try:
        r, s = (int(p) for p in parts)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"a mesh shape is REPLICATE,SHARD, e.g. 2,4; got {text!r}"
        ) from exc
    if r < 1 or s < 1:
        raise argparse.ArgumentTypeError(f"mesh dimensions are 1 or more, got {text!r}")
    return r, s


def _mesh_order(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(","))
    if len(names) < 2 or not all(names):
        raise argparse.ArgumentTypeError(
            f"a mesh order is the mesh's dimension names, comma-separated, e.g. dp,tp; got {text!r}"
        )
    return names


def _speedup(text: str) -> float:
    try:
        x = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (e.g. 2 or 8.5)") from exc
    if not 1.0 <= x <= 1000.0:
        raise argparse.ArgumentTypeError(f"a speedup is between 1 and 1000, got {text!r}")
    return x


def _ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a rank list: {text!r} (e.g. 3 or 3,5)") from exc
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"ranks are 0 or more, e.g. 3 or 3,5; got {text!r}")
    return ranks


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"on or off, got {text!r}")
    return text == "on"


class WhatIfCommand:
    """`zdiag whatif`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of `zdiag whatif`."""
        parser.epilog = EXAMPLES
        parser.add_argument(
            "run",
            type=Path,
            metavar="RUN",
            nargs="?",
            help="a run directory, a trace file or a folder of traces",
        )
        parser.add_argument(
            "--prefetch",
            type=_depth,
            metavar="N",
            help="issue each FSDP all-gather at least N units ahead of its use",
        )
        parser.add_argument(
            "--reshard-after-forward",
            type=_on_off,
            metavar="on|off",
            help="off: keep gathered units from forward to backward (no re-gather)",
        )
        parser.add_argument(
            "--wrap",
            metavar="MODULE",
            help="one FSDP unit per child of MODULE (e.g. model.layers): coarser where its "
            "children hold several units now, finer where they lie inside one unit (a "
            "whole-model wrap split per block; needs the captured model)",
        )
        parser.add_argument(
            "--checkpoint",
            metavar="MODULE",
            help="activation checkpointing of each child of MODULE: its forward runs again in "
            "backward",
        )
        parser.add_argument(
            "--micro-batches",
            type=_micro_batches,
            metavar="K",
            help="each step's batch as K micro-batches with gradient accumulation (FSDP, ZeRO): "
            "the passes run K times at 1/K of their compute",
        )
        parser.add_argument(
            "--mesh-shape",
            type=_mesh_shape,
            metavar="R,S",
            help="FSDP's ranks as R replicas of S-way sharding (HSDP; 1,N: flat FSDP over N): "
            "gathers and reduce-scatters over S ranks, gradient shards all-reduced over R",
        )
        parser.add_argument(
            "--mesh-order",
            type=_mesh_order,
            metavar="DIMS",
            help="the run's device mesh with its dimensions in this order (names, e.g. dp,tp), "
            "each rank on its node: init_device_mesh lays ranks out row-major, so the order "
            "decides which groups stay inside a node (multi-node runs)",
        )
        parser.add_argument(
            "--intra-node-speedup",
            type=_speedup,
            metavar="X",
            help="with --mesh-shape or --mesh-order on a multi-node run: a group inside one node "
            "moves bytes X times as fast as one across nodes (default 2, a floor; NVLink "
            "against the network is often 5-20)",
        )
        parser.add_argument(
            "--all-reduce-once",
            action="store_true",
            help="HSDP with gradient accumulation: all-reduce across the replicas in the last "
            "micro-batch only (set_requires_all_reduce(False) before it)",
        )
        parser.add_argument(
            "--reduce-dtype",
            choices=("bf16",),
            help="bf16: FSDP's gradient reduce-scatters and all-reduces in bf16 "
            "(MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)): half the bytes",
        )
        parser.add_argument(
            "--param-dtype",
            choices=("bf16",),
            help="bf16: FSDP's parameter all-gathers in bf16 "
            "(MixedPrecisionPolicy(param_dtype=torch.bfloat16)): half the bytes; refused on "
            "CPU runs",
        )
        parser.add_argument(
            "--no-host-syncs",
            action="store_true",
            help="remove the host syncs (.item(), synchronize) the traces show",
        )
        parser.add_argument(
            "--no-model-syncs",
            action="store_true",
            help="remove only the model's own host syncs (inside its FSDP units or its "
            "wrapper's forward; not the optimizer's or the training loop's): the host-sync "
            "finding's change",
        )
        parser.add_argument(
            "--unshard-async-op",
            action="store_true",
            help="CPU/gloo FSDP2: model _set_unshard_async_op(True), so gathers can overlap",
        )
        parser.add_argument(
            "--without-straggler",
            type=_ranks,
            metavar="RANK[,RANK]",
            default=(),
            help="these ranks arrive with the others: the waits for them go",
        )
        parser.add_argument(
            "--pipeline-microbatches",
            type=_micro_batches,
            metavar="N",
            help="pipeline stages (torch.distributed.pipelining): the schedule with N "
            "micro-batches per step, a multiple of the run's (each action's work cut but for "
            "its FSDP gathers and host cost per op; ScheduleGPipe, Schedule1F1B, "
            "ScheduleInterleaved1F1B, ScheduleLoopedBFS)",
        )
        parser.add_argument(
            "--pipeline-rebalance",
            action="store_true",
            help="pipeline stages: the split `pipeline-bubble` proposes (the slow stage's "
            "blocks it names moved to its faster neighbour, else every stage at the mean work)",
        )
        parser.add_argument("--json", action="store_true", help="write the result as JSON")
        parser.add_argument(
            "--output", "-o", type=Path, metavar="FILE", help="write the text (or JSON) to FILE"
        )
        parser.add_argument(
            "--perfetto",
            type=Path,
            metavar="FILE",
            help="write the replayed step as a Perfetto / chrome://tracing overlay",
        )
        parser.add_argument(
            "--html", type=Path, metavar="FILE", help="write a page with the replayed timeline"
        )
        parser.add_argument(
            "--no-cache",
            action="store_true",
            help="decode every trace: read no stored summary and write none",
        )

    def run(self, args: argparse.Namespace) -> int:
        """Analyze, replay, write; returns the exit code."""
        from zdiag.analyzers.engine.summary_pipeline import SummaryOptions, analyze_via_summaries
        from zdiag.analyzers.engine.summary_store import cache_disabled_by_env
        from zdiag.analyzers.whatif.run_whatif import WhatIfError, note_core_use, run_whatif
        from zdiag.render.output import OutputTarget, check_outputs

        if args.run is None:
            raise ConfigError("give a run: zdiag whatif RUN --prefetch 2 (see --help).")
        pipeline = args.pipeline_microbatches is not None or args.pipeline_rebalance
        if pipeline:
            _pipeline_only(args)
        change = None if pipeline else _change(args)
        targets = [
            OutputTarget(flag, path)
            for flag, path in (
                ("--output", args.output),
                ("--perfetto", args.perfetto),
                ("--html", args.html),
            )
            if path
        ]
        check_outputs(targets, inputs=[args.run])
        if not args.run.exists():
            raise InputError(
                f"{args.run} does not exist; give a run directory, a trace file or a folder of traces."
            )
        use_cache = not (args.no_cache or cache_disabled_by_env())
        options = SummaryOptions(use_stored=use_cache, write_cache=use_cache)
        run = analyze_via_summaries([args.run], options)
        if change is None:
            return _pipeline_whatif(run.context, args)
        config = (run.report.run or {}).get("config") or {}
        model = run.context.model if run.context is not None else None
        try:
            result = run_whatif(
                run.summaries,
                change,
                framework=config.get("framework"),
                unshard_async_op=_async_op(config),
                peaks=measured_peaks(run.report),
                model=model,
                nodes=run.context.sheet.nodes if run.context is not None else (),
            )
        except WhatIfError as exc:
            raise InputError(f"{args.run}: {exc}.") from exc
        if run.context is not None:
            note_core_use(result, run.context.host_cores)
        _write(result, args)
        return 0


def _change_fields(args: argparse.Namespace) -> Change:
    """The FSDP step changes the options ask for (Change(): none)."""
    from zdiag.analyzers.whatif.run_whatif import Change

    return Change(
        prefetch=args.prefetch,
        reshard_after_forward=args.reshard_after_forward,
        wrap=args.wrap.strip(".") if args.wrap else None,
        remove_host_syncs=args.no_host_syncs,
        remove_model_syncs=args.no_model_syncs,
        unshard_async_op=args.unshard_async_op,
        without_stragglers=args.without_straggler,
        checkpoint=args.checkpoint.strip(".") if args.checkpoint else None,
        micro_batches=args.micro_batches,
        mesh_shape=args.mesh_shape,
        mesh_order=args.mesh_order,
        all_reduce_once=args.all_reduce_once,
        bf16_reduce=args.reduce_dtype == "bf16",
        bf16_params=args.param_dtype == "bf16",
    )


def _change(args: argparse.Namespace) -> Change:
    from zdiag.analyzers.whatif.run_whatif import Change

    change = _change_fields(args)
    if args.intra_node_speedup is not None:
        if change.mesh_shape is None and change.mesh_order is None:
            raise ConfigError(
                "--intra-node-speedup sets the links a mesh shape's or order's groups use: give "
                "it with --mesh-shape R,S or --mesh-order DIMS."
            )
        change = dataclasses.replace(change, intra_node_speedup=args.intra_node_speedup)
    if change == Change():
        raise ConfigError(
            "say what to change: --prefetch N, --reshard-after-forward off, --wrap MODULE, "
            "--checkpoint MODULE, --micro-batches K, --mesh-shape R,S, --mesh-order DIMS, "
            "--all-reduce-once, "
            "--reduce-dtype bf16, --no-host-syncs, --unshard-async-op, --without-straggler "
            "RANK, --pipeline-microbatches N or --pipeline-rebalance."
        )
    return change


def _pipeline_only(args: argparse.Namespace) -> None:
    """The pipeline changes replay the schedule across ranks, not the FSDP step model: refused
    with any other change, with both at once, and with the timeline outputs."""
    from zdiag.analyzers.whatif.run_whatif import Change

    if args.pipeline_microbatches is not None and args.pipeline_rebalance:
        raise ConfigError(
            "give one pipeline change: --pipeline-microbatches N or --pipeline-rebalance."
        )
    if _change_fields(args) != Change() or args.intra_node_speedup is not None:
        raise ConfigError(
            "the pipeline changes replay the schedule across the ranks, not the FSDP step: give "
            "--pipeline-microbatches or --pipeline-rebalance without the other changes."
        )
    if args.perfetto is not None or args.html is not None:
        raise ConfigError("--perfetto and --html draw the FSDP step replay, not a pipeline's.")


def _pipeline_whatif(context: DetectorContext | None, args: argparse.Namespace) -> int:
    """Replay the run's pipeline schedule with the change, and write it."""
    from zdiag.analyzers.detectors.pipeline_bubble import bubble_of
    from zdiag.analyzers.run.core_use import busiest
    from zdiag.analyzers.whatif.pipeline_replay import Replayed
    from zdiag.render.output import deliver
    from zdiag.render.pipeline_whatif import (
        render_pipeline_whatif_json,
        render_pipeline_whatif_text,
    )

    pf = context.model.pipeline if context is not None and context.model is not None else None
    m = pf.n_microbatches if pf is not None else None
    no_pipeline = InputError(
        f"{args.run}: no pipeline to replay: the run has no pipeline stages and schedule "
        "captured by `zdiag run`, or fewer than two stages timed."
    )
    if context is None or not m:
        raise no_pipeline
    factor = 2
    if args.pipeline_microbatches is not None:
        if args.pipeline_microbatches % m or args.pipeline_microbatches == m:
            raise ConfigError(
                f"--pipeline-microbatches must be a multiple of the run's {m} "
                f"micro-batches (e.g. {2 * m}), got {args.pipeline_microbatches}."
            )
        factor = args.pipeline_microbatches // m
    b = bubble_of(context, factor)  # one replay, with the micro-batches asked for
    if b is None:
        raise no_pipeline
    if not isinstance(b.replayed, Replayed):
        raise InputError(f"{args.run}: the pipeline schedule replay did not run ({b.replayed}).")
    rebalance = args.pipeline_rebalance
    cores = busiest(context.host_cores) if context.sheet.cpu_only else None
    deliver(
        lambda width: (
            render_pipeline_whatif_json(b, rebalance, cores)
            if args.json
            else render_pipeline_whatif_text(b, rebalance, width, cores)
        ).encode(),
        args.output,
        "the what-if",
    )
    return 0


def _async_op(config: dict[str, Any]) -> bool | None:
    """Whether the run sets FSDP2's unshard async op, from its configuration table."""
    value = str(config.get("fsdp2 unshard async op", ""))
    if value.startswith("True"):
        return True
    return False if value.startswith("False") else None


def measured_peaks(report: Report) -> dict[int, int]:
    """Each rank's measured peak memory: its snapshot or memory-event breakdown, else timeline."""
    peaks = {m.rank: m.peak_bytes for m in report.memory if m.peak_bytes}
    for b in report.memory_breakdowns:
        if b.peak_bytes:
            peaks[b.rank] = b.peak_bytes
    return peaks


def _write(result: Any, args: argparse.Namespace) -> None:
    from zdiag.render.output import deliver, write_output
    from zdiag.render.whatif_text import render_whatif_json, render_whatif_text

    deliver(
        lambda width: (
            render_whatif_json(result) if args.json else render_whatif_text(result, width)
        ).encode(),
        args.output,
        "the what-if",
    )
    if args.perfetto is not None:
        from zdiag.render.whatif_trace import whatif_trace

        write_output(args.perfetto, json.dumps(whatif_trace(result)).encode())
        print(f"zdiag: wrote the replay overlay to {args.perfetto}", file=sys.stderr)
    if args.html is not None:
        from zdiag.render.whatif_html import render_whatif_html

        write_output(args.html, render_whatif_html(result).encode())
        print(f"zdiag: wrote the what-if page to {args.html}", file=sys.stderr)


COMMAND = WhatIfCommand()
