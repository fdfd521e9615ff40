"""Micro-batches: each step's batch split into K micro-batches with gradient accumulation (the
same global batch; `zdiag whatif --micro-batches K`).

The FSDP units mark the part of the step that runs once per micro-batch: from the first forward
gather's consumer to the last reduce's issue (the forward and backward passes). Inside it:

- **Compute scales with the micro-batch**: the progress that is not an FSDP unit's own range
  (hooks, copy-in and copy-out) or a host sync runs K times at 1/K of its length. Compute is
  taken as linear in the batch; small batches use the hardware less well, so the prediction is
  low where a micro-batch gets small.
- **What does not depend on the batch runs K times as measured**: the units' own ranges, the host
  syncs, the all-gathers (each micro-batch gathers every unit again, as FSDP does) and the other
  collectives of the passes.
- **Gradients are reduced once**, in the last micro-batch (FSDP2
  `set_requires_gradient_sync(False)` before the others, FSDP1 `no_sync()`): the reduces of the
  other micro-batches are left out.

What comes before the first micro-batch (data) and after the last (the optimizer step) is kept
as measured. Memory: activations shrink about K-fold and FSDP keeps each unit's unsharded
gradients between micro-batches; the step model holds no activation sizes, so the peak's
change is not estimated.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence

import msgspec

from ..rank.fsdp_ledger import GATHER_FAMILY
from ..rank.step_model import ModelOp, StepModel
from .counterfactuals import shifted


class MicroBatchError(ValueError):
    """A step whose passes the FSDP units do not mark (the message says why)."""


def passes_span(model: StepModel) -> tuple[float, float] | None:
    """(start, end) of the forward and backward passes in progress: the first forward gather's
    consumer to the last reduce's issue; None without both."""
    gathers = [op for op in model.ops if op.family == GATHER_FAMILY and op.phase == "forward"]
    reduces = [op for op in model.ops if op.family and op.family != GATHER_FAMILY]
    if not gathers or not reduces:
        return None
    start = min(
        op.needed_pos_us
        if op.needed_pos_us is not None
        else min(op.issue_pos_us, op.wait_pos_us if op.wait_pos_us is not None else op.issue_pos_us)
        for op in gathers
    )
    end = max(op.issue_pos_us for op in reduces)
    return (start, end) if end > start else None


def _fixed(model: StepModel, start: float, end: float) -> list[tuple[float, float]]:
    """The batch-independent progress inside [start, end] (units' own ranges, host syncs),
    merged, as (from, to)."""
    spans = sorted(
        (max(p, start), min(p + length, end))
        for p, length in [
            *((p, n) for p, n, _o in model.syncs),
            *((p, n) for p, n, _u in model.unit_chunks),
        ]
        if p + length > start and p < end
    )
    merged: list[tuple[float, float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


class _Map:
    """Positions inside the passes mapped into one micro-batch: compute shrunk k-fold, fixed
    chunks kept."""

    def __init__(self, start: float, end: float, fixed: Sequence[tuple[float, float]], k: int):
        self.start, self.end, self.k = start, end, k
        self.fixed = list(fixed)
        self.ends = [b for _a, b in self.fixed]
        self.before = [0.0, *itertools.accumulate(b - a for a, b in self.fixed)]
        self.length = self(end)

    def _fixed_before(self, p: float) -> float:
        i = bisect.bisect_right(self.ends, p)  # chunks wholly before p
        done = self.before[i]
        if i < len(self.fixed) and self.fixed[i][0] < p:
            done += p - self.fixed[i][0]
        return done

    def __call__(self, p: float) -> float:
        """`p`'s offset from the micro-batch's start."""
        p = min(max(p, self.start), self.end)
        fixed = self._fixed_before(p)
        return fixed + (p - self.start - fixed) / self.k


def micro_batched(model: StepModel, k: int) -> StepModel:
    """The step with its batch in `k` micro-batches (see the module docstring)."""
    span = passes_span(model)
    if span is None:
        raise MicroBatchError(
            "micro-batches are placed by the FSDP units' gathers and reduces, and this step "
            "has none"
        )
    start, end = span
    one = _Map(start, end, _fixed(model, start, end), k)
    grown = k * one.length - (end - start)

    def at(p: float, m: int | None = None) -> float:
        """`p` in micro-batch `m` (None: the first, or, from the passes' end on, after the
        last); before the passes as measured, after them moved on by what they grew."""
        if p < start:
            return p
        if p > end or (p == end and m is None):
            return p + grown
        return start + (m or 0) * one.length + one(p)

    ops: list[ModelOp] = []
    for op in model.ops:
        if not start <= op.issue_pos_us <= end:
            ops.append(shifted(op, at))
            continue
        reduced_once = op.family and op.family != GATHER_FAMILY
        for m in range(k - 1 if reduced_once else 0, k):
            ops.append(shifted(op, functools.partial(at, m=m)))
    syncs = [(at(p), n, o) for p, n, o in model.syncs if not start <= p < end]
    chunks = [(at(p), n, u) for p, n, u in model.unit_chunks if not start <= p < end]
    for m in range(k):
        syncs += [(at(p, m), n, o) for p, n, o in model.syncs if start <= p < end]
        chunks += [(at(p, m), n, u) for p, n, u in model.unit_chunks if start <= p < end]
    return msgspec.structs.replace(
        model,
        ops=ops,
        syncs=sorted(syncs),
        unit_chunks=sorted(chunks),
        optimizer=[(at(p), n) for p, n in model.optimizer],
        work_us=model.work_us + grown,
    )
