"""How every renderer writes numbers: durations, sizes, shares, lists of ranks, evidence values.

The one place that decides precision and units, so text, the TUI, HTML and Perfetto show the
same value the same way. Pure functions of their arguments; no Report knowledge beyond `Finding`
(for `fmt_gain`).

- Durations are milliseconds with a precision that follows their size (`fmt_ms`).
- Sizes are binary units (B, KiB, MiB, GiB, TiB). An unknown size is `None` and prints as
  "unknown", never as "0 B": the analysis records 0 bytes for collectives whose size the trace
  did not say (gloo without shapes), so `known_bytes` turns "0 bytes over N > 0 calls" into None.
- Shares are whole percentages of a total, "-" when the total is not positive.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from zdiag.analyzers.report import Finding

UNKNOWN = "unknown"
"""What an unknown size (or other value the trace did not record) prints as."""

NONE_SHOWN = "—"
"""A value that does not apply (no steps, no gain)."""

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_number(value: float) -> str:
    """A duration-like number without unit: 3 significant digits or more, thousands separated.

    1234.5 -> "1,234", 12.34 -> "12.3", 4.567 -> "4.57", 0.1234 -> "0.123", 0 -> "0".
    """
    if not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    if value == 0:
        return "0"
    return f"{value:.3f}"


def fmt_ms(value: float | None, *, unit: bool = True) -> str:
    """A duration in milliseconds ("12.3 ms"; "12.3" with unit=False for table cells; "—" for None)."""
    if value is None:
        return NONE_SHOWN
    shown = fmt_number(value)
    return f"{shown} ms" if unit else shown


def known_bytes(total_bytes: int | None, count: int) -> int | None:
    """`total_bytes`, or None (unknown) when `count` > 0 operations recorded 0 bytes in all."""
    if total_bytes is None or (total_bytes == 0 and count > 0):
        return None
    return total_bytes


def fmt_bytes(value: int | float | None) -> str:
    """A size in binary units ("1.5 GiB", "512 B"); None (unknown) prints as "unknown"."""
    if value is None or not math.isfinite(value):
        return UNKNOWN
    size = float(value)
    for unit in _BYTE_UNITS:
        if abs(size) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def fmt_share(part: float, whole: float) -> str:
    """`part` as a whole percentage of `whole` ("42%"); "-" when `whole` is not positive."""
    return f"{100.0 * part / whole:.0f}%" if whole > 0 else "-"


def fmt_list(values: Sequence[int] | Sequence[str], limit: int = 12) -> str:
    """A short comma list of at most `limit` items, then "… (+N more)"."""
    shown = ", ".join(str(v) for v in values[:limit])
    if len(values) > limit:
        shown += f", … (+{len(values) - limit} more)"
    return shown


def fmt_ints(values: Sequence[int], limit: int = 12) -> str:
    """Integers as compact runs ("0–3, 7, 9–19"), at most `limit` runs then '… (+N more)'."""
    runs: list[tuple[int, int]] = []
    for v in sorted(set(values)):
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    parts = [str(a) if a == b else f"{a}–{b}" for a, b in runs]
    return fmt_list(parts, limit)


def fmt_ranks(ranks: Sequence[int]) -> str:
    """ "rank 3" or "ranks 0–7, 9" (runs collapsed)."""
    if len(set(ranks)) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {fmt_ints(ranks)}"


def unit_label(name: str) -> str:
    """An FSDP unit's display name: the module fqn, or "(root)" for the root module."""
    return name if name else "(root)"


def fmt_value(value: object, limit: int = 6) -> str:
    """An evidence value for people: numbers like table cells (tiny ones, such as probabilities,
    with two significant digits instead of "0.000"), dicts and long lists shortened."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.2g}" if 0 < abs(value) < 0.01 else fmt_number(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, Mapping):
        items = list(value.items())
        shown = ", ".join(f"{k}: {fmt_value(v, limit)}" for k, v in items[:limit])
        return "{" + shown + (", …" if len(items) > limit else "") + "}"
    if isinstance(value, list | tuple):
        shown = ", ".join(fmt_value(v, limit) for v in value[:limit])
        return "[" + shown + (", …" if len(value) > limit else "") + "]"
    return str(value)


def fmt_gain(finding: Finding) -> str:
    """A finding's expected gain ("12.5 ms per step and 1.0 GiB of peak memory"; "" for none)."""
    gains = []
    if finding.expected_gain_ms is not None and finding.expected_gain_ms < 0:
        gains.append(f"a cost of {fmt_ms(-finding.expected_gain_ms)} per step")
    elif finding.expected_gain_ms is not None:
        gains.append(f"{fmt_ms(finding.expected_gain_ms)} per step")
    if finding.expected_gain_bytes is not None:
        gains.append(f"{fmt_bytes(finding.expected_gain_bytes)} of peak memory")
    return " and ".join(gains)


_UNIT_TOKENS = {"ms", "us", "bytes", "share", "fraction"}


def evidence_item(key: str, value: object) -> tuple[str, str]:
    """One evidence entry for people: a label without the unit token and the value with its unit.

    The unit comes from the key's naming convention (every Report number carries its unit in its
    name): `all_gather_ms_per_step=34.2` -> ("all gather per step", "34.2 ms"),
    `peak_bytes=2**30` -> ("peak", "1.0 GiB"), `serialized_share=1.0` -> ("serialized", "100%"),
    `alpha_us=12` -> ("alpha", "12.0 µs"). Keys without a unit keep their value as `fmt_value`
    writes it; a mapping of sizes (`category_bytes`) has each of its values formatted as a size.
    """
    tokens = key.split("_")
    unit = next((t for t in tokens if t in _UNIT_TOKENS), None)
    label_tokens = [t for t in tokens if t != unit] if unit else tokens
    label = " ".join("µs" if t == "us" else t for t in label_tokens) or key

    def one(v: object) -> str:
        if isinstance(v, bool) or not isinstance(v, int | float) or unit is None:
            return fmt_value(v)
        if unit == "ms":
            return fmt_ms(float(v))
        if unit == "us":
            return f"{fmt_number(float(v))} µs"
        if unit == "bytes":
            return fmt_bytes(v)
        return fmt_share(float(v), 1.0)  # share / fraction

    if isinstance(value, Mapping) and unit is not None:
        items = list(value.items())
        shown = ", ".join(f"{k}: {one(v)}" for k, v in items[:6])
        return label, shown + (", …" if len(items) > 6 else "")
    return label, one(value)
