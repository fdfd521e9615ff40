"""What the launcher tells each rank: the run directory and the profiler settings.

`zdiag run` serializes a `CollectorConfig` into environment variables; the bootstrap in each rank
reads it back. Only the standard library is imported here, so the launcher stays light.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass

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
class CollectorConfig:
    """Profiler and collector settings of one run, shared by every rank."""

    profile: bool = True
    wait: int = 1
    warmup: int = 1
    active: int = 3
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    nvtx: bool = True
    max_step_log_lines: int = DEFAULT_MAX_STEP_LOG_LINES
    max_snapshot_entries: int = DEFAULT_MAX_SNAPSHOT_ENTRIES
    hang_timeout_s: float | None = None  # None: the watchdog's default (collectors/hang.py); 0: off

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
