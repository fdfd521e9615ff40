"""The repeated block of a model, read from module names (FSDP unit fqns, manifest, harness).

Transformer-like models hold a list of identical blocks: `layers.0`, `layers.1`, ...
(`model.layers[i]`), `transformer.h.3`, `blocks.7`. The repeated block is the longest prefix
`<list>.<N>` shared by several indices; recommendations name it (`model.layers`) through
`detectors/facts.py`'s `block_set` and the framework remedies (analyzers/frameworks/).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..events import EnclosingIndex, EventKind, RankTrace

_INDEX_RE = re.compile(r"^(?P<list>(?:[A-Za-z_][\w]*\.)*?[A-Za-z_][\w]*)\.(?P<idx>\d+)(?:\.|$)")


@dataclass(frozen=True)
class BlockPattern:
    """A repeated block: `list_path` ("layers") with `count` instances seen."""

    list_path: str
    count: int

    @property
    def pattern(self) -> str:
        """Display form: "layers.N"."""
        return f"{self.list_path}.N"

    def block_of(self, name: str) -> str | None:
        """The block instance ("layers.3") a module name lies in, None outside every block."""
        m = _INDEX_RE.match(name)
        if m and m.group("list") == self.list_path:
            return f"{self.list_path}.{m.group('idx')}"
        return None


def find_block_pattern(names: Iterable[str]) -> BlockPattern | None:
    """The repeated block among module names: the `<list>.<N>` prefix with the most distinct
    indices (at least 2), None when no name carries an index."""
    indices: dict[str, set[str]] = defaultdict(set)
    for name in names:
        m = _INDEX_RE.match(name)
        if m:
            indices[m.group("list")].add(m.group("idx"))
    best = max(indices.items(), key=lambda kv: (len(kv[1]), -len(kv[0])), default=None)
    if best is None or len(best[1]) < 2:
        return None
    return BlockPattern(best[0], len(best[1]))


def harness_block_pattern(harness: dict[str, object]) -> BlockPattern | None:
    """zdiag's harness names its blocks `layers.N` (torchtitan's Llama): from its options."""
    layers = harness.get("layers")
    if isinstance(layers, int) and 2 <= layers <= 100_000:  # a damaged manifest's 2**51 is none
        return BlockPattern("layers", layers)
    return None


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
