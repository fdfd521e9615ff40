"""A finer wrap: each child of a module that lies inside one FSDP unit becomes a unit of its own
(`zdiag whatif --wrap MODULE` where no unit of the run lies under MODULE: a whole-model wrap
split into one unit per block).

The split needs what the trace cannot show, each block's share of the enclosing unit's
parameters; it comes from the captured module tree (`wrap_split`), so a run without its model
description cannot be split. Then, on each modelled step (`finer_wrap`):

- **Where each block runs.** The enclosing unit's forward starts where its forward gather's
  consumer began and its backward ends where its reduce is issued. Its forward ends where its
  backward gather is needed, or, for a unit that stays gathered from forward to backward (the
  FSDP2 root), a third of the way: backward costs about twice forward. The blocks share each
  pass evenly, in definition order forward and the reverse backward (repeated blocks compute
  alike; what the unit computes outside its blocks is spread with them).
- **Its collectives.** Each block gathers at the start of its forward and again at the start of
  its backward (FSDP's default resharding after forward; costed from the unit's own backward
  gather where it re-gathered, else from its forward one), and reduces at the end of its backward,
  awaited where the unit's reduce was. The unit keeps its own calls for the parameters outside
  the blocks. A call of bytes share f costs `alpha + (d - alpha) x f`, from the measured call of
  duration d and its lane's fitted latency alpha (the per-byte time of the very call it splits),
  after the smallest launch latency the step's FSDP calls showed.
- **Hooks.** With an overhead fit over units of two sizes or more, each new unit adds its fitted
  per-step overhead, half where its forward starts and half where its backward starts. A run of
  one unit shows no per-unit fixed cost apart from its bytes, so none is added: on a CPU run,
  where every call blocks, the predicted cost is then low by the blocks' hook time.
- **Prefetch.** The new units keep the step's prefetch depth, at least 1 where gathers can
  overlap (FSDP prefetches the next unit's gather in backward by default, and on a GPU the host
  issues the next block's forward gather ahead of the device).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from ..inputs.model_facts import ModelFacts
from ..rank.fsdp_ledger import GATHER_FAMILY
from ..rank.step_model import ModelOp, StepModel
from . import counterfactuals as cf
from .platform import CommFit, OverheadFit, Platform, with_bytes_share

FORWARD_SHARE = 1 / 3
"""A unit's forward as a share of its forward plus backward, when the trace does not say."""

BLOCKS_UNSHARDED_AT_PEAK = 2
"""Blocks gathered at once after a finer wrap: the one computing and the one prefetched."""

_MIN_SHARE = 1e-3  # a rest of the unit below this share of its parameters has no calls
# a block's reduce comes just before the next block's backward gather: where both block the
# training thread, one after the other (the replay issues every call at a position first)
_BEFORE_NEXT = 1e-3


class SplitError(ValueError):
    """A finer wrap that cannot be modelled (the message says why and what to do)."""


@dataclass(frozen=True)
class WrapSplit:
    """The enclosing unit and the blocks that would each become a unit."""

    unit: str  # the unit the blocks lie in now: a module path, "" for the root
    blocks: tuple[tuple[str, int], ...]  # (module path, parameter bytes), in definition order
    unit_bytes: int  # the unit's own parameter bytes (its subtree less nested units)

    def share(self, nbytes: int) -> float:
        """`nbytes` as a share of the unit's parameters."""
        return nbytes / self.unit_bytes if self.unit_bytes > 0 else 0.0

    @property
    def rest_share(self) -> float:
        """The share of the unit's parameters outside the blocks (kept by the unit)."""
        return max(0.0, 1.0 - sum(self.share(b) for _p, b in self.blocks))


def _children(model: ModelFacts, container: str) -> list[tuple[str, int]]:
    """(path, parameter bytes) of a module's direct children in definition order, those the
    description collapsed restored from their repeated set (index names, the set's sizes)."""
    desc = model.description
    prefix = f"{container}." if container else ""
    depth = container.count(".") + 1 if container else 1
    known = [
        (m.path, m.total_bytes)
        for m in desc.modules
        if m.path and m.path.startswith(prefix) and m.path.count(".") + 1 == depth
    ]
    rep = next((r for r in desc.repeated if r.path == container), None)
    if rep is None or len(known) >= rep.count:
        return known
    names = {p for p, _b in known}
    missing = [f"{prefix}{i}" for i in range(rep.count) if f"{prefix}{i}" not in names]
    listed = sum(b for p, b in known if p[len(prefix) :].isdigit())
    left = (rep.total_bytes or 0) - listed
    each = (
        left // len(missing)
        if rep.total_bytes is not None and missing and left > 0
        else rep.bytes_per_child_min or 0
    )
    return sorted(
        known + [(p, each) for p in missing],
        key=lambda pb: (0, int(pb[0][len(prefix) :])) if pb[0][len(prefix) :].isdigit() else (1, 0),
    )


def wrap_split(model: ModelFacts | None, prefix: str, units: Sequence[str]) -> WrapSplit:
    """The split of `prefix`'s children (comma-separated modules) out of the unit they lie in
    now, from the captured description; SplitError when it cannot be modelled."""
    shown = ", ".join(u or "(root)" for u in sorted(units)[:6]) or "none"
    if model is None or model.inferred or not model.description.modules:
        raise SplitError(
            f"no FSDP unit of this run lies under '{prefix}' (its units: {shown}), and "
            "splitting a unit into blocks needs their sizes from the captured module tree, "
            "which this run lacks (record it with zdiag run)"
        )
    unplaced = (len(model.description.modules),)
    containers = sorted(
        (p.strip().strip(".") for p in prefix.split(",") if p.strip().strip(".")),
        key=lambda c: model.definition_key(c) or unplaced,
    )  # definition order: an encoder's blocks before a decoder's, body.mixers.2's after 1's
    blocks = [cb for c in containers for cb in _children(model, c) if cb[1] > 0]
    if len(blocks) < 2:
        raise SplitError(
            f"no FSDP unit of this run lies under '{prefix}' (its units: {shown}), and in the "
            "captured module tree it has fewer than two children holding parameters to split "
            "out; give the module whose children are the repeated blocks"
        )
    enclosing = {_enclosing(units, c) for c in containers}
    if len(enclosing) != 1 or None in enclosing:
        raise SplitError(
            f"the children of '{prefix}' do not lie in one FSDP unit of this run (its units: "
            f"{shown}); give modules inside one unit"
        )
    unit = enclosing.pop() or ""
    nodes = {m.path: m.total_bytes for m in model.description.modules}
    nested = sum(nodes.get(u, 0) for u in units if u != unit and _under(u, unit))
    own = nodes.get(unit, model.description.param_bytes if not unit else 0) - nested
    if own <= 0:
        raise SplitError(f"the captured module tree gives no parameter bytes for unit '{unit}'")
    return WrapSplit(unit, tuple(blocks), own)


def _under(path: str, ancestor: str) -> bool:
    return not ancestor or path == ancestor or path.startswith(ancestor + ".")


def _enclosing(units: Sequence[str], container: str) -> str | None:
    """The innermost unit whose module holds `container`."""
    holding = [u for u in units if _under(container, u)]
    return max(holding, key=lambda u: (u.count(".") + 1) if u else 0) if holding else None


def unplaceable(model: StepModel, unit: str) -> str | None:
    """Why a step's passes cannot be placed for a split of `unit` (None: they can): the unit's
    forward gather marks where its forward starts and its gradient reduce where its backward
    ends."""
    own = [op for op in model.ops if op.family and op.unit == unit]
    if not any(op.family == GATHER_FAMILY and op.phase == "forward" for op in own):
        return "has no forward all-gather in the traces"
    if not any(op.family != GATHER_FAMILY for op in own):
        return "has no gradient reduce among the traces' FSDP collectives"
    return None


def finer_wrap(
    model: StepModel,
    split: WrapSplit,
    fits: Mapping[str, CommFit],
    platform: Platform,
    overhead: OverheadFit | None = None,
) -> StepModel:
    """The step with `split`'s blocks as units of their own (see the module docstring)."""
    own = [op for op in model.ops if op.family and op.unit == split.unit]
    gathers = [op for op in own if op.family == GATHER_FAMILY]
    forward = next((op for op in gathers if op.phase == "forward"), None)
    if forward is None:
        return model  # nothing gathered in forward (`unplaceable` says so first)
    backward = next((op for op in gathers if op.phase == "backward"), None)
    reduce = next((op for op in own if op.family != GATHER_FAMILY), None)
    if reduce is None:
        return model  # no end to the unit's backward (`unplaceable` says so first)
    start = _needed(forward)
    end = reduce.issue_pos_us
    fwd_end = _needed(backward) if backward is not None else start + (end - start) * FORWARD_SHARE
    launch = min(op.delay_us for op in model.ops if op.family)
    sizes: dict[str, int] = {}
    ops = [op for op in model.ops if not (op.family and op.unit == split.unit)]
    rest = split.rest_share
    if rest >= _MIN_SHARE:
        ops += [with_bytes_share(op, rest, fits) for op in own]
    n = len(split.blocks)
    inserts: list[tuple[float, float]] = []
    for i, (path, nbytes) in enumerate(split.blocks):
        f = split.share(nbytes)
        at_fwd = start + (fwd_end - start) * i / n
        at_bwd = fwd_end + (end - fwd_end) * (n - 1 - i) / n
        ops.append(_placed(with_bytes_share(forward, f, fits), path, at_fwd, at_fwd, launch))
        ops.append(  # the unit's own backward gather's cost where it re-gathered, else forward's
            _placed(
                with_bytes_share(backward or forward, f, fits),
                path,
                at_bwd,
                at_bwd,
                launch,
                "backward",
            )
        )
        at_end = fwd_end + (end - fwd_end) * (n - i) / n - _BEFORE_NEXT
        wait = reduce.wait_pos_us
        if wait is not None:
            wait = at_end if _blocking(reduce) else max(wait, at_end)
        ops.append(_placed(with_bytes_share(reduce, f, fits), path, at_end, wait, launch))
        sizes[path] = max(0, int(forward.bytes * f)) if forward.bytes > 0 else 0
        if overhead is not None and overhead.sizes >= 2:
            o = overhead.overhead_us(sizes[path]) / 2
            inserts += [(at_fwd, o), (at_bwd, o)]
    changed = msgspec.structs.replace(model, ops=ops)
    changed = cf.expanded(changed, inserts)
    depth = max(cf.measured_depth(model), 1 if platform.gathers_overlap else 0)
    return cf.prefetch(changed, depth, platform)


def _blocking(op: ModelOp) -> bool:
    """Whether a call ran only where it was awaited (gloo without the async op: it blocks the
    training thread there), so that its split calls block where each is issued."""
    if op.wait_pos_us is None:
        return False
    started = op.start_pos_us if op.start_pos_us >= 0 else op.issue_pos_us
    return started >= op.wait_pos_us - cf.AHEAD_US


def _needed(op: ModelOp) -> float:
    """Where a gather's consumer began (its hooks), else where it was awaited."""
    if op.needed_pos_us is not None:
        return op.needed_pos_us
    return op.wait_pos_us if op.wait_pos_us is not None else op.issue_pos_us


def _placed(
    op: ModelOp,
    unit: str,
    issue: float,
    wait: float | None,
    launch: float,
    phase: str | None = None,
) -> ModelOp:
    """A new unit's call: issued at `issue`, awaited at `wait`, queued behind its lane."""
    return msgspec.structs.replace(
        op,
        unit=unit,
        phase=op.phase if phase is None else phase,
        issue_pos_us=issue,
        wait_pos_us=wait,
        needed_pos_us=issue if op.family == GATHER_FAMILY else None,
        start_pos_us=-1.0,
        after=0,
        delay_us=launch,
        waited_us=0.0,
        prefetched=False,
    )


def split_memory_delta(
    split: WrapSplit, gathered: Mapping[str, int], held: int = BLOCKS_UNSHARDED_AT_PEAK
) -> tuple[int | None, str]:
    """The peak-memory delta of the split, and how: the unit gathered whole now, against its
    rest plus the `held` largest blocks after (by default the one computing and the one
    prefetched), from the gathered bytes the trace recorded for the unit, shared as the
    captured tree says."""
    whole = gathered.get(split.unit)
    if not whole:
        return None, "unknown: the traces record no message size for the unit split"
    block_bytes = sorted((split.share(b) * whole for _p, b in split.blocks), reverse=True)
    after = split.rest_share * whole + sum(block_bytes[:held])
    return int(after - whole), (
        f"the unit '{split.unit or '(root)'}' gathered whole now against its rest "
        f"({split.rest_share:.0%} of it) plus the {min(held, len(block_bytes))} largest of "
        f"{len(split.blocks)} blocks gathered at once after, their shares from the captured "
        "module tree"
    )
