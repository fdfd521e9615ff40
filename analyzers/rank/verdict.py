"""The verdict for one step on one rank, with named thresholds.

Checked in this order (the first that holds wins), on the step's breakdown:

1. `host-bound`: the device is idle for at least HOST_BOUND_IDLE_FRACTION of the step
   (the GPU waits for the CPU: data loading, Python overhead, launch latency, syncs).
2. `comm-bound`: communication time is at least COMM_BOUND_COMM_TO_COMPUTE times the compute
   time and the exposed communication is at least MIN_EXPOSED_FRACTION of the step. Even with
   perfect overlap, comm − compute would stay exposed: the fix is less communication (larger
   shards per collective, fewer/larger groups, compression, faster links), not more overlap.
3. `exposed-comm`: exposed communication (comm not overlapped by compute) is at least
   EXPOSED_COMM_FRACTION of the step while compute could hide it: fixable by overlap
   (prefetching, bucketing, async collectives).
4. `compute-bound`: otherwise.

The values are reported in `Report.thresholds` and each step's `verdict_reason` shows the
numbers that decided it. They are round numbers chosen by reasoning, not fitted to any trace.
"""

from __future__ import annotations

HOST_BOUND_IDLE_FRACTION = 0.40
"""Device idle share of the step at or above which the step is host-bound."""

COMM_BOUND_COMM_TO_COMPUTE = 1.0
"""comm_ms / compute_ms at or above which communication cannot hide behind compute."""

EXPOSED_COMM_FRACTION = 0.15
"""Exposed-comm share of the step at or above which the step is exposed-comm."""

MIN_EXPOSED_FRACTION = 0.05
"""Exposed-comm share below which a step is never called comm-bound (comm is then harmless)."""

COMM_BOUND_STEP_SHARE = 0.5
"""Share of a run's steps that must be comm-bound for the run to be called comm-bound (the
`comm-bound` finding and the live monitor's rule): most steps, not one outlier."""


def thresholds() -> dict[str, float]:
    """The thresholds by name, as reported in Report.thresholds."""
    return {
        "host_bound_idle_fraction": HOST_BOUND_IDLE_FRACTION,
        "comm_bound_comm_to_compute": COMM_BOUND_COMM_TO_COMPUTE,
        "exposed_comm_fraction": EXPOSED_COMM_FRACTION,
        "min_exposed_fraction": MIN_EXPOSED_FRACTION,
    }


def decide(
    duration_ms: float, compute_ms: float, comm_ms: float, exposed_comm_ms: float, idle_ms: float
) -> tuple[str, str]:
    """(verdict, reason) for one step; see the module docstring for the rules."""
    if duration_ms <= 0:
        return "compute-bound", "empty step window"
    idle_f = idle_ms / duration_ms
    exposed_f = exposed_comm_ms / duration_ms
    if idle_f >= HOST_BOUND_IDLE_FRACTION:
        return (
            "host-bound",
            f"device idle {idle_f:.0%} of the step >= {HOST_BOUND_IDLE_FRACTION:.0%}",
        )
    ratio = comm_ms / compute_ms if compute_ms > 0 else float("inf")
    if comm_ms > 0 and ratio >= COMM_BOUND_COMM_TO_COMPUTE and exposed_f >= MIN_EXPOSED_FRACTION:
        shown = "inf" if ratio == float("inf") else f"{ratio:.2f}"
        return (
            "comm-bound",
            f"comm/compute {shown} >= {COMM_BOUND_COMM_TO_COMPUTE:.2f} and exposed comm "
            f"{exposed_f:.0%} >= {MIN_EXPOSED_FRACTION:.0%}: comm cannot hide even with perfect overlap",
        )
    if exposed_f >= EXPOSED_COMM_FRACTION:
        return (
            "exposed-comm",
            f"exposed comm {exposed_f:.0%} of the step >= {EXPOSED_COMM_FRACTION:.0%} "
            f"and comm/compute {ratio:.2f} < {COMM_BOUND_COMM_TO_COMPUTE:.2f}: fixable by overlap",
        )
    return (
        "compute-bound",
        f"idle {idle_f:.0%} < {HOST_BOUND_IDLE_FRACTION:.0%}, exposed comm {exposed_f:.0%} "
        f"< {EXPOSED_COMM_FRACTION:.0%}",
    )
