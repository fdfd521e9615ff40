"""The planner on synthetic FSDP2 traces: every combination replayed, the budget respected, the
best plan's code from the framework's remedies."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from support.described_models import MIB, described, measured
from support.ledger_traces import BLOCKS, LEAVES, fsdp2_cpu_trace, write
from support.trace_contexts import trace_context
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.planning.plan import PlanError, search
from zdiag.analyzers.report import StepBreakdown
from zdiag.analyzers.whatif.run_whatif import Change
from zdiag.render.plan_text import render_plan_text


def test_the_grid_is_replayed_whole_and_ranked(tmp_path: Path) -> None:
    ctx = trace_context(write(tmp_path, fsdp2_cpu_trace(LEAVES, steps=2)))
    found = search(ctx)
    labels = {p.change.label() for p in found.plans}
    assert len(found.plans) == 8  # wrap (as is / blocks) x prefetch (as is / 1) x reshard
    assert any("--wrap layers" in lb for lb in labels)
    assert [p.predicted_ms for p in found.plans] == sorted(p.predicted_ms for p in found.plans)
    baseline = next(p for p in found.plans if p.change == Change())
    assert baseline.predicted_ms == pytest.approx(found.measured_ms)


def test_the_budget_puts_plans_that_fit_first(tmp_path: Path) -> None:
    ctx = trace_context(write(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=2)))
    free = search(ctx, peaks={0: 1_000_000})
    assert free.best.change.reshard_after_forward is False  # no re-gather: fastest, more memory
    tight = search(ctx, budget_bytes=1_000_000, peaks={0: 1_000_000})
    assert tight.best.fits_budget is True
    assert tight.best.change.reshard_after_forward is None  # keeping units costs memory
    held = [p for p in tight.plans if p.change.reshard_after_forward is False]
    assert held and all(p.fits_budget is False for p in held)
    assert tight.plans.index(held[0]) > tight.plans.index(tight.best)


def test_a_cpu_fsdp2_run_without_the_async_unshard_gets_it_with_prefetch(tmp_path: Path) -> None:
    ctx = trace_context(write(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=2)))
    step = StepBreakdown(step=1, duration_ms=4.0, compute_ms=2.4, comm_ms=1.6, overlapped_ms=0.0,
                         exposed_comm_ms=1.6, idle_ms=0.0, verdict="exposed-comm")  # fmt: skip
    ctx = dataclasses.replace(ctx, breakdowns={0: [step, step]})
    assert ctx.sheet.cpu_only and not ctx.sheet.gathers_can_overlap()
    found = search(ctx)
    prefetched = [p for p in found.plans if p.change.prefetch]
    assert prefetched and all(p.change.unshard_async_op for p in prefetched)
    assert found.best.change.prefetch == 1  # the gathers are exposed: prefetch pays
    code = found.code or ""
    assert "blocks[i].set_modules_to_forward_prefetch([blocks[i + 1]])" in code
    assert "model._set_unshard_async_op(True)" in code


def test_no_step_models_is_refused() -> None:

    with pytest.raises(PlanError, match="no rank has a modelled step"):
        search(DetectorContext(ledgers={}))


def test_checkpointing_is_searched_where_the_blocks_activations_weremeasured(
    tmp_path: Path,
) -> None:
    facts = measured(blocks=3, saved=10 * MIB, inputs=MIB)
    ctx = trace_context(write(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=2)), model=facts)
    free = search(ctx, peaks={0: 100 * MIB})
    assert any("activation checkpointing: none, each block (layers)" in g for g in free.grid)
    assert free.best.change.checkpoint is None  # it only costs time
    checkpointed = [p for p in free.plans if p.change.checkpoint == "layers"]
    assert checkpointed and all(p.predicted_ms > free.measured_ms for p in checkpointed)
    tight = search(ctx, budget_bytes=90 * MIB, peaks={0: 100 * MIB})
    assert tight.best.change.checkpoint == "layers" and tight.best.fits_budget
    alone = next(p for p in tight.plans if p.change == Change(checkpoint="layers"))
    assert alone.predicted_peak_bytes == 100 * MIB - (30 - 3 - 10) * MIB
    code = tight.code or ""
    assert code.startswith("from torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    assert "blocks = set(model.layers)" in code  # applied first, before any other change


def test_without_measured_activations_checkpointing_is_not_searched(tmp_path: Path) -> None:
    ctx = trace_context(write(tmp_path, fsdp2_cpu_trace(BLOCKS, steps=2)), model=described(3))
    found = search(ctx, budget_bytes=90 * MIB, peaks={0: 100 * MIB})
    assert all(p.change.checkpoint is None for p in found.plans)
    assert any("not searched" in g and "--profile-memory" in g for g in found.grid)
    assert found.notes[-1].startswith("no plan fits the budget: the plans are ranked by predicted")
    peaks = [p.predicted_peak_bytes or 0 for p in found.plans]
    assert peaks == sorted(peaks)


def _one_unit_run(tmp_path: Path) -> DetectorContext:
    """A CPU FSDP2 run whose one unit is the root, over a captured model of 3 blocks (2 MiB
    each, every one listed) and 0.5 MiB of embedding; its gathers exposed."""
    from zdiag.analyzers.inputs.model_facts import ModelFacts
    from zdiag.collectors.model_schema import Fsdp2Unit, ModuleNode

    desc = described(3).description
    layers = dataclasses.replace(desc.modules[2], collapsed_children=0)
    third = dataclasses.replace(desc.modules[4], path="layers.2")
    rep = dataclasses.replace(desc.repeated[0], child_names=("0", "1", "2"))
    desc = dataclasses.replace(
        desc,
        modules=(*desc.modules[:2], layers, *desc.modules[3:], third),
        repeated=(rep,),
        fsdp2_units=(Fsdp2Unit(path="", cls="Net", unsharded_bytes=desc.param_bytes),),
    )
    assert all(isinstance(m, ModuleNode) for m in desc.modules)
    trace = fsdp2_cpu_trace([("", 13000)], steps=2, gather_us=400.0)
    ctx = trace_context(write(tmp_path, trace), model=ModelFacts(desc))
    step = StepBreakdown(step=1, duration_ms=4.0, compute_ms=2.4, comm_ms=1.6, overlapped_ms=0.0,
                         exposed_comm_ms=1.6, idle_ms=0.0, verdict="exposed-comm")  # fmt: skip
    return dataclasses.replace(ctx, breakdowns={0: [step, step]})


def test_on_cpu_a_split_predicts_a_bound_and_ranks_after_exact_plans_unless_only_it_fits(
    tmp_path: Path,
) -> None:
    """Splitting the one unit into its blocks: on CPU every call blocks and the new units'
    hooks are not in a one-unit run, so its step is a lower bound; however low, it ranks after
    the plans predicted exactly. Under a budget only the split meets, it comes first."""
    ctx = _one_unit_run(tmp_path)
    found = search(ctx)
    splits = [p for p in found.plans if p.change.wrap == "layers"]
    exact = [p for p in found.plans if p.change.wrap is None]
    assert splits and exact and all(p.at_least for p in splits)
    assert not any(p.at_least for p in exact)
    assert min(p.predicted_ms for p in splits) < min(p.predicted_ms for p in exact)
    assert found.best.change.wrap is None
    assert max(found.plans.index(p) for p in exact) < min(found.plans.index(p) for p in splits)
    assert any("lower bound" in n for n in found.notes)
    text = render_plan_text(found)
    assert ">=" in text  # the split's rows
    slow = dataclasses.replace(found, plans=[p for p in found.plans if p.change.wrap or
                                             p.change == Change()])  # fmt: skip
    slow.plans.sort(key=lambda p: p.at_least)  # the run as it is first: no faster exact plan
    headline = " ".join(render_plan_text(slow).split("\n\n")[0].split())
    assert f"fastest of the 1 plans replayed whose step is predicted ({len(splits)} more" in (
        headline
    )
    peak = 22 * MIB  # the split frees a third of the 52 kB unit: only it fits 10 kB less
    tight = search(ctx, budget_bytes=peak - 10_000, peaks={0: peak})
    assert tight.best.change.wrap == "layers" and tight.best.fits_budget is True
    assert tight.best.at_least
    assert render_plan_text(tight).startswith("best plan (")
    headline = " ".join(render_plan_text(tight).split("\n\n")[0].split())
    assert "-> >=" in headline  # a bound, said so
