"""A finding's expected gain, replayed: the what-if engine (analyzers/whatif/) run on the
detector context's step models with the change the finding recommends.

`replayed(ctx, change)` replays the change on every modelled rank and gives the result (None
when no rank has a modelled step or the change does not apply), once per context and change. The platform is the fact
sheet's: on a CPU-only run, gathers overlap only where it says they can (the unshard async op
the run sets, ZeRO-3), or where the change itself sets the async op; elsewhere they can. `gain_text` states the
counterfactual that ran, for the finding's `gain_method`. `prefetch_change` is the overlap
change `missing-overlap` replays, which `comm-bound` replays its remedies beyond.
"""

from __future__ import annotations

from ..rank.declared_groups import members_by_name, sizes_by_name
from ..whatif.run_whatif import (
    CORE_SHARING_NOTE,
    CORES_MEASURED,
    Change,
    WhatIfError,
    WhatIfResult,
    note_core_use,
    replay_change,
)
from .context import DetectorContext


def replayed(ctx: DetectorContext, change: Change) -> WhatIfResult | None:
    """The replay of `change` over the run (None: nothing modelled, or the change does not
    apply to this run)."""
    if not ctx.step_models:
        return None
    if change not in ctx.replays:
        ctx.replays[change] = _replay(ctx, change)
    return ctx.replays[change]


def _replay(ctx: DetectorContext, change: Change) -> WhatIfResult | None:
    """The replay itself (`replayed` keeps it on the context)."""
    sheet = ctx.sheet
    if sheet.cpu_only:
        can = sheet.gathers_can_overlap()
        why = (
            "CPU/gloo: the run's gathers run on gloo's worker thread (unshard async op, ZeRO-3)"
            if can
            else "CPU/gloo: blocking all-gathers run on the training thread"
        )
    else:
        can, why = True, "collectives run on their own streams (not a CPU-only run)"
    try:
        result = replay_change(
            ctx.step_models,
            ctx.device,
            change,
            framework=sheet.framework.name if sheet.framework else None,
            overlap=(can, why),
            model=sheet.model,
            group_sizes={r: sizes_by_name(f.process_groups) for r, f in ctx.facts.items()},
            group_members={r: members_by_name(f.process_groups) for r, f in ctx.facts.items()},
            world=sheet.world_size,
            nodes=sheet.nodes,
        )
    except WhatIfError:
        return None
    return note_core_use(result, ctx.host_cores)


def prefetch_change(ctx: DetectorContext) -> Change:
    """The overlap change `missing-overlap` replays: gathers prefetched one unit ahead, with
    FSDP2's unshard async op on a CPU run whose gathers cannot overlap as configured."""
    lacks_overlap = ctx.sheet.cpu_only and not ctx.sheet.gathers_can_overlap()
    return Change(prefetch=1, unshard_async_op=lacks_overlap)


def gain_text(result: WhatIfResult) -> str:
    """How the gain was computed, with the counterfactual that ran."""
    return (
        f"replayed (zdiag whatif {result.change.label()}): the measured step re-timed with "
        f"the change, {result.measured_ms:.1f} -> {result.predicted_ms:.1f} ms, median over "
        f"{len(result.ranks)} rank(s); {result.platform.reason}"
        + (_core_sharing(result.notes) if CORE_SHARING_NOTE in result.notes else "")
        + " (docs/whatif.md)"
    )


def _core_sharing(notes: list[str]) -> str:
    """What a replay that runs gloo's worker thread beside compute assumes of the cores: the
    measured use where the run's step logs give it, else the caveat."""
    measured = [n.removeprefix(CORES_MEASURED) for n in notes if n.startswith(CORES_MEASURED)]
    return "; compute kept as measured, though gloo's worker thread shares the host's cores" + (
        f"; {measured[0]}" if measured else ": an upper bound where the ranks fill them"
    )
