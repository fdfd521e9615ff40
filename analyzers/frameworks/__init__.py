"""What zdiag knows about each training framework, one module per framework.

`REGISTRY` lists them in recognition order. Each module (fsdp2.py, fsdp1.py, deepspeed.py,
ddp.py) holds its framework's labels, unit naming, step markers and the remedies the detectors
print (base.py: `Framework`, `RunFacts`, `BlockSet`, `Remedy`). Adding a framework is one module
that builds a `Framework` plus one line in `REGISTRY` (ddp.py is the example).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ...collectors.run_records import Manifest
from . import ddp, deepspeed, fsdp1, fsdp2
from .base import BlockSet, Framework, FsdpMesh, Remedy, RunFacts, checkpoint_blocks

REGISTRY: tuple[Framework, ...] = (
    fsdp2.FRAMEWORK,
    fsdp1.FRAMEWORK,
    deepspeed.FRAMEWORK,
    ddp.FRAMEWORK,
)
"""Every known framework, in recognition order (FSDP2 labels win over the others)."""

BY_NAME: dict[str, Framework] = {fw.name: fw for fw in REGISTRY}


def get(name: str | None, default: str = fsdp2.NAME) -> Framework:
    """The framework called `name` ("fsdp2", ...), `default`'s when unknown or None."""
    return BY_NAME.get(name or default) or BY_NAME[default]


def annotation_re() -> re.Pattern[str]:
    """One regex (re.match) for every framework's own record_function labels."""
    parts = [f"(?:{fw.annotation_re.pattern})" for fw in REGISTRY if fw.annotation_re is not None]
    return re.compile("|".join(parts))


def forward_markers() -> tuple[str, ...]:
    """Every framework's once-per-forward label regexes, in registry order."""
    return tuple(m for fw in REGISTRY for m in fw.forward_markers)


def from_trace(names: Iterable[str]) -> Framework | None:
    """The first registered framework whose labels occur among a trace's event names."""
    names = list(names)
    return next((fw for fw in REGISTRY if fw.recognises(names)), None)


def from_manifest(manifest: Manifest | None) -> Framework | None:
    """The framework a run manifest records: `run_info["framework"]` when a script says so, a
    package version it names (DeepSpeed), or FSDP2 for zdiag's harness; None when unknown."""
    if manifest is None:
        return None
    named = manifest.run_info.get("framework")
    if isinstance(named, str) and named in BY_NAME:
        return BY_NAME[named]
    for fw in REGISTRY:
        if any(p in manifest.versions for p in fw.manifest_packages):
            return fw
    return fsdp2.FRAMEWORK if manifest.harness else None


__all__ = [
    "BY_NAME",
    "REGISTRY",
    "BlockSet",
    "Framework",
    "FsdpMesh",
    "Remedy",
    "RunFacts",
    "annotation_re",
    "checkpoint_blocks",
    "forward_markers",
    "from_manifest",
    "from_trace",
    "get",
]
