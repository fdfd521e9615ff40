"""Decoded live records for the monitor's state and TUI tests: one rank's step (`rec`) and a whole
job (`job`), at a fixed clock `NOW`."""

from __future__ import annotations

from typing import Any

NOW = 1_000.0


def rec(rank: int, step: int, **over: Any) -> dict[str, Any]:
    """A decoded step record, received 10 ms after it was sent, one step per second."""
    base: dict[str, Any] = {
        "kind": "step",
        "rank": rank,
        "host": f"node{rank // 4}",
        "job": "job-7",
        "pid": 100 + rank,
        "step": step,
        "ts": NOW - 30 + step,
        "recv_ts": NOW - 30 + step + 0.01,
        "step_time_ms": 100.0,
        "compute_ms": 70.0,
        "comm_ms": 30.0,
        "exposed_comm_ms": 5.0,
        "mem_allocated_bytes": float(2 << 30),
        "mem_reserved_bytes": float(3 << 30),
        "mem_peak_bytes": float(4 << 30),
        "samples_per_s": 80.0,
        "dropped": 0,
    }
    base.update(over)
    return base


def job(ranks: int = 8, steps: int = 30, **per_rank: dict[str, Any]) -> list[dict[str, Any]]:
    """Records of a healthy job; `per_rank` overrides fields of one rank ("r5": {...})."""
    out = []
    for r in range(ranks):
        for s in range(steps):
            over = dict(per_rank.get(f"r{r}", {}))
            over = {k: (v(s) if callable(v) else v) for k, v in over.items()}
            out.append(rec(r, s, **over))
    return out
