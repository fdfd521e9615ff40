"""`zdiag whatif --pipeline-microbatches N | --pipeline-rebalance` as text and as JSON
(`zdiag.whatif-pipeline/1`): the pipeline schedule replay of the run, unchanged and changed."""

from __future__ import annotations

import json
import textwrap
from typing import Any

from zdiag.analyzers.detectors.pipeline_bubble import Bubble, rebalance_cores_text
from zdiag.analyzers.run.core_use import HostCores
from zdiag.analyzers.whatif.pipeline_replay import Replayed

PIPELINE_WHATIF_SCHEMA = "zdiag.whatif-pipeline/1"


def _changed(b: Bubble, rebalance: bool) -> tuple[str, float | None, str]:
    """(the change in words, its replayed phase in ms, why it was not replayed)."""
    r = b.replayed
    assert isinstance(r, Replayed)
    if not rebalance:
        return f"{r.factor * b.m} micro-batches", r.more_mb_ms, r.more_mb_why
    if r.move is not None:
        mv = r.move
        what = f"{mv.count} of stage {mv.source}'s {mv.of} blocks moved to stage {mv.target}"
    else:
        what = "every stage at the stages' mean work"
    return what, r.balanced_ms, ""


def pipeline_whatif_json(
    b: Bubble, rebalance: bool, cores: HostCores | None = None
) -> dict[str, Any]:
    """The replay as `zdiag.whatif-pipeline/1`; `cores`: a CPU run's busiest host, measured."""
    r = b.replayed
    assert isinstance(r, Replayed)
    what, changed, why = _changed(b, rebalance)
    gain = None if changed is None else r.unchanged_ms - changed
    return {
        "schema": PIPELINE_WHATIF_SCHEMA,
        "change": what,
        "schedule": b.schedule,
        "n_microbatches": b.m,
        "num_stages": b.pf.num_stages,
        "pipelines": [list(g) for g in b.pf.groups],
        "steps": r.steps,
        "measured_phase_ms": round(r.measured_ms, 3),
        "replayed_phase_ms": round(r.unchanged_ms, 3),
        "replay_error": round(r.error, 4),
        "changed_phase_ms": None if changed is None else round(changed, 3),
        "not_replayed": why or None,
        "measured_step_ms": round(b.step, 3),
        "predicted_step_ms": None if gain is None else round(b.step - gain, 3),
        "stages": [
            {
                "stages": list(q.stages),
                "ranks": list(q.ranks),
                "work_per_microbatch_ms": round(t, 3),
                "bubble_share": round(q.bubble_share, 4),
            }
            for q, t in zip(b.pos, b.per_mb, strict=True)
        ],
        "cores": None if cores is None else cores.as_json(),
    }


def render_pipeline_whatif_json(b: Bubble, rebalance: bool, cores: HostCores | None = None) -> str:
    """The JSON text."""
    return json.dumps(pipeline_whatif_json(b, rebalance, cores), indent=2) + "\n"


def render_pipeline_whatif_text(
    b: Bubble, rebalance: bool, width: int = 100, cores: HostCores | None = None
) -> str:
    """The text: the change's phase and step against the measured ones, the model check, and
    the measured cores (`cores`) where a rebalanced split keeps more ranks busy at once."""
    d = pipeline_whatif_json(b, rebalance, cores)
    check = (
        f"model check: the slowest pipeline's phase replays unchanged in "
        f"{d['replayed_phase_ms']:.1f} ms, measured {d['measured_phase_ms']:.1f} ms "
        f"({d['replay_error']:.1%} apart)"
    )
    lines = [
        f"zdiag whatif: the pipeline schedule replayed with {d['change']}",
        f"  {d['schedule']}: {d['n_microbatches']} micro-batches over {d['num_stages']} stages; "
        f"pipelines {d['pipelines']}; {d['steps']} step(s) replayed",
        *textwrap.wrap(check, width, initial_indent="  ", subsequent_indent="    "),
    ]
    if d["changed_phase_ms"] is None:
        lines.append(f"  not replayed: {d['not_replayed']}")
    else:
        delta = d["predicted_step_ms"] - d["measured_step_ms"]
        lines += [
            f"  pipeline phase: {d['replayed_phase_ms']:.1f} ms -> {d['changed_phase_ms']:.1f} ms",
            f"  step (median): {d['measured_step_ms']:.1f} ms measured -> "
            f"{d['predicted_step_ms']:.1f} ms predicted ({delta:+.1f} ms, "
            f"{'faster' if delta < 0 else 'slower' if delta > 0 else 'the same'})",
        ]
    lines.append("  per stage (ranks: work per micro-batch, share of the step waiting):")
    for s in d["stages"]:
        lines.append(
            f"    stage {', '.join(map(str, s['stages']))} (ranks {s['ranks']}): "
            f"{s['work_per_microbatch_ms']:.1f} ms, {s['bubble_share']:.0%}"
        )
    if cores is not None and rebalance:
        note = "cores: " + rebalance_cores_text(cores)
        lines += textwrap.wrap(note, width, initial_indent="  ", subsequent_indent="    ")
    how = (
        "Each rank's recorded actions are re-timed across its pipeline, every wait for a "
        "neighbour derived from the schedule (docs/whatif.md, 'Pipeline schedules')."
    )
    lines += textwrap.wrap(how, width, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines) + "\n"
