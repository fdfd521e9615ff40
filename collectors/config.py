"""What the launcher tells each rank: the run directory and the profiler settings.

`zdiag run` serializes a `CollectorConfig` into environment variables; the bootstrap in each rank
reads it back. Only the standard library is imported here, so the launcher stays light.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from zdiag.errors import ConfigError

ENV_RUN_DIR = "ZDIAG_RUN_DIR"
ENV_CONFIG = "ZDIAG_CONFIG"

DEFAULT_PROFILE_STEPS = "1:1:3"
# Bounds on what one rank writes, so a long run cannot fill a disk.
DEFAULT_MAX_STEP_LOG_LINES = 100_000
DEFAULT_MAX_SNAPSHOT_ENTRIES = 100_000


def parse_profile_steps(text: str, *, option: str = "--profile-steps") -> tuple[int, int, int]:
    """Parse `WAIT:WARMUP:ACTIVE` (non-negative integers, ACTIVE at least 1)."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(
            f"{option} must be WAIT:WARMUP:ACTIVE with non-negative whole numbers "
            f"(e.g. {DEFAULT_PROFILE_STEPS}), not {text!r}."
        )
    wait, warmup, active = (int(p) for p in parts)
    if active < 1:
        raise ConfigError(f"{option}: ACTIVE must be at least 1 step, not {active}.")
    return wait, warmup, active


@dataclass(frozen=True)
class Flag:
    """How `zdiag run` sets a config field from its command line (zdiag/commands/run.py builds
    the option from this and the field's type and default).

    A bool field is a switch: `--x` when its default is False, `--no-x` (the flag's name says so)
    or `--x/--no-x` when it is True. Other fields take a value converted to their type, or, with
    `parse`, parsed into the fields `sets` names (`--profile-steps` sets wait, warmup and active).
    """

    name: str
    help: str
    metavar: str | None = None
    parse: Callable[[str], tuple[Any, ...]] | None = None
    sets: tuple[str, ...] = ()
    shown_default: str | None = None  # the default as the user writes it (with `parse`)


FLAG = "zdiag_flag"
"""The metadata key of a `CollectorConfig` field's `Flag`."""


def _flag(default: Any, name: str, help: str, **more: Any) -> Any:
    return field(default=default, metadata={FLAG: Flag(name, help, **more)})


@dataclass(frozen=True)
class CollectorConfig:
    """Profiler and collector settings of one run, shared by every rank. A field with a `Flag`
    is an option of `zdiag run` (its own help text is here); the others are set in code only."""

    wait: int = _flag(
        1,
        "--profile-steps",
        f"profiler schedule in training steps, one window (default: {DEFAULT_PROFILE_STEPS})",
        metavar="WAIT:WARMUP:ACTIVE",
        parse=parse_profile_steps,
        sets=("wait", "warmup", "active"),
        shown_default=DEFAULT_PROFILE_STEPS,
    )
    warmup: int = 1
    active: int = 3
    profile: bool = _flag(
        True,
        "--no-profile",
        "no profiler at all: only step detection and the step log (near-zero cost)",
    )
    record_shapes: bool = _flag(False, "--record-shapes", "record operator input shapes")
    profile_memory: bool = _flag(
        False,
        "--profile-memory",
        "record allocations and export the memory timeline (also records shapes and stacks), "
        "and measure what each block's first forward saves for backward",
    )
    with_stack: bool = _flag(False, "--with-stack", "record Python stacks of operators")
    nvtx: bool = _flag(
        True,
        "--nvtx",
        "NVTX ranges for Nsight Systems when CUDA is present (default: on; free on CPU): one per "
        "step, plus forward/backward/recompute ranges per FSDP unit, added only while an NVTX "
        "tool such as Nsight listens (NVTX_INJECTION64_PATH set)",
    )
    max_step_log_lines: int = DEFAULT_MAX_STEP_LOG_LINES
    max_snapshot_entries: int = DEFAULT_MAX_SNAPSHOT_ENTRIES
    # None: the watchdog's default (collectors/hang.py); 0: off
    hang_timeout_s: float | None = _flag(
        None,
        "--hang-timeout",
        "dump every rank's stacks, collective, flight recorder and partial trace when no step "
        "finishes for this long (default: 300 s until 3 steps are timed, then max(60 s, 20 x the "
        "median step); 0 turns the watchdog off)",
        metavar="SECONDS",
    )

    def __post_init__(self) -> None:
        for name in ("wait", "warmup"):
            if getattr(self, name) < 0:
                raise ConfigError(f"profile {name} must be >= 0, not {getattr(self, name)}.")
        if self.active < 1:
            raise ConfigError(f"profile active must be at least 1 step, not {self.active}.")
        if self.hang_timeout_s is not None and not 0 <= self.hang_timeout_s < 1e9:
            raise ConfigError(f"hang timeout must be >= 0 seconds, not {self.hang_timeout_s}.")
        if self.max_step_log_lines < 0 or self.max_snapshot_entries < 1:
            raise ConfigError("max_step_log_lines must be >= 0 and max_snapshot_entries >= 1.")

    def manifest_profile(self) -> dict[str, bool | int]:
        """The manifest's `profile` block (memory profiling records shapes and stacks too)."""
        return {
            "enabled": self.profile,
            "wait": self.wait,
            "warmup": self.warmup,
            "active": self.active,
            "record_shapes": self.record_shapes or self.profile_memory,
            "profile_memory": self.profile_memory,
            "with_stack": self.with_stack or self.profile_memory,
        }

    def to_json(self) -> str:
        """This config as one JSON object (the value of ZDIAG_CONFIG)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_flags(cls, values: Mapping[str, Any]) -> CollectorConfig:
        """The config of `zdiag run`'s parsed options (`values`: the argparse namespace's dict,
        one entry per flagged field, by field name); ConfigError on a bad value."""
        settings: dict[str, Any] = {}
        for fld in fields(cls):
            flag = fld.metadata.get(FLAG)
            if flag is None:
                continue
            value = values[fld.name]
            if flag.parse is not None:
                settings.update(zip(flag.sets, flag.parse(value), strict=True))
            else:
                settings[fld.name] = value
        return cls(**settings)

    @classmethod
    def from_json(cls, text: str) -> CollectorConfig:
        """Read a config written by `to_json`; unknown keys (from a newer zdiag) are ignored."""
        data = json.loads(text)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def config_from_env(env: Mapping[str, str] | None = None) -> tuple[str, CollectorConfig] | None:
    """(run_dir, config) when this process runs under `zdiag run`, else None."""
    env = os.environ if env is None else env
    run_dir = env.get(ENV_RUN_DIR)
    if not run_dir:
        return None
    raw = env.get(ENV_CONFIG)
    return run_dir, CollectorConfig.from_json(raw) if raw else CollectorConfig()
