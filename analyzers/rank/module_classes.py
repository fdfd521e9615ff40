"""The repeated block class of a model, from a `with_stack` trace's `nn.Module: <Class>_<k>`
events: a fact of one rank's trace, computed by the map (rank_analysis.py) and read by the
wrap detectors through `RankFacts.module_class`."""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np

from ..inputs.events import EnclosingIndex, EventKind, RankTrace

_MODULE_EVENT_RE = re.compile(r"^nn\.Module: (?P<cls>[A-Za-z_]\w*)_(?P<idx>\d+)$")


def repeated_module_class(trace: RankTrace) -> tuple[str, int] | None:
    """(class name, instances) of the repeated block class in a `with_stack` trace's
    `nn.Module: <Class>_<k>` events, None when no class appears twice.

    The block is the outermost repeated class: one whose calls no call of another repeated class
    encloses (on the same thread). A leaf layer (`Linear`, `Conv2d`) repeats more often but runs
    inside its block, so it is never chosen over the block; wrapping it is the tiny-layer
    anti-pattern. Among outermost classes, the one with the most instances wins.
    """
    ids: dict[int, str] = {}
    seen: dict[str, set[str]] = defaultdict(set)
    for nid, name in enumerate(trace.names):
        m = _MODULE_EVENT_RE.match(name)
        if m:
            ids[nid] = m.group("cls")
            seen[m.group("cls")].add(m.group("idx"))
    repeated = {cls for cls, idx in seen.items() if len(idx) >= 2}
    if not repeated:
        return None
    calls = trace.of_kind(EventKind.PYTHON_FUNCTION)
    calls = calls[np.isin(trace.name_id[calls], [n for n, c in ids.items() if c in repeated])]
    index = EnclosingIndex(trace, calls)
    enclosed: set[str] = set()
    for i in calls.tolist():
        cls = ids[int(trace.name_id[i])]
        if cls in enclosed:
            continue
        start, end = float(trace.ts_us[i]), float(trace.ts_us[i] + trace.dur_us[i])
        outer = [  # calls holding this one whole (a child starting at the same time does not)
            j
            for j in index.at(int(trace.lane_id[i]), start)
            if j != i
            and trace.dur_us[j] > trace.dur_us[i]
            and trace.ts_us[j] + trace.dur_us[j] >= end
        ]
        if any(ids[int(trace.name_id[j])] != cls for j in outer):
            enclosed.add(cls)
    outermost = sorted(repeated - enclosed) or sorted(repeated)
    best = max(outermost, key=lambda c: len(seen[c]))
    return best, len(seen[best])
