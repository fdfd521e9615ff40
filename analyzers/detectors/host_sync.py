"""`host-sync`: the user's model code blocks the host on device values every step.

The map attributes every host sync to its caller (analyzers/rank/host_syncs.py): the optimizer's own
internals (AdamW's step-counter `.item()` inside `Optimizer.step#AdamW.step`: not the user's to
remove, never counted here), the model's code (inside an FSDP unit's forward/backward, named by
the unit, or inside a DDP / FSDP1 forward range) and the training loop (loss logging outside the
model: once per step is the usual, harmless pattern). The finding fires when the model's code
syncs at least once per step on a rank: a `.item()`, `bool(tensor)` or NaN check inside a
block. On GPUs each one drains the launch queue (the host waits for every queued kernel, then
the device waits for the host's next launches, and a prefetched all-gather cannot be issued
ahead); on CPU it only costs what the check itself computes, so a CPU-only run gets the finding
(at info) without a step-time gain. Elsewhere the gain is the replay's, with the model's syncs
removed and the optimizer's and the loop's kept.
"""

from __future__ import annotations

from ..rank.host_syncs import HostSyncSites
from ..report import Finding, Severity
from ..whatif.run_whatif import Change
from .context import DetectorContext
from .replayed_gain import gain_text, replayed
from .rule import Rule, Threshold

# (the reasoning behind each value: RULE's thresholds, at the end of the module)
MIN_MODEL_SYNCS_PER_STEP = 1.0
WARNING_GAIN_SHARE = 0.02
CRITICAL_GAIN_SHARE = 0.10

_CODE = """\
# instead of a host check inside each block, such as
#     if not torch.isfinite(x).all().item(): raise ...
# (or loss.item() / float(t) per block), keep the check on the
# device and read it once every N steps, outside the model:
bad = torch.zeros((), dtype=torch.bool, device=x.device)  # per step
bad |= ~torch.isfinite(x).all()  # in each block: no host sync
...
if step % 100 == 0 and bad.item():  # one sync every 100 steps
    raise FloatingPointError("non-finite activation")"""


def _owner(library: list[str]) -> str:
    """The library of the most frequent library source line ("transformers: file.py:..")."""
    return library[0].split(":", 1)[0]


def _library_advice(sites: HostSyncSites, n: int, where: str, library: list[str]) -> str:
    """The recommendation when a library's own code, not the user's, holds the syncs."""
    return (
        f"The syncs ({sites.in_model / n:.1f} per step {where}) are in the {_owner(library)} "
        f"library's own code, not in yours: {'; '.join(library[:3])}. Your model calls it; "
        "the fix is on that path: an option of the library that skips the check (or passes "
        "the value it computes, so it need not read it from the device), a newer version, or "
        "an issue to its maintainers. No code is proposed for your script."
    )


def _steps(ctx: DetectorContext, rank: int) -> int:
    bds = ctx.breakdowns.get(rank) or []
    if bds:
        return len(bds)
    lg = ctx.ledgers.get(rank)
    return max(1, len(lg.steps)) if lg is not None else 1


def detect(ctx: DetectorContext) -> list[Finding]:
    """The host-sync finding, or none."""
    hits = []
    for rank in sorted(ctx.facts):
        sites = ctx.host_sync_sites(rank)
        n = _steps(ctx, rank)
        if sites.in_model / n >= MIN_MODEL_SYNCS_PER_STEP:
            hits.append((rank, sites, n))
    if not hits:
        return []
    rank, sites, n = max(hits, key=lambda h: h[1].model_blocked_ms / h[2])
    blocked = sites.model_blocked_ms / n
    gain, method = _gain(ctx, blocked)
    durs = sorted(b.duration_ms for b in ctx.breakdowns.get(rank, []) if b.duration_ms > 0)
    median = durs[len(durs) // 2] if durs else None
    severity: Severity = "warning"
    if gain is None:
        severity = "info"
    elif median:
        if gain >= CRITICAL_GAIN_SHARE * median:
            severity = "critical"
        elif gain < WARNING_GAIN_SHARE * median:
            severity = "info"
    units = sorted(sites.units, key=lambda u: (-sites.units[u], u))
    shown = [u or "the root" for u in units]
    where = (
        f"in {len(units)} FSDP unit{'s' if len(units) != 1 else ''} ({', '.join(shown[:6])}"
        f"{', ...' if len(units) > 6 else ''})"
        if units
        else "inside the model's forward"
    )
    lines = sorted(sites.source_lines, key=lambda k: -sites.source_lines[k])
    library = sorted(sites.library_lines, key=lambda k: -sites.library_lines[k])
    in_library = sum(sites.library_lines.values()) > sum(sites.source_lines.values())
    optimizer = sum(sites.optimizer.values())
    recommendation = (
        _library_advice(sites, n, where, library)
        if in_library
        else (
            f"The model's own code blocks the host {sites.in_model / n:.1f} times per step "
            f"{where}"
            + (f", at {'; '.join(lines[:3])}" if lines else "")
            + ": a `.item()`, `float(t)`, `bool(t)` or NaN check inside a block. Keep such "
            "checks on the device and read them once every N steps outside the model (code "
            "below)."
            + (
                ""
                if lines or library
                else " Re-run with `zdiag run --with-stack` to get the source lines."
            )
        )
    ) + (
        f" Not counted: {optimizer} syncs inside the optimizer's own step "
        f"({', '.join(sorted(sites.optimizer))}), which are its internals, and {sites.loop} "
        "in the training loop outside the model."
        if optimizer or sites.loop
        else ""
    )
    return [
        Finding(
            id="host-sync",
            severity=severity,
            title=(
                (
                    f"Host syncs in the {_owner(library)} library's code"
                    if in_library
                    else "Host syncs in the model's code"
                )
                + f": {sites.in_model / n:.1f} per step {where}"
            ),
            ranks=[h[0] for h in hits],
            units=units,
            evidence={
                "rank": rank,
                "steps": n,
                "syncs_in_model": sites.in_model,
                "syncs_by_unit": {u or "(root)": k for u, k in sites.units.items()},
                "syncs_in_wrapper_forward": sites.model_forward,
                "syncs_in_optimizer": dict(sites.optimizer),
                "syncs_in_loop": sites.loop,
                "syncs_total": sites.total,
                "source_lines": dict(sites.source_lines),
                **({"library_lines": dict(sites.library_lines)} if sites.library_lines else {}),
                "model_sync_host_ms_per_step": round(blocked, 3),
                "median_step_ms": median,
                "threshold_syncs_per_step": MIN_MODEL_SYNCS_PER_STEP,
            },
            recommendation=recommendation,
            code=None if in_library else _CODE,
            expected_gain_ms=None if gain is None else round(gain, 3),
            gain_method=method,
        )
    ]


def _gain(ctx: DetectorContext, blocked_ms: float) -> tuple[float | None, str]:
    """(ms per step, how): on a CPU-only run none (a sync waits for nothing there); else the
    replay with the model's syncs removed (`zdiag whatif --no-model-syncs`), else, without
    modelled steps, the syncs' own host time."""
    if ctx.sheet.cpu_only:
        return None, (
            "none on a CPU-only run: a sync there waits for no device queue, so removing it "
            f"saves only the read itself ({blocked_ms:.3f} ms per step of host time), less than "
            "a re-run can tell apart, while the fix keeps the check's compute; the finding is "
            "for the same code on GPUs, where each sync drains the launch queue"
        )
    result = replayed(ctx, Change(remove_model_syncs=True))
    if result is not None:
        return max(0.0, result.gain_ms), gain_text(result) + (
            "; each sync's chunk is the device's idle after it until its next kernel: an "
            "upper bound where the host is behind for other reasons too"
        )
    return blocked_ms, (
        "the host time of the model's syncs per step (each sync's own duration: on GPUs "
        "the wait for the device to drain its queue). A lower bound: it leaves out the "
        "device idling while the host relaunches after each sync"
    )


RULE = Rule(
    id="host-sync",
    summary="the model's own code blocks the host on device values every step",
    detect=detect,
    what=(
        "The model's own code syncs the host at least once per step on a rank. Syncs "
        "(`aten::_local_scalar_dense`, CPU sync events) are attributed by the map "
        "(analyzers/rank/host_syncs.py) to the optimizer's internals (inside "
        "`Optimizer.step#<Class>.step`: AdamW's step-counter `.item()`, never counted), an FSDP "
        "unit's forward/backward (between `FSDP::pre_forward (<fqn>)` and `FSDP::post_forward "
        "(<fqn>)`, or pre/post backward: the unit is named; the root's own code, outside its "
        "blocks, is the root's), a DDP / FSDP1 forward range (no module name), or the loop (loss "
        "logging: not counted); source lines come from the innermost frame outside torch and "
        "the standard library when the trace has stacks, and a frame of an installed library "
        "(transformers' `masking_utils.py`) makes the syncs the library's: no code, the library "
        "and its line named. On "
        "DeepSpeed ZeRO-3 a sync between the first and last forward-time ZeRO-3 autograd "
        "Function of a step counts as the model's; ZeRO-1/2 traces have no such marks (a "
        "known miss). Severity follows the gain: info below 2% of the step (and without a gain: "
        "a CPU-only run), critical from 10%."
    ),
    why=(
        "On GPUs each sync drains the launch queue: the host waits for every queued kernel, "
        "then the device waits for the host's next launches, and a prefetched all-gather "
        "cannot be issued ahead. On CPU it costs what the check itself computes."
    ),
    example=(
        "Host syncs in the model's code: 4.0 per step in 4 FSDP units (layers.0, layers.1, "
        "layers.2, layers.3) (a NaN check with `.item()` in each block)."
    ),
    fix=(
        "Keep the check on the device and read it once every N steps outside the model "
        "(code); `--with-stack` for source lines. Syncs in a library's code: where they are and "
        "that the fix lies on the library's path (an option, a newer version), no code."
    ),
    gain=(
        "Replayed (`zdiag whatif --no-model-syncs`): the measured step re-timed without the "
        "model's syncs (each one's host time and the device idle after it; the optimizer's and "
        "the loop's stay): an upper bound where the host is behind for other reasons too. "
        "None on a CPU-only run: a sync there waits for no device queue (only its read, "
        "microseconds, would go). Without modelled steps, the syncs' own host time."
    ),
    scope="any run whose traces show host syncs (CPU or GPU)",
    thresholds=(
        Threshold(
            "MIN_MODEL_SYNCS_PER_STEP",
            MIN_MODEL_SYNCS_PER_STEP,
            "At least one sync per step inside the model (the loop's own logging sync is "
            "outside it).",
            evidence="threshold_syncs_per_step",
        ),
        Threshold(
            "WARNING_GAIN_SHARE",
            WARNING_GAIN_SHARE,
            "Severity follows the gain: below this share of the median step, info.",
        ),
        Threshold(
            "CRITICAL_GAIN_SHARE",
            CRITICAL_GAIN_SHARE,
            "From this share of the median step, critical.",
        ),
    ),
)
