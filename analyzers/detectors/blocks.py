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
