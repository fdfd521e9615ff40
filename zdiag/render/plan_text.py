"""`zdiag plan` as text and as JSON (`zdiag.plan/1`): the best plan, its code, the runners-up."""

from __future__ import annotations

import json
import textwrap
from typing import Any

from zdiag.analyzers.planning.plan import Plan, PlanSearch
from zdiag.render.format import fmt_bytes, fmt_ms

PLAN_SCHEMA = "zdiag.plan/1"
RUNNERS_UP = 5


def _pct(new: float, old: float) -> str:
    return f"{100.0 * (new - old) / old:+.1f}%" if old else "n/a"


def _peak(pl: Plan) -> str:
    """The predicted peak, else the change's estimated delta."""
    if pl.predicted_peak_bytes is not None:
        return fmt_bytes(pl.predicted_peak_bytes)
    delta = pl.result.memory_delta_bytes
    if delta is None:
        return "unknown"
    return ("+" if delta >= 0 else "-") + fmt_bytes(abs(delta))


def _step(plan: Plan) -> str:
    """The predicted step, ">=" where it is a lower bound."""
    return (">=" if plan.at_least else "") + fmt_ms(plan.predicted_ms)


def _fits(fits: bool | None) -> str:
    return "-" if fits is None else "yes" if fits else "no"


def render_plan_text(search: PlanSearch, width: int = 100) -> str:
    """The text: the best plan and its code, then the ranked plans and how they were searched."""
    s, best = search, search.best
    lines = []
    if best.change.label().startswith("("):
        bounded = sum(p.at_least for p in s.plans)
        lines.append(
            f"no faster plan: the run as it is ({fmt_ms(s.measured_ms)} per step) is the fastest "
            + (
                f"of the {len(s.plans) - bounded} plans replayed whose step is predicted "
                f"({bounded} more give only a lower bound)"
                if bounded
                else f"of the {len(s.plans)} plans replayed"
            )
        )
    else:
        lines.append(
            f"best plan ({s.framework}): {best.change.label()}: step {fmt_ms(s.measured_ms)} -> "
            f"{_step(best)} ({_pct(best.predicted_ms, s.measured_ms)}), peak "
            + (
                f"{fmt_bytes(s.measured_peak_bytes)} -> {fmt_bytes(best.predicted_peak_bytes)}"
                if s.measured_peak_bytes is not None
                else f"{_peak(best)} (the run recorded no peak)"
            )
        )
    if s.budget_bytes is not None:
        lines.append(f"memory budget: {fmt_bytes(s.budget_bytes)} per rank")
    lines = [w for line in lines for w in textwrap.wrap(line, width, subsequent_indent="  ")]
    if s.text:
        lines += ["", *textwrap.wrap(s.text, width)]
    if s.code:
        lines += ["", *s.code.splitlines()]
    lines += ["", "plans (replayed; the fastest within the budget first):"]
    peak_head = "peak" if s.measured_peak_bytes is not None else "peak delta"
    lines.append(f"{'step':>10} {'change':>8} {peak_head:>10} {'fits':>5}  plan")
    for pl in s.plans[: RUNNERS_UP + 1]:
        lines.extend(
            w.rstrip()
            for w in textwrap.wrap(
                f"{_step(pl):>10} {_pct(pl.predicted_ms, s.measured_ms):>8} "
                f"{_peak(pl):>10} {_fits(pl.fits_budget):>5}  {pl.change.label()}",
                max(width, 60),
                subsequent_indent=" " * 38,
                drop_whitespace=False,
            )
        )
    if len(s.plans) > RUNNERS_UP + 1:
        lines.append(f"(+{len(s.plans) - RUNNERS_UP - 1} more in --json)")
    tail = [
        "searched exactly, every combination replayed: " + "; ".join(s.grid) + ".",
        "Not searched: mesh shapes (zdiag whatif --mesh-shape; across nodes their links are an "
        "assumption, --intra-node-speedup, not a measurement); micro-batches (they change the "
        "batch each pass computes on, not the schedule: zdiag whatif --micro-batches) "
        "(docs/whatif.md). Check the plan: apply it and run again.",
        *(f"note: {n}" for n in s.notes),
    ]
    lines.append("")
    lines += [w for line in tail for w in textwrap.wrap(line, width, subsequent_indent="  ")]
    return "\n".join(lines) + "\n"


def plan_json(search: PlanSearch) -> dict[str, Any]:
    """The search as the versioned JSON object."""
    s = search
    return {
        "schema": PLAN_SCHEMA,
        "framework": s.framework,
        "measured_ms": round(s.measured_ms, 4),
        "measured_peak_bytes": s.measured_peak_bytes,
        "budget_bytes": s.budget_bytes,
        "best": s.best.change.label(),
        "code": s.code,
        "text": s.text,
        "grid": s.grid,
        "notes": s.notes,
        "plans": [
            {
                "change": pl.change.label(),
                "predicted_ms": round(pl.predicted_ms, 4),
                "predicted_peak_bytes": pl.predicted_peak_bytes,
                "fits_budget": pl.fits_budget,
                "predicted_ms_is_lower_bound": pl.at_least,
                "memory_delta_bytes": pl.result.memory_delta_bytes,
            }
            for pl in s.plans
        ],
    }


def render_plan_json(search: PlanSearch) -> str:
    """The JSON text."""
    return json.dumps(plan_json(search), indent=1) + "\n"
