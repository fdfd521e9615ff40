"""The run's configuration as a flat table of words: what `zdiag diff` compares key by key.

`run_config(manifest, description, ranks)` reads what the run recorded (the manifest: command,
hosts, device, versions; the model description captured from the live model: model class and
size, framework, mesh, each unit's sharding, prefetch and precision settings) and what every
trace says (device kind, hosts). Each value is a short string or a number, so that two runs'
tables compare with `==` and print on one line. Keys with nothing recorded are left out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from ...collectors.model_schema import Fsdp2Unit, ModelDescription, Precision
from ...collectors.run_records import Manifest

MAX_VALUE_CHARS = 160
"""A longer value (a long command line) is cut, with "…"."""


def _short(value: str) -> str:
    return value if len(value) <= MAX_VALUE_CHARS else value[: MAX_VALUE_CHARS - 1] + "…"


OUT_OPTIONS = ("--out", "-o")
"""`zdiag run` options naming the run directory: every run's differs, so they are left out."""


def _without_out(command: Sequence[str]) -> list[str]:
    """The command line without its run-directory option (`--out DIR`, `--out=DIR`)."""
    out: list[str] = []
    skip = False
    for token in command:
        if skip:
            skip = False
            continue
        if token in OUT_OPTIONS:
            skip = True
            continue
        if token.startswith("--out="):
            continue
        out.append(token)
    return out


def _tally(values: Iterable[Any], total: int) -> str:
    """ "X" when every one of `total` items has X, else "X on 3 of 8, Y on 5 of 8"."""
    counts = Counter(str(v) for v in values)
    if len(counts) == 1 and sum(counts.values()) == total:
        return next(iter(counts))
    return ", ".join(f"{v} on {n} of {total}" for v, n in sorted(counts.items()))


def _prefetch(units: Sequence[Fsdp2Unit], attr: str, unset: str) -> str:
    """How the units' explicit prefetch lists read: "set on 3 of 5 units", "off" when units
    list only themselves (that prefetches nothing and switches off FSDP2's implicit backward
    prefetch), else `unset`."""
    lists = [(u.path, getattr(u, attr) or ()) for u in units]
    explicit = sum(1 for path, targets in lists if set(targets) - {path})
    self_only = sum(1 for path, targets in lists if targets and set(targets) == {path})
    if explicit:
        return f"set on {explicit} of {len(units)} units"
    if self_only:
        return f"off (each of {self_only} units prefetches only itself)"
    return unset


def _precision(p: Precision | None) -> str:
    if p is None:
        return "none"
    return f"param {p.param_dtype or 'as stored'}, reduce {p.reduce_dtype or 'as param'}"


def _model_keys(d: ModelDescription) -> dict[str, Any]:
    out: dict[str, Any] = {"framework": d.framework}
    if d.model_class:
        out["model class"] = d.model_class
    if d.param_count:
        out["parameters"] = d.param_count
    if d.mesh is not None and d.mesh.shape:
        names = d.mesh.dim_names or tuple(f"dim{i}" for i in range(len(d.mesh.shape)))
        out["mesh"] = " x ".join(f"{n}={s}" for n, s in zip(names, d.mesh.shape, strict=False))
    units = d.fsdp2_units
    if units:
        n = len(units)
        out["fsdp2 units"] = d.fsdp2_units_total or n
        out["fsdp2 unit paths"] = _short(", ".join(u.path or "(root)" for u in units))
        out["fsdp2 reshard_after_forward"] = _tally((u.reshard_after_forward for u in units), n)
        out["fsdp2 forward prefetch"] = _prefetch(units, "forward_prefetch", "none set")
        out["fsdp2 backward prefetch"] = _prefetch(units, "backward_prefetch", "default")
        out["fsdp2 mixed precision"] = _tally((_precision(u.mixed_precision) for u in units), n)
        if any(u.unshard_async_op is not None for u in units):
            out["fsdp2 unshard async op"] = _tally((u.unshard_async_op for u in units), n)
    if d.fsdp1:
        n = len(d.fsdp1)
        out["fsdp1 instances"] = n
        out["fsdp1 wrapped"] = _short(", ".join(i.path or "(root)" for i in d.fsdp1))
        out["fsdp1 sharding strategy"] = _tally((i.sharding_strategy for i in d.fsdp1), n)
        out["fsdp1 forward prefetch"] = _tally((i.forward_prefetch for i in d.fsdp1), n)
        out["fsdp1 backward prefetch"] = _tally((i.backward_prefetch for i in d.fsdp1), n)
    if d.deepspeed is not None:
        ds = d.deepspeed
        for key in ("zero_stage", "prefetch_bucket_size", "overlap_comm", "reduce_bucket_size"):
            value = getattr(ds, key)
            if value is not None:
                out[f"deepspeed {key}"] = value
    if d.pipeline is not None:
        scheds = ", ".join(f"{s.cls} x{s.n_microbatches}" for s in d.pipeline.schedules)
        out["pipeline"] = _short(
            f"{len(d.pipeline.stages)} stage(s) here; {scheds or 'no schedule'}"
        )
    return out


def run_config(
    manifest: Manifest | None,
    description: ModelDescription | None,
    devices: Sequence[str],
    hosts: Sequence[str | None],
) -> dict[str, Any]:
    """The flat configuration table (see the module docstring); `devices` and `hosts` are each
    analyzed rank's, from its trace."""
    out: dict[str, Any] = {}
    kinds = sorted({d for d in devices if d and d != "unknown"})
    if kinds:
        out["device"] = ", ".join(kinds)
    named_hosts = sorted({h for h in hosts if h})
    if manifest is not None:
        out["world size"] = manifest.world_size
        out["nodes"] = manifest.nnodes
        if manifest.backend:
            out["backend"] = manifest.backend
        if manifest.command:
            out["command"] = _short(" ".join(_without_out(manifest.command)))
        for name, version in sorted(manifest.versions.items()):
            if version:
                out[f"{name} version"] = str(version)
        for name, value in sorted((manifest.harness or {}).items()):
            if isinstance(value, str | int | float | bool) or value is None:
                out[f"harness {name}"] = value if not isinstance(value, str) else _short(value)
        named_hosts = sorted(set(named_hosts) | set(manifest.hosts))
    if named_hosts:
        out["hosts"] = _short(", ".join(named_hosts))
    if description is not None:
        out.update(_model_keys(description))
    return out
