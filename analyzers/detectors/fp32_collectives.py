"""`fp32-collectives`: FSDP all-gathers moving fp32 parameters where bf16 would serve.

Parameters gathered for compute in bf16 are enough for the forward and backward math of
mixed-precision training (FSDP2's MixedPrecisionPolicy keeps fp32 shards and reduces gradients in
fp32 if asked): half the bytes on the wire and in the unsharded parameter memory. The gain is
the replay's with the gathers' bytes halved (`zdiag whatif --param-dtype bf16`), none on CPU-only
runs.
"""

from __future__ import annotations

from ..frameworks import Remedy
from ..rank.fsdp_ledger import CollectiveRecord
from ..report import Finding
from ..whatif.run_whatif import Change
from .comm_model import fit_alpha_beta
from .context import DetectorContext
from .replayed_gain import gain_text, replayed
from .rule import Rule, Threshold

FP32_NAMES = ("float", "float32", "torch.float32", "fp32")


def is_fp32(dtype: str) -> bool:
    """Whether a collective's recorded dtype (Kineto `dtype` arg, any spelling) is fp32."""
    return dtype.strip().lower() in FP32_NAMES


# (the reasoning behind each value: RULE's thresholds, at the end of the module)
FP32_BYTES_SHARE = 0.5
EXPOSED_STEP_SHARE = 0.1


def bf16_remedy(ctx: DetectorContext) -> Remedy | None:
    """The run's framework's change that moves parameters (or gradients) in bf16, None when the
    run already does (analyzers/frameworks/: MixedPrecisionPolicy, MixedPrecision, "bf16")."""
    return ctx.sheet.framework.bf16_comm(ctx.sheet.run_facts())


def _gain(
    ctx: DetectorContext,
    gathers: list[CollectiveRecord],
    fp32: list[CollectiveRecord],
    exposed_us: float,
    n_steps: int,
) -> tuple[float | None, str]:
    """(ms per step, how): on a CPU-only run none (bf16 parameters move the math to bf16, at a
    speed the fp32 trace does not show); else the replay with the gathers' bytes halved
    (`zdiag whatif --param-dtype bf16`), else, without modelled steps, the fitted bandwidth."""
    if ctx.sheet.cpu_only:
        return None, (
            "none on a CPU-only run: bf16 parameters also move the model's math to bf16, which "
            "a CPU runs at another speed than the fp32 the trace shows"
        )
    result = replayed(ctx, Change(bf16_params=True))
    if result is not None:
        return max(0.0, result.gain_ms), gain_text(result) + (
            "; compute kept as measured (bf16 math is faster on GPUs): a lower bound"
        )
    model = fit_alpha_beta(gathers)
    if model is None:
        return None, ""
    saved = sum(r.bytes / 2 / model.beta_bytes_per_us for r in fp32)
    total = sum(r.dur_us for r in fp32)
    return round(min(saved, total) * (exposed_us / total if total else 0) / 1e3 / n_steps, 3), (
        "half the bytes of each fp32 all-gather at the fitted bandwidth "
        f"({model.beta_bytes_per_us:.0f} B/us), scaled by the measured exposed share"
    )


def detect(ctx: DetectorContext) -> list[Finding]:
    """The fp32-collectives finding (severity info), or none."""
    ledgers = ctx.fsdp_ledgers()
    if not ledgers:
        return []
    lg = ledgers[0]
    gathers = [r for r in lg.gathers if r.bytes > 0]
    if not gathers:
        return []
    fp32 = [r for r in gathers if is_fp32(r.dtype)]
    share = sum(r.bytes for r in fp32) / sum(r.bytes for r in gathers)
    if share < FP32_BYTES_SHARE or lg.window_us <= 0:
        return []
    exposed = sum(r.exposed_us for r in fp32)
    if exposed < EXPOSED_STEP_SHARE * lg.window_us:
        return []
    remedy = bf16_remedy(ctx)
    if remedy is None:
        return []  # the run already gathers in bf16: these fp32 gathers are not its parameters
    n_steps = max(1, len(lg.steps) or len({r.step for r in fp32}))
    gain_ms, method = _gain(ctx, gathers, fp32, exposed, n_steps)
    return [
        Finding(
            id="fp32-collectives",
            severity="info",
            title=f"{share:.0%} of all-gathered parameter bytes are fp32",
            ranks=[x.rank for x in ledgers],
            steps=list(lg.steps),
            evidence={
                "fp32_gather_bytes_per_step": int(sum(r.bytes for r in fp32) / n_steps),
                "fp32_bytes_share": round(share, 3),
                "exposed_fp32_gather_ms_per_step": round(exposed / 1e3 / n_steps, 3),
                "window_ms": round(lg.window_us / 1e3, 3),
            },
            recommendation=(
                _sentence(remedy.text)
                + ": half the all-gather bytes and half the unsharded parameter memory."
            ),
            code=remedy.code,
            expected_gain_ms=None if gain_ms is None else round(gain_ms, 3),
            expected_gain_bytes=int(max((r.bytes for r in fp32), default=0) / 2),
            gain_method=(method + "; " if method else "")
            + "bytes: half of the largest unit's unsharded parameters",
        )
    ]


def _sentence(clause: str) -> str:
    return clause[:1].upper() + clause[1:]


RULE = Rule(
    id="fp32-collectives",
    summary="FSDP all-gathers move fp32 parameters where bf16 would serve",
    detect=detect,
    what=(
        "FSDP all-gathers move fp32 parameters: >= 50% of the gathered bytes are fp32 and "
        "their exposed time is >= 10% of the profiled window, in a run that does not already "
        "gather in bf16 (severity info)."
    ),
    why=(
        "Parameters gathered for compute in bf16 are enough for the forward and backward math "
        "of mixed-precision training (fp32 shards and fp32 gradient reduction stay): half the "
        "bytes on the wire and in the unsharded parameter memory."
    ),
    example="100% of all-gathered parameter bytes are fp32 (FSDP2 without a MixedPrecisionPolicy).",
    fix="`MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`.",
    gain=(
        "Replayed (`zdiag whatif --param-dtype bf16`): each FSDP all-gather keeps its lane's "
        "fitted latency and moves half its bytes, compute kept as measured (bf16 math is "
        "faster on GPUs: a lower bound). None on a CPU-only run, where bf16 moves the math to "
        "a speed the fp32 trace does not show. Without modelled steps, half the bytes at the "
        "fitted bandwidth x the measured exposed share."
    ),
    scope="FSDP2, FSDP1 and ZeRO runs whose trace records the collectives' dtype",
    fsdp_only=True,
    thresholds=(
        Threshold(
            "FP32_BYTES_SHARE",
            FP32_BYTES_SHARE,
            "Worth saying only when the fp32 gathers matter: at least this share of the "
            "gathered bytes is fp32 (the evidence's fp32_bytes_share is compared with it) ...",
        ),
        Threshold(
            "EXPOSED_STEP_SHARE",
            EXPOSED_STEP_SHARE,
            "... and their exposed time is at least this share of the window (below, halving "
            "it is noise).",
        ),
    ),
    markers=(),
)
