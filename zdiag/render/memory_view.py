"""The memory views' shared content: per rank, the timeline with the peak marked, the categories
at the peak stacked, the capacity, top allocation sites and what-if predictions.

Text and the TUI draw from `memory_lines`; HTML draws the same timeline as a plotly figure
(`_html_figures.memory`) and the rest from `memory_lines` too. Sizes go through
`format.fmt_bytes` (binary units chosen per value: MiB for a CPU harness, GiB on a GPU).
"""

from __future__ import annotations

from zdiag.analyzers.report import MemoryBreakdown, MemoryTimeline, Report
from zdiag.render.format import fmt_bytes, fmt_share

CATEGORY_NAMES = {
    "OPTIMIZER_STATE": "optimizer state",
    "PARAMETER_UNSHARDED": "unsharded parameters",
    "GRADIENT": "gradients",
    "COMM_BUFFER": "communication buffers",
    "ACTIVATION": "activations",
    "AUTOGRAD_DETAIL": "autograd temporaries",
    "MODEL_STATE": "parameters",
    "PARAMETER": "parameters",
    "UNKNOWN": "unknown",
    "PREEXISTING": "before recording",
    "INPUT": "inputs",
    "TEMPORARY": "temporaries",
    "ALLOCATED": "allocated",
}
"""Display names of the memory categories (snapshot, memory timeline, Kineto)."""

SPARK = " ▁▂▃▄▅▆▇█"
TIMELINE_WIDTH = 60
BAR_WIDTH = 60
MAX_RANKS = 4
MAX_SITES = 5
LETTERS = {
    "ACTIVATION": "A",
    "OPTIMIZER_STATE": "O",
    "MODEL_STATE": "P",
    "PARAMETER": "P",
    "PARAMETER_UNSHARDED": "U",
    "GRADIENT": "G",
    "AUTOGRAD_DETAIL": "T",
    "TEMPORARY": "t",
    "COMM_BUFFER": "C",
    "PREEXISTING": "B",
    "INPUT": "I",
    "UNKNOWN": "?",
}
"""One letter per category in the text bars (the legend spells them out)."""


def category_name(category: str) -> str:
    """The display name of a category."""
    return CATEGORY_NAMES.get(category, category.lower().replace("_", " "))


def _series_total(tl: MemoryTimeline) -> list[int]:
    n = len(tl.times_ms)
    return [sum(v[i] for v in tl.bytes_by_category.values() if i < len(v)) for i in range(n)]


def _level(v: float, top: float) -> str:
    """The sparkline character for `v` on a scale whose top is `top` (> 0): values below 0
    (a damaged history) draw as the lowest, above the top as the highest."""
    frac = min(max(v, 0), top) / top
    return SPARK[min(len(SPARK) - 1, max(0, round(frac * (len(SPARK) - 1))))]


def timeline_lines(tl: MemoryTimeline, width: int = TIMELINE_WIDTH) -> list[str]:
    """A one-row sparkline of the total (max per column), scaled to the capacity when known,
    with the peak's column marked below it and the time span."""
    total = _series_total(tl)
    if not total or width < 1:
        return []
    n = len(total)
    cols = min(width, n)
    buckets = [
        max(total[c * n // cols : max(c * n // cols + 1, (c + 1) * n // cols)]) for c in range(cols)
    ]
    top = max(max(buckets), tl.capacity_bytes or 0, 1)
    spark = "".join(_level(v, top) for v in buckets)
    peak_col = max(range(cols), key=lambda c: buckets[c])
    peak_i = max(range(n), key=lambda i: total[i])
    scale = f"top = capacity {fmt_bytes(tl.capacity_bytes)}" if tl.capacity_bytes else "top = peak"
    t0 = tl.times_ms[0]
    span = tl.times_ms[-1] - t0
    unit = "events" if "event order" in tl.source else "ms"
    return [
        f"    |{spark}|  {scale}",
        f"     {' ' * peak_col}^ peak {fmt_bytes(total[peak_i])} at {tl.times_ms[peak_i] - t0:.1f} {unit}"
        f" (of {span:.1f} {unit})",
    ]


def stacked_bar(
    categories: dict[str, int],
    whole: int,
    width: int = BAR_WIDTH,
    now: dict[str, int] | None = None,
) -> list[str]:
    """The categories as one bar of letters (largest first) and its legend; with `now`, each
    category's bytes at the end of the recording beside its bytes in the bar."""
    items = sorted(((c, v) for c, v in categories.items() if v > 0), key=lambda kv: -kv[1])
    if not items or whole <= 0:
        return []
    if now is not None:
        items += [
            (c, 0)
            for c, v in sorted(now.items(), key=lambda kv: -kv[1])
            if v > 0 and c not in categories
        ]
    bar = ""
    legend = []
    for c, v in items:
        letter = LETTERS.get(c, ".")
        bar += letter * round(min(v, whole) / whole * width)  # (a part beyond the whole: cut)
        line = f"{letter} {category_name(c):<22} {fmt_bytes(v):>10} ({fmt_share(v, whole):>4})"
        if now is not None:
            line += f"   now {fmt_bytes(now.get(c, 0)):>10}"
        legend.append(line)
    return [f"    [{bar[:width].ljust(width)}]", *("      " + x for x in legend)]


def breakdown_lines(b: MemoryBreakdown) -> list[str]:
    """One rank's breakdown: now vs peak, fragmentation, sites, what-if."""
    out = [
        f"  Rank {b.rank} ({b.source}{f', cuda:{b.device}' if b.device is not None else ''})"
        f"{' - OUT OF MEMORY' if b.oom else ''}"
    ]
    frag = (
        f", {fmt_bytes(b.fragmented_bytes)} free beside live blocks" if b.fragmented_bytes else ""
    )
    out.append(
        f"    now: {fmt_bytes(b.allocated_bytes)} allocated of {fmt_bytes(b.reserved_bytes)} "
        f"reserved{frag}; capacity {fmt_bytes(b.capacity_bytes)}"
    )
    if b.oom_request_bytes:
        out.append(f"    failed allocation: {fmt_bytes(b.oom_request_bytes)}")
    where = (
        f"at {b.peak_time_ms:.1f} ms into the recorded history"
        if b.peak_time_ms is not None
        else ("replayed from the history" if b.peak_at == "replayed" else "the end state")
    )
    reserved = (
        f", {fmt_bytes(b.peak_reserved_bytes)} reserved"
        if b.peak_reserved_bytes is not None
        else ""
    )
    out.append(
        f"    peak: {fmt_bytes(b.peak_bytes)}{reserved} ({where}; {b.history_events} events)"
    )
    if b.peak_category_bytes:
        out.append("    by category at the peak (and now):")
    out += stacked_bar(b.peak_category_bytes, b.peak_bytes or 0, now=b.category_bytes)
    if b.preexisting_inferred:
        out.append(f"      ({category_name('PREEXISTING')}: {b.preexisting_inferred})")
    if b.blocks and not b.blocks_with_stacks and b.source.startswith("snapshot"):
        out.append("    (no allocation stacks: categories unknown)")
    if b.top_sites:
        out.append("    top allocation sites at the peak:")
        out += [
            f"      {fmt_bytes(s.bytes):>10}  {s.blocks:>5} blocks  {s.site}  "
            f"({category_name(s.category)})"
            for s in b.top_sites[:MAX_SITES]
        ]
    if b.what_if:
        out.append("    what if (predicted peak):")
        for w in b.what_if:
            fits = "" if w.fits is None else ("  fits" if w.fits else "  does not fit")
            out.append(f"      {w.change}: {fmt_bytes(w.predicted_peak_bytes)}{fits}")
            out.append(f"        {w.arithmetic}")
    return out


def memory_lines(report: Report, max_ranks: int = MAX_RANKS) -> list[str]:
    """The report's memory section (empty when it has no memory data)."""
    if not report.memory and not report.memory_breakdowns:
        return []
    out = ["", "Memory"]
    timelines = {tl.rank: tl for tl in report.memory}
    ranks = sorted({*timelines, *(b.rank for b in report.memory_breakdowns)})
    breakdowns = {b.rank: b for b in report.memory_breakdowns}
    if len(ranks) > 1:
        peaks = [
            (r, breakdowns[r].peak_bytes if r in breakdowns else timelines[r].peak_bytes)
            for r in ranks
        ]
        out.append(
            "  peak by rank: "
            + ", ".join(f"{r}: {fmt_bytes(p)}" for r, p in peaks[:16])
            + (" ..." if len(peaks) > 16 else "")
        )
    for r in ranks[:max_ranks]:
        b = breakdowns.get(r)
        tl = timelines.get(r)
        if b is not None:
            out += breakdown_lines(b)
        elif tl is not None:
            out.append(f"  Rank {r} ({tl.source}){' - OUT OF MEMORY' if tl.oom else ''}")
            out.append(
                f"    peak: {fmt_bytes(tl.peak_bytes)}; capacity {fmt_bytes(tl.capacity_bytes)}"
            )
            out += stacked_bar(tl.peak_category_bytes, tl.peak_bytes)
        if tl is not None:
            out.append("    timeline:")
            out += timeline_lines(tl)
    if len(ranks) > max_ranks:
        out.append(f"  (the first {max_ranks} of {len(ranks)} ranks; all are in --json)")
    return out
