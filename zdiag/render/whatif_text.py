"""`zdiag whatif` as text and as JSON (`zdiag.whatif/1`): predicted against measured, per rank."""

from __future__ import annotations

import json
import textwrap
from typing import Any

from zdiag.analyzers.whatif.run_whatif import WhatIfResult
from zdiag.render.format import fmt_bytes, fmt_ms

WHATIF_SCHEMA = "zdiag.whatif/1"
MAX_RANK_ROWS = 32
"""Rank rows in the text (the slowest predicted first); --json has every rank."""


def lane_label(lane: str) -> str:
    """A comm lane as shown: "<process group> <kind>", or the kind alone when the trace names
    no group."""
    group, _, kind = lane.rpartition("|")
    return f"{group} {kind}" if group else kind


def _pct(new: float, old: float) -> str:
    return f"{100.0 * (new - old) / old:+.1f}%" if old else "n/a"


def render_whatif_text(result: WhatIfResult, width: int = 100) -> str:
    """The text: the headline, the platform and fits, then the per-rank table."""
    r = result
    lines = [
        f"what-if {r.change.label()}: step {fmt_ms(r.measured_ms)} -> "
        f"{'at least ' if r.lower_bound else ''}{fmt_ms(r.predicted_ms)} "
        f"({_pct(r.predicted_ms, r.measured_ms)}), median over {len(r.ranks)} rank(s)",
    ]
    if r.memory_delta_bytes is None:
        lines.append(f"peak memory: {r.memory_basis}")
    else:
        sign = "+" if r.memory_delta_bytes >= 0 else "-"
        lines.append(
            f"peak memory: {sign}{fmt_bytes(abs(r.memory_delta_bytes))} per rank "
            f"(estimated: {r.memory_basis})"
        )
    worst = max(x.replay_error for x in r.ranks)
    lines.append(
        f"model check: the unchanged replay gives back the measured step within {worst:.2%}"
    )
    lines.append(f"platform: {r.platform.reason}")
    for f in r.fits:
        latency = f"{f.alpha_us:.0f} us + " if f.latency_known else "(one size: no latency) "
        lines.append(
            f"comm fit {lane_label(f.lane)}: {latency}{f.bytes_per_us / 1e3:.3g} GB/s, "
            f"{f.calls} calls, {f.sizes} sizes, median error {f.error:.0%}"
        )
    if r.overhead is not None:
        o = r.overhead
        lines.append(
            f"FSDP unit overhead fit: {o.c0_us / 1e3:.2f} ms + {o.us_per_byte * 2**20 / 1e3:.2f} "
            f"ms/MiB per unit and step, {o.units} unit-steps, median error {o.error:.0%}"
        )
    lines.extend(f"note: {n}" for n in r.notes)
    lines = [w for line in lines for w in textwrap.wrap(line, width, subsequent_indent="  ")]
    lines.append("")
    peaks = any(x.peak_bytes is not None for x in r.ranks)  # else the peak columns are left out
    head = (
        f"{'rank':>5} {'steps':>5} {'measured':>10} {'replayed':>10} {'predicted':>10} "
        f"{'change':>8} {'waited':>9} {'-> waited':>9}"
        + (f" {'peak':>10} {'-> peak':>10}" if peaks else "")
    )
    lines.append(head[:width])
    rows = sorted(r.ranks, key=lambda x: -x.predicted_ms)
    for x in rows[:MAX_RANK_ROWS]:
        row = (
            f"{x.rank:>5} {x.steps:>5} {fmt_ms(x.measured_ms):>10} {fmt_ms(x.replayed_ms):>10} "
            f"{fmt_ms(x.predicted_ms):>10} {_pct(x.predicted_ms, x.measured_ms):>8} "
            f"{fmt_ms(x.waited_ms):>9} {fmt_ms(x.predicted_waited_ms):>9}"
        )
        if peaks:
            row += f" {fmt_bytes(x.peak_bytes):>10} {fmt_bytes(x.predicted_peak_bytes):>10}"
        lines.append(row[:width])
    if len(rows) > MAX_RANK_ROWS:
        lines.append(f"(+{len(rows) - MAX_RANK_ROWS} more ranks in --json)")
    return "\n".join(lines) + "\n"


def whatif_json(result: WhatIfResult) -> dict[str, Any]:
    """The result as the versioned JSON object."""
    r = result
    return {
        "schema": WHATIF_SCHEMA,
        "change": r.change.label(),
        "measured_ms": round(r.measured_ms, 4),
        "predicted_ms": round(r.predicted_ms, 4),
        "gain_ms": round(r.gain_ms, 4),
        "predicted_is_lower_bound": r.lower_bound,
        "memory_delta_bytes": r.memory_delta_bytes,
        "memory_basis": r.memory_basis,
        "platform": {
            "device": r.platform.device,
            "gathers_overlap": r.platform.gathers_overlap,
            "reason": r.platform.reason,
        },
        "comm_fits": [
            {
                "lane": f.lane,
                "alpha_us": round(f.alpha_us, 3),
                "gb_per_s": round(f.bytes_per_us / 1e3, 4),
                "calls": f.calls,
                "sizes": f.sizes,
                "median_error": round(f.error, 4),
                "latency_known": f.latency_known,
            }
            for f in r.fits
        ],
        "unit_overhead_fit": None
        if r.overhead is None
        else {
            "c0_ms": round(r.overhead.c0_us / 1e3, 4),
            "ms_per_mib": round(r.overhead.us_per_byte * 2**20 / 1e3, 4),
            "unit_steps": r.overhead.units,
            "median_error": round(r.overhead.error, 4),
        },
        "notes": r.notes,
        "ranks": [
            {
                "rank": x.rank,
                "steps": x.steps,
                "measured_ms": round(x.measured_ms, 4),
                "replayed_ms": round(x.replayed_ms, 4),
                "predicted_ms": round(x.predicted_ms, 4),
                "waited_ms": round(x.waited_ms, 4),
                "predicted_waited_ms": round(x.predicted_waited_ms, 4),
                "peak_bytes": x.peak_bytes,
                "predicted_peak_bytes": x.predicted_peak_bytes,
            }
            for x in r.ranks
        ],
    }


def render_whatif_json(result: WhatIfResult) -> str:
    """The JSON text."""
    return json.dumps(whatif_json(result), indent=1) + "\n"
