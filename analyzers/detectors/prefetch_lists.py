"""FSDP2 prefetch lists that name the unit itself: the off-by-one that turns prefetching off.

`blocks[i].set_modules_to_forward_prefetch([blocks[i]])` (meant: `[blocks[i + 1]]`) and
`blocks[i].set_modules_to_backward_prefetch([blocks[i]])` (meant: `[blocks[i - 1]]`) are legal
calls that prefetch nothing: a unit's own gather is issued when it runs anyway. The captured model
description (collectors/framework_settings.py) holds each unit's lists; the settings count such a
list as prefetching off (facts.py), and `missing-overlap` names the bug it sees before its remedy.
"""

from __future__ import annotations

from ..frameworks import Remedy
from ..inputs.model_facts import ModelFacts

DIRECTIONS = {
    "forward": ("set_modules_to_forward_prefetch", "blocks[i + 1]"),
    "backward": ("set_modules_to_backward_prefetch", "blocks[i - 1]"),
}
MAX_NAMED = 4  # units named in full; more are shown as "first, ..., last (N units)"


def self_prefetching(model: ModelFacts | None) -> dict[str, list[str]]:
    """Per direction ("forward", "backward"), the non-root units (in the description's order)
    whose prefetch list names only the unit itself; directions without one are left out."""
    out: dict[str, list[str]] = {}
    if model is None:
        return out
    for u in model.fsdp2_units:
        if not u.path:
            continue
        for direction, lst in (("forward", u.forward_prefetch), ("backward", u.backward_prefetch)):
            if lst and all(p == u.path for p in lst):
                out.setdefault(direction, []).append(u.path)
    return out


def _named(units: list[str]) -> str:
    if len(units) <= MAX_NAMED:
        return ", ".join(units)
    return f"{units[0]}, ..., {units[-1]} ({len(units)} units)"


def self_prefetch_text(found: dict[str, list[str]]) -> str:
    """The sentence naming the bug (empty when `found` is): which call prefetches the unit
    itself, on which units, and what was meant."""
    if not found:
        return ""
    calls = "; ".join(
        f"{direction}: {_named(units)} call `blocks[i].{DIRECTIONS[direction][0]}([blocks[i]])` "
        f"where `[{DIRECTIONS[direction][1]}]` was meant"
        for direction, units in found.items()
    )
    return (
        f"`blocks[i]` prefetches itself ({calls}): a unit's own gather is issued when it runs "
        "anyway, so this off-by-one turns prefetching off. "
    )


def name_self_prefetch(model: ModelFacts | None, remedy: Remedy | None) -> Remedy | None:
    """`remedy` led by the sentence that names a self-prefetch bug in the run's lists, its code
    by a comment saying which calls it replaces; `remedy` as it is when there is none."""
    found = self_prefetching(model)
    if remedy is None or not found:
        return remedy
    code = remedy.code
    if code is not None:
        replaced = "\n#   and ".join(f"blocks[i].{DIRECTIONS[d][0]}([blocks[i]])" for d in found)
        code = f"# replaces {replaced}:\n# a unit that prefetches itself prefetches nothing\n{code}"
    return Remedy(self_prefetch_text(found) + remedy.text, code)
