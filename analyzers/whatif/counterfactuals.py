"""Counterfactuals: each a function from a measured step model to a changed one.

- `prefetch(model, depth)`: each FSDP all-gather of a pass is issued no later than when the
  unit `depth` places before it starts (its consumer's position), so it can run under that
  unit's work. Only where the platform overlaps gathers (`platform.py`): on a blocking CPU run
  a prefetch moves the gather, it does not hide it, and the model is left as measured.
- `no_reshard_after_forward(model)`: the backward re-gathers of units that gathered in forward go.
- `coarser_wrap(model, prefix, fits)`: the units under each child of `prefix` (one module path,
  or several comma-separated) become one unit:
  their gathers merge into one issued where the first was and awaited where the first was; their
  reduce-scatters merge into one issued where the last was. The merged call costs what the
  lane's fit gives for the members' bytes together (one latency, one wait for the peers), or,
  without sizes, the members' measured time less one fitted latency per call saved. The step's prefetch depth is kept,
  counted in merged units: with depth 1 a merged unit's gather is issued when the merged unit
  before it starts.
- A finer wrap (a unit split into its blocks) lives in `finer_wrap.py`, micro-batches in
  `micro_batch.py`.
- `half_reduce_bytes(model, fits)`: gradients reduced in bf16 instead of fp32: every FSDP
  reduce keeps its lane's fitted latency and halves the rest of its time (the cast to bf16 and
  back is left out).
- `without_host_syncs(model, model_only=...)`: the host syncs' chunks of progress are removed
  (all of them, or the model's own only).
- `checkpointed(model, prefix)`: activation checkpointing of each child of `prefix` (a block):
  its forward runs again at the start of its backward, once its backward gather is consumed.
  A block's forward is the progress from its first forward gather's consumer to the next
  block's; the last block's is the median of the others' (repeated blocks compute alike). The
  gathers issued there (the backward prefetch) stay where they were, so they now hide under the
  recompute too. Blocks without a backward gather (kept unsharded after forward) have no
  position for their backward and are left as measured (`run_whatif` says how many).
- `without_stragglers(models_by_rank, ranks)`: the named ranks arrive with the others. The
  ranks of a collective finish it together, so a rank's call lasts from its arrival to the
  common end, and the stragglers' lead over the last of the others is the others' shortest call
  less the stragglers' shortest (the same call: the i-th of the step on the same comm lane).
  Every other rank's call gets that much shorter. The stragglers' own steps are not replayed:
  with the cause removed they run as their peers do (`run_whatif` gives them the peers' median).

Memory: `memory_delta_bytes` gives the change in peak each one implies, from the gathered bytes
of the units (what prefetching further, keeping units unsharded or wrapping coarser holds at
once). It is an estimate from the units' sizes, not from a replayed allocator.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import msgspec

from ..rank.fsdp_ledger import GATHER_FAMILY
from ..rank.step_model import ModelOp, StepModel
from .platform import CommFit, OverheadFit, Platform, with_bytes_share

GATHER = GATHER_FAMILY


def _passes(model: StepModel) -> dict[str, list[int]]:
    """FSDP gathers by phase, in the order their consumers need them."""
    out: dict[str, list[int]] = defaultdict(list)
    for j, op in enumerate(model.ops):
        if op.family == GATHER:
            out[op.phase].append(j)
    for idx in out.values():
        idx.sort(key=lambda j: (_anchor(model.ops[j]), j))
    return out


def _anchor(op: ModelOp) -> float:
    """Where the op's consumer runs: its wait position, else its issue position."""
    return op.wait_pos_us if op.wait_pos_us is not None else op.issue_pos_us


AHEAD_US = 1.0
"""A gather issued at least this long (of progress) before its consumer was issued ahead."""


def measured_depth(model: StepModel) -> int:
    """The prefetch depth the step shows: 0 when every gather started where its consumer ran,
    1 when the furthest started while the unit before its consumer ran, and so on."""
    depth = 0
    for idx in _passes(model).values():
        anchors = [_anchor(model.ops[j]) for j in idx]
        for k, j in enumerate(idx):
            op = model.ops[j]
            depth = max(depth, _units_ahead(anchors[:k], op, anchors[k], _started(op)))
    return depth


def _started(op: ModelOp) -> float:
    """Where the op measurably started (its issue position when the start is not known): on a
    GPU the host issues far ahead of the device, so only the start compares with consumers."""
    return op.start_pos_us if op.start_pos_us >= 0 else op.issue_pos_us


def prefetch(model: StepModel, depth: int, platform: Platform) -> StepModel:
    """Gathers issued at least `depth` units ahead (see the module docstring).

    A gather already issued `depth` units ahead of its consumer stays (an explicit prefetch
    list of that depth gains nothing more), and so does one issued under a prefetch label whose
    consumer the trace does not name (FSDP1, ZeRO-3: awaited where issued). A gather moves only
    when its new issue
    position lies before the position at which it measurably started (a gather the host issued
    early but the device ran late, as on a GPU whose all-gather stream waited, counts from its
    start); a moved gather keeps only the smallest latency its lane showed (the launch), not
    the wait that delayed it. On a CPU run the host is the device: a gather the training thread
    issued that far ahead is prefetched already, and if gloo's worker thread started it late,
    it waited for that thread, which a deeper prefetch does not change. (One that blocked the
    training thread where it was issued, without the async op, is judged as before.)"""
    if depth <= 0 or not platform.gathers_overlap:
        return model
    ops = list(model.ops)
    floor = _latency_floor(model)
    for idx in _passes(model).values():
        anchors = [_anchor(ops[j]) for j in idx]
        for k, j in enumerate(idx[depth:], start=depth):
            op = ops[j]
            issue = anchors[k - depth]
            started = _started(op)
            # on CPU a gather that did not block where issued ran on gloo's thread: issued
            # ahead is prefetched (see the docstring)
            async_cpu = platform.device == "cpu" and not _blocked_where_issued(op)
            sent = op.issue_pos_us if async_cpu else started
            ahead = _units_ahead(anchors[:k], op, anchors[k], sent)
            if ahead >= depth or issue >= started:
                continue  # already issued that far ahead, or started before the new issue
            if op.prefetched and op.wait_pos_us == op.issue_pos_us:
                continue  # prefetched under a label whose consumer the trace does not name
            ops[j] = msgspec.structs.replace(
                op,
                issue_pos_us=issue,
                wait_pos_us=anchors[k],
                after=max(op.after, 0),
                delay_us=min(op.delay_us, floor.get(op.lane, 0.0)),
            )
    return msgspec.structs.replace(model, ops=ops)


def _units_ahead(before: Sequence[float], op: ModelOp, anchor: float, sent: float) -> int:
    """How many units ahead of its consumer a gather sent at `sent` was: the earlier consumers
    of its pass (`before`) that run after it, and its own when it was sent before the consumer's
    hooks began (its ledger's `needed` position; else its wait, `anchor`). A gather its own
    pre-forward issued, some hook work before its wait, was not sent ahead."""
    own = op.needed_pos_us if op.needed_pos_us is not None else anchor
    return sum(1 for a in before if a > sent + AHEAD_US) + (own > sent + AHEAD_US)


def _blocked_where_issued(op: ModelOp) -> bool:
    """Whether the lane stood waiting for the op right where it issued it (a blocking call)."""
    return op.wait_pos_us is not None and op.wait_pos_us <= op.issue_pos_us + AHEAD_US


def _latency_floor(model: StepModel) -> dict[str, float]:
    """Per comm lane, the smallest latency (`delay_us`) of its gathers: the launch cost."""
    out: dict[str, float] = {}
    for op in model.ops:
        if op.family == GATHER:
            out[op.lane] = min(out.get(op.lane, op.delay_us), op.delay_us)
    return out


def resharded_units(model: StepModel) -> set[str]:
    """The units the step gathers in forward and again in backward."""
    forward = {op.unit for op in model.ops if op.family == GATHER and op.phase == "forward"}
    return {
        op.unit
        for op in model.ops
        if op.family == GATHER and op.phase == "backward" and op.unit in forward
    }


def no_reshard_after_forward(model: StepModel) -> StepModel:
    """The backward re-gathers of units gathered in forward removed."""
    units = resharded_units(model)
    ops = [
        op
        for op in model.ops
        if not (op.family == GATHER and op.phase == "backward" and op.unit in units)
    ]
    return msgspec.structs.replace(model, ops=ops)


def wrap_key(unit: str, prefix: str) -> str | None:
    """The unit a coarser wrap at the children of `prefix` puts `unit` in (None: outside).
    `prefix` may name several modules, comma-separated (`encoder.towers,decoder.towers`)."""
    for p in prefix.split(","):
        p = p.strip().strip(".")
        if p and unit.startswith(p + "."):
            rest = unit[len(p) + 1 :]
            return f"{p}.{rest.split('.', 1)[0]}"
    return None


def units_under(models: Sequence[StepModel], prefix: str) -> set[str]:
    """The FSDP units a coarser wrap at `prefix` would merge."""
    return {
        op.unit
        for m in models
        for op in m.ops
        if op.family and wrap_key(op.unit, prefix) is not None
    }


def coarser_wrap(
    model: StepModel,
    prefix: str,
    fits: Mapping[str, CommFit],
    platform: Platform,
    overhead: OverheadFit | None = None,
) -> StepModel:
    """The units under each child of `prefix` merged into one (see the module docstring); the
    merged units keep the step's prefetch depth, now counted in merged units, and their own
    ranges shrink to what the overhead fit gives for one unit of their bytes together."""
    depth = measured_depth(model)
    merged = _merge_units(model, prefix, fits)
    if overhead is not None:
        merged = compressed(merged, _merged_overhead_cuts(model, prefix, overhead))
    return prefetch(merged, depth, platform)


def _merged_overhead_cuts(
    model: StepModel, prefix: str, overhead: OverheadFit
) -> list[tuple[float, float]]:
    """The progress a merge saves in the units' own ranges, as (pos, length) cuts: per merged
    group, what its members spent less the fitted overhead of one unit of their bytes (never
    below the largest member's), taken from each member's chunks in proportion."""
    sizes = unit_gather_bytes([model])
    members: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for chunk in model.unit_chunks:
        key = wrap_key(chunk[2], prefix)
        if key is not None:
            members[key].append(chunk)
    cuts: list[tuple[float, float]] = []
    for chunks in members.values():
        spent_by: dict[str, float] = defaultdict(float)
        for _p, length, unit in chunks:
            spent_by[unit] += length
        if len(spent_by) < 2:
            continue
        spent = sum(spent_by.values())
        nbytes = sum(sizes.get(u, 0) for u in spent_by)
        keep = max(overhead.overhead_us(nbytes), max(spent_by.values()))
        share = max(0.0, spent - keep) / spent if spent > 0 else 0.0
        cuts.extend((p, length * share) for p, length, _u in chunks if share > 0)
    return cuts


def _merge_units(model: StepModel, prefix: str, fits: Mapping[str, CommFit]) -> StepModel:
    # per lane too: an HSDP unit's reduce-scatter and its replicate all-reduce stay apart
    groups: dict[tuple[str, str, str, str], list[int]] = defaultdict(list)
    for j, op in enumerate(model.ops):
        key = wrap_key(op.unit, prefix) if op.family else None
        if key is not None:
            groups[(key, op.family, op.phase, op.lane)].append(j)
    drop: set[int] = set()
    ops = list(model.ops)
    for (key, family, _phase, _lane), idx in groups.items():
        if len(idx) < 2:
            ops[idx[0]] = msgspec.structs.replace(ops[idx[0]], unit=key)
            continue
        members = [model.ops[j] for j in idx]
        fit = fits.get(members[0].lane)
        nbytes = sum(m.bytes for m in members) if all(m.bytes > 0 for m in members) else -1
        if fit is not None and nbytes > 0:
            dur = fit.duration_us(nbytes)  # one call: one latency, one wait for the peers
        else:
            alpha = fit.alpha_us if fit is not None else 0.0
            dur = max(sum(m.dur_us for m in members) - alpha * (len(members) - 1), 0.0)
        if family == GATHER:
            lead = min(idx, key=lambda j: (_anchor(model.ops[j]), j))
            waits = [m.wait_pos_us for m in members if m.wait_pos_us is not None]
            wait = min(waits) if waits else None
            issue = min(m.issue_pos_us for m in members)
        else:
            lead = max(idx, key=lambda j: (model.ops[j].issue_pos_us, j))
            waits = [m.wait_pos_us for m in members if m.wait_pos_us is not None]
            wait = max(waits) if waits else None
            issue = max(m.issue_pos_us for m in members)
        ops[lead] = msgspec.structs.replace(
            model.ops[lead],
            unit=key,
            dur_us=dur,
            bytes=nbytes,
            issue_pos_us=issue,
            wait_pos_us=None if wait is None else max(wait, issue),
        )
        drop.update(j for j in idx if j != lead)
    return msgspec.structs.replace(model, ops=[op for j, op in enumerate(ops) if j not in drop])


def half_reduce_bytes(model: StepModel, fits: Mapping[str, CommFit]) -> StepModel:
    """The step with every FSDP gradient reduce (reduce-scatter, HSDP's all-reduce) moving half
    its bytes (`reduce_dtype` bf16 where it was fp32): each call keeps its lane's fitted latency
    and halves the rest of its measured duration."""
    ops = [
        with_bytes_share(op, 0.5, fits) if op.family and op.family != GATHER else op
        for op in model.ops
    ]
    return msgspec.structs.replace(model, ops=ops)


def half_gather_bytes(model: StepModel, fits: Mapping[str, CommFit]) -> StepModel:
    """The step with every FSDP parameter all-gather moving half its bytes (`param_dtype` bf16
    where it was fp32): each call keeps its lane's fitted latency and halves the rest."""
    ops = [with_bytes_share(op, 0.5, fits) if op.family == GATHER else op for op in model.ops]
    return msgspec.structs.replace(model, ops=ops)


def without_host_syncs(model: StepModel, *, model_only: bool = False) -> StepModel:
    """The step with its host syncs' progress chunks removed: every one, or (`model_only`) only
    the model's own (not the optimizer's or the training loop's)."""
    cut = [(p, n) for p, n, own in model.syncs if own or not model_only]
    if not cut:
        return model
    moved = compressed(model, cut)  # moves the syncs kept too
    return msgspec.structs.replace(
        moved, syncs=[(p, n, own) for p, n, own in moved.syncs if model_only and not own]
    )


def _block_anchors(model: StepModel, prefix: str) -> tuple[dict[str, float], dict[str, float]]:
    """Per child of `prefix`: where its forward starts and where its backward starts (its
    earliest gather consumer in each pass)."""
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    for op in model.ops:
        key = wrap_key(op.unit, prefix) if op.family == GATHER else None
        starts = {"forward": fwd, "backward": bwd}.get(op.phase) if key else None
        if key is not None and starts is not None:
            starts[key] = min(starts.get(key, _anchor(op)), _anchor(op))
    return fwd, bwd


def block_forwards(model: StepModel, prefix: str) -> dict[str, float]:
    """Per child of `prefix`, the progress its forward takes (see the module docstring); empty
    with fewer than two blocks (the last block's length comes from the others)."""
    fwd, _ = _block_anchors(model, prefix)
    order = sorted(fwd, key=lambda k: (fwd[k], k))
    if len(order) < 2:
        return {}
    spans = {a: fwd[b] - fwd[a] for a, b in itertools.pairwise(order)}
    spans[order[-1]] = statistics.median(spans.values())
    return spans


def checkpointed(model: StepModel, prefix: str) -> tuple[StepModel, int]:
    """The step with each child of `prefix` checkpointed (see the module docstring), and how
    many of its blocks had no backward position (left as measured)."""
    spans = block_forwards(model, prefix)
    _, bwd = _block_anchors(model, prefix)
    inserts = [(bwd[k], length) for k, length in spans.items() if k in bwd and length > 0]
    return expanded(model, inserts), sum(1 for k in spans if k not in bwd)


def expanded(model: StepModel, inserts: Sequence[tuple[float, float]]) -> StepModel:
    """The step with `inserts` ((position, length) of progress) added: every position after
    one moves on by its length; a position exactly at it stays (what waits or is issued there
    comes first)."""
    if not inserts:
        return model
    chunks = sorted(inserts)
    starts = [p for p, _ in chunks]
    added = list(itertools.accumulate(length for _, length in chunks))

    def shift(p: float) -> float:
        k = bisect.bisect_left(starts, p)  # inserts strictly before p
        return p + (added[k - 1] if k else 0.0)

    return _moved(model, shift, model.work_us + added[-1])


def compressed(model: StepModel, cuts: Sequence[tuple[float, float]]) -> StepModel:
    """The step with `cuts` ((position, length) of progress) taken out: every later position
    moves back by what was cut before it."""
    if not cuts:
        return model
    chunks = sorted(cuts)
    starts = [p for p, _ in chunks]
    ends_cum = list(itertools.accumulate(length for _, length in chunks))

    def shift(p: float) -> float:
        k = bisect.bisect_left(starts, p)  # chunks starting before p
        if k == 0:
            return p
        before = ends_cum[k - 2] if k >= 2 else 0.0
        pos, length = chunks[k - 1]
        return p - before - min(length, p - pos)

    return _moved(model, shift, shift(model.work_us))


def shifted(op: ModelOp, shift: Callable[[float], float]) -> ModelOp:
    """`op` with its progress positions (issue, wait, measured start, consumer) mapped through
    `shift`."""
    return msgspec.structs.replace(
        op,
        issue_pos_us=shift(op.issue_pos_us),
        wait_pos_us=None if op.wait_pos_us is None else shift(op.wait_pos_us),
        start_pos_us=op.start_pos_us if op.start_pos_us < 0 else shift(op.start_pos_us),
        needed_pos_us=None if op.needed_pos_us is None else shift(op.needed_pos_us),
    )


def _moved(model: StepModel, shift: Callable[[float], float], work_us: float) -> StepModel:
    """The step with every progress position (issue, start, wait, host syncs, unit chunks)
    mapped through `shift`, and `work_us` of progress."""
    return msgspec.structs.replace(
        model,
        ops=[shifted(op, shift) for op in model.ops],
        syncs=[(shift(p), length, own) for p, length, own in model.syncs],
        unit_chunks=[(shift(p), length, u) for p, length, u in model.unit_chunks],
        optimizer=[(shift(p), length) for p, length in model.optimizer],
        work_us=work_us,
    )


def _call_key(models: Sequence[StepModel]) -> dict[tuple[int, str, int], float]:
    """Each call's duration by (step, lane, occurrence on that lane in the step)."""
    out: dict[tuple[int, str, int], float] = {}
    for m in models:
        seen: dict[str, int] = defaultdict(int)
        for op in m.ops:
            out[(m.step, op.lane, seen[op.lane])] = op.dur_us
            seen[op.lane] += 1
    return out


def without_stragglers(
    models_by_rank: Mapping[int, Sequence[StepModel]], stragglers: Sequence[int]
) -> dict[int, list[StepModel]]:
    """The other ranks' steps with their waits for `stragglers` removed (see the module
    docstring); calls the stragglers do not share are left as measured."""
    gone = set(stragglers)
    calls = {r: _call_key(ms) for r, ms in models_by_rank.items()}
    late: dict[tuple[int, str, int], float] = {}  # the stragglers' shortest call
    for r in gone:
        for key, dur in calls.get(r, {}).items():
            late[key] = min(dur, late.get(key, dur))
    first: dict[tuple[int, str, int], float] = {}  # the others' shortest call
    for r, durs in calls.items():
        if r not in gone:
            for key, dur in durs.items():
                first[key] = min(dur, first.get(key, dur))
    out: dict[int, list[StepModel]] = {}
    for r, models in models_by_rank.items():
        if r in gone:
            continue
        changed = []
        for m in models:
            seen: dict[str, int] = defaultdict(int)
            ops = []
            for op in m.ops:
                key = (m.step, op.lane, seen[op.lane])
                seen[op.lane] += 1
                # the stragglers' lead over the last of the others (ends agree)
                lead = first[key] - late[key] if key in late else 0.0
                ops.append(msgspec.structs.replace(op, dur_us=op.dur_us - lead) if lead > 0 else op)
            changed.append(msgspec.structs.replace(m, ops=ops))
        out[r] = changed
    return out


def unit_gather_bytes(models: Sequence[StepModel]) -> dict[str, int]:
    """Gathered bytes per FSDP unit (the largest call seen; units with unknown sizes left out)."""
    out: dict[str, int] = {}
    for m in models:
        for op in m.ops:
            if op.family == GATHER and op.bytes > 0:
                out[op.unit] = max(out.get(op.unit, 0), op.bytes)
    return out
