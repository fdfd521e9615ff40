"""Host syncs attributed to their caller, from one rank's trace.

A host sync (`.item()`: `aten::_local_scalar_dense`, with `aten::item` around it; a CUDA
stream/device synchronize: the trace's sync events) blocks the host until the device catches up.
Where it comes from decides who can remove it:

- the optimizer's own internals: syncs inside an `Optimizer.step#<Class>.step` range (AdamW
  reads its step counter with `.item()` when `capturable=False`): not the user's to remove;
- a sync inside an FSDP unit's forward (between `FSDP::pre_forward (<fqn>)` and
  `FSDP::post_forward (<fqn>)`) or backward (between `FSDP::pre_backward (<fqn>)` and
  `FSDP::post_backward_* (<fqn>)`) on the same thread: the user's code in that module (a
  per-block `.item()`, a NaN check); the innermost unit range gets it. The root unit's ranges
  carry no path (`FSDP::pre_forward`): its own code (a Hugging Face model's mask building, its
  head) is the unit "" (the root);
- a sync inside DDP's `DistributedDataParallel.forward` or FSDP1's
  `FullyShardedDataParallel.forward` range: the user's model code (no module name there);
- on DeepSpeed ZeRO-3, which records no forward range, a sync between the first and the last of
  a step's forward-time ZeRO-3 autograd Functions (`PreBackwardFunctionForModule`, ... applied by
  its module hooks; their backward nodes end in `Backward`) on the same thread: the model's code;
  ZeRO-1/2 traces have no such marks and their model syncs count as the loop's;
- anything else: the training loop (loss logging, metrics).

With stacks (`with_stack=True`) the innermost enclosing Python frame outside torch and the
standard library names the source line (`file.py(28): forward`): the user's own code
(`source_lines`), or a library's (`library_lines`, e.g. transformers' `masking_utils.py`), which
the user cannot edit. The profiler trims `sys.path` prefixes off its file names, so a library's
file usually reads `transformers/masking_utils.py` and the standard library's `typing.py`
(`_library_of`, `_framework_file`). Only what the map reads from the trace is kept (counts per
caller, the time the syncs block, source lines): the reduce sees no traces.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from collections import Counter

import msgspec
import numpy as np

from ..frameworks.deepspeed import AUTOGRAD_FUNCTION_RE
from ..inputs.events import EventKind, RankTrace

HOST_SYNC_NAMES = ("aten::_local_scalar_dense", "aten::item")
"""Host ops that block the CPU on a device value (`.item()`); counted with CPU_SYNC events."""

OPTIMIZER_PREFIX = "Optimizer.step#"
MODEL_FORWARD_RANGES = ("DistributedDataParallel.forward", "FullyShardedDataParallel.forward")
"""Wrapper forward ranges that enclose the model's own forward (DDP, FSDP1: no unit names)."""
_UNIT_OPEN = re.compile(r"^FSDP::pre_(forward|backward)(?: \((.*)\))?$")
_UNIT_CLOSE = re.compile(r"^FSDP::post_(forward|backward)[a-z_]*(?: \((.*)\))?$")
"""A unit's range opens and closes; the root's names carry no module path (`FSDP::pre_forward`)."""
_PY_FRAME = re.compile(r"^(?P<file>[^()]+\.py)\((?P<line>\d+)\): (?P<func>.+)$")
_FRAMEWORK_PATH = re.compile(
    r"(^|/)torch/|(^|/)lib/python3[.\d]*/(?!site-packages/|dist-packages/)"
)
"""torch's own files and the standard library's: never a sync's source line."""
_LIBRARY_PATH = re.compile(r"(^|/)(?:site-packages|dist-packages)/(?P<package>[^/]+)/")
"""An installed package's file: its package directory names the library."""
KNOWN_LIBRARIES = frozenset(
    {
        "accelerate", "apex", "datasets", "deepspeed", "diffusers", "einops", "fairscale",
        "flash_attn", "lightning", "megatron", "numpy", "open_clip", "peft", "pytorch_lightning",
        "sentence_transformers", "timm", "tokenizers", "torchaudio", "torchmetrics", "torchrec",
        "torchtitan", "torchtune", "torchvision", "transformer_engine", "transformers", "trl",
        "xformers",
    }
)  # fmt: skip
"""Libraries recognised by name in a frame whose path the profiler trimmed (see `_library_of`)."""
_SCRIPT_NAMES = frozenset({"code", "profile", "test", "trace"})
"""Standard-library module names a user's own script is often called: as a lone file
(`test.py`, trimmed like the standard library's), it stays the user's."""
MAX_SOURCE_LINES = 20
"""Distinct source lines kept per rank (the most frequent)."""


class HostSyncSites(msgspec.Struct, kw_only=True):
    """One rank's host syncs by caller (counts over the trace) and the time they block."""

    total: int = 0
    optimizer: dict[str, int] = msgspec.field(default_factory=dict)  # range name -> syncs
    units: dict[str, int] = msgspec.field(default_factory=dict)  # FSDP unit fqn -> syncs
    model_forward: int = 0  # inside a DDP / FSDP1 forward range or ZeRO-3's forward marks
    loop: int = 0  # elsewhere: the training loop
    model_blocked_ms: float = 0.0  # host time of the syncs inside the model (units, forward)
    blocked_ms: float = 0.0  # host time of every sync (optimizer and loop included)
    source_lines: dict[str, int] = msgspec.field(default_factory=dict)  # "file.py:28 func" -> n
    # the same for syncs whose innermost frame is a library's: "transformers: file.py:28 func"
    library_lines: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def in_model(self) -> int:
        """Syncs inside the model's forward/backward (units or DDP forward)."""
        return sum(self.units.values()) + self.model_forward


def sync_events(trace: RankTrace) -> np.ndarray:
    """Indices of the host-sync events (the inner `_local_scalar_dense` when both it and
    `aten::item` are recorded), plus CPU sync events, in start order."""
    ids = [i for i, name in enumerate(trace.names) if name in HOST_SYNC_NAMES]
    picked = np.empty(0, dtype=np.int64)
    if ids:
        inner = [i for i in ids if trace.names[i] == "aten::_local_scalar_dense"]
        picked = np.flatnonzero(np.isin(trace.name_id, np.asarray(inner or ids, dtype=np.int32)))
    out = np.union1d(picked, trace.of_kind(EventKind.CPU_SYNC))
    return out[np.argsort(trace.ts_us[out], kind="stable")] if len(out) else out


def _unit_spans(trace: RankTrace) -> list[tuple[int, float, float, str]]:
    """(lane, start, end, fqn) of each FSDP unit's forward and backward compute."""
    opens: dict[tuple[int, str, str], list[float]] = {}
    spans: list[tuple[int, float, float, str]] = []
    order = np.argsort(trace.ts_us, kind="stable")
    interesting = {
        nid
        for nid, name in enumerate(trace.names)
        if _UNIT_OPEN.match(name) or _UNIT_CLOSE.match(name)
    }
    if not interesting:
        return spans
    sel = order[np.isin(trace.name_id[order], np.asarray(sorted(interesting), dtype=np.int32))]
    for i in sel:
        name = trace.names[int(trace.name_id[i])]
        lane = int(trace.lane_id[i])
        m = _UNIT_OPEN.match(name)
        if m:
            key = (lane, m.group(1), m.group(2) or "")
            opens.setdefault(key, []).append(float(trace.end_us[i]))
            continue
        c = _UNIT_CLOSE.match(name)
        if c:
            stack = opens.get((lane, c.group(1), c.group(2) or ""))
            if stack:
                spans.append((lane, stack.pop(), float(trace.ts_us[i]), c.group(2) or ""))
    return spans


def _ranges(trace: RankTrace, test: str) -> list[tuple[int, float, float, str]]:
    """(lane, start, end, name) of events whose name starts with `test`."""
    nids = [n for n, name in enumerate(trace.names) if name.startswith(test)]
    if not nids:
        return []
    idx = np.flatnonzero(np.isin(trace.name_id, np.asarray(nids, dtype=np.int32)))
    return [
        (
            int(trace.lane_id[i]),
            float(trace.ts_us[i]),
            float(trace.end_us[i]),
            trace.names[int(trace.name_id[i])],
        )
        for i in idx
    ]


def _zero3_forward_spans(trace: RankTrace) -> list[tuple[int, float, float, str]]:
    """(lane, start, end, "zero3-forward") per profiler step and thread: from the first to the
    last forward-time ZeRO-3 autograd Function of the step (none without ProfilerStep ranges)."""
    nids = [
        n
        for n, name in enumerate(trace.names)
        if AUTOGRAD_FUNCTION_RE.match(name) and not name.endswith("Backward")
    ]
    steps = _ranges(trace, "ProfilerStep#")
    if not nids or not steps:
        return []
    idx = np.flatnonzero(np.isin(trace.name_id, np.asarray(nids, dtype=np.int32)))
    spans = []
    for _lane, s0, s1, _name in steps:
        inside = idx[(trace.ts_us[idx] >= s0) & (trace.ts_us[idx] <= s1)]
        for lane in np.unique(trace.lane_id[inside]):
            on = inside[trace.lane_id[inside] == lane]
            spans.append(
                (int(lane), float(trace.ts_us[on].min()), float(trace.end_us[on].max()), "zero3")
            )
    return spans


def _innermost(spans: list[tuple[int, float, float, str]], lane: int, t: float) -> str | None:
    """The name of the latest-starting span on `lane` that contains `t`."""
    best: tuple[float, str] | None = None
    for ln, s, e, name in spans:
        if ln == lane and s <= t <= e and (best is None or s > best[0]):
            best = (s, name)
    return best[1] if best else None


def _library_of(file: str) -> str | None:
    """The library that owns a Python frame's file, or None for the user's own code.

    An absolute path is a library's when it lies in site-packages / dist-packages. torch's
    profiler trims the `sys.path` prefixes off the files it records, so an installed library's
    file usually reads `transformers/masking_utils.py`: a relative path is a library's when its
    top-level name is a well-known library (KNOWN_LIBRARIES) or, in this interpreter, imports from
    site-packages (an editable install of the user's own package does not)."""
    m = _LIBRARY_PATH.search(file)
    if m is not None:
        return m.group("package")
    if file.startswith(("/", "<", ".")) or "/" not in file:
        return None  # absolute outside site-packages, or a module beside the script
    top = file.split("/", 1)[0]
    return top if _installed_library(top) else None


@functools.lru_cache(maxsize=256)
def _installed_library(top: str) -> bool:
    if top in KNOWN_LIBRARIES:
        return True
    if not top.isidentifier():
        return False
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    origin = spec.origin if spec is not None else None
    return bool(origin and _LIBRARY_PATH.search(origin))


def _framework_file(file: str) -> bool:
    """torch's own files and the standard library's, absolute or trimmed by the profiler
    (`typing.py`, `json/encoder.py`): never a sync's source line."""
    if _FRAMEWORK_PATH.search(file):
        return True
    if file.startswith("/"):
        return False
    top = file.split("/", 1)[0].removesuffix(".py")
    return top in sys.stdlib_module_names and not ("/" not in file and top in _SCRIPT_NAMES)


def _source_line(
    frames: list[tuple[int, float, float, str]], lane: int, t: float
) -> tuple[str, str] | None:
    """The innermost enclosing Python frame outside torch and the standard library, as
    (`file:line func`, its library's package name or "" for the user's own code)."""
    best: tuple[float, str, str] | None = None
    for ln, s, e, name in frames:
        if ln != lane or not s <= t <= e:
            continue
        m = _PY_FRAME.match(name)
        if m is None or _framework_file(m.group("file")):
            continue
        if best is None or s > best[0]:
            where = f"{m.group('file')}:{m.group('line')} {m.group('func')}"
            best = (s, where, _library_of(m.group("file")) or "")
    return (best[1], best[2]) if best else None


def _callers(trace: RankTrace, idx: np.ndarray) -> list[tuple[str, str]]:
    """Each sync's caller, in `idx` order: ("optimizer", range name), ("unit", fqn),
    ("forward", "") inside a wrapper's forward range, or ("loop", "")."""
    units = _unit_spans(trace)
    optim = _ranges(trace, OPTIMIZER_PREFIX)
    fwd = [r for name in MODEL_FORWARD_RANGES for r in _ranges(trace, name)]
    fwd += _zero3_forward_spans(trace)
    out: list[tuple[str, str]] = []
    for i in idx:
        lane, t = int(trace.lane_id[i]), float(trace.ts_us[i])
        name = _innermost(optim, lane, t)
        fqn = _innermost(units, lane, t) if name is None else None
        if name is not None:
            out.append(("optimizer", name))
        elif fqn is not None:
            out.append(("unit", fqn))
        elif _innermost(fwd, lane, t) is not None:
            out.append(("forward", ""))
        else:
            out.append(("loop", ""))
    return out


def in_model_mask(trace: RankTrace, idx: np.ndarray) -> list[bool]:
    """For each sync of `idx` (`sync_events`), whether it is the model's own (inside an FSDP
    unit or a wrapper's forward): the syncs the `host-sync` finding asks to remove."""
    return [kind in ("unit", "forward") for kind, _ in _callers(trace, idx)]


def host_sync_sites(trace: RankTrace) -> HostSyncSites:
    """Every host sync of the trace attributed to its caller (see the module docstring)."""
    idx = sync_events(trace)
    sites = HostSyncSites(total=len(idx))
    if not len(idx):
        return sites
    frames: list[tuple[int, float, float, str]] = []
    if trace.names and len(trace.of_kind(EventKind.PYTHON_FUNCTION)):
        frames = [
            (int(trace.lane_id[i]), float(trace.ts_us[i]), float(trace.end_us[i]), trace.name(i))
            for i in trace.of_kind(EventKind.PYTHON_FUNCTION)
        ]
    opt: Counter[str] = Counter()
    unit: Counter[str] = Counter()
    lines: Counter[str] = Counter()
    library: Counter[str] = Counter()
    blocked_us = 0.0
    for i, (kind, name) in zip(idx, _callers(trace, idx), strict=True):
        sites.blocked_ms += float(trace.dur_us[i]) / 1000.0
        if kind == "optimizer":
            opt[name] += 1
            continue
        if kind == "unit":
            unit[name] += 1
        elif kind == "forward":
            sites.model_forward += 1
        else:
            sites.loop += 1
            continue
        blocked_us += float(trace.dur_us[i])
        if frames:
            found = _source_line(frames, int(trace.lane_id[i]), float(trace.ts_us[i]))
            if found is not None:
                where, package = found
                if package:
                    library[f"{package}: {where}"] += 1
                else:
                    lines[where] += 1
    sites.optimizer = dict(opt)
    sites.units = dict(unit)
    sites.model_blocked_ms = round(blocked_us / 1000.0, 4)
    sites.blocked_ms = round(sites.blocked_ms, 4)
    sites.source_lines = dict(lines.most_common(MAX_SOURCE_LINES))
    sites.library_lines = dict(library.most_common(MAX_SOURCE_LINES))
    return sites
