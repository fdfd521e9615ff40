"""What the run manifest says about how ranks failed, shared by the `crash` and `hang` detectors."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ...collectors.run_records import RankEntry

COLLATERAL_ERRORS = re.compile(
    r"connection closed by peer|connection reset by peer|remote worker crash|broken pipe|"
    r"econnreset|communicator was aborted|ncclRemoteError|DistBackendError|"
    r"timed out|timeout|watchdog caught collective operation",
    re.IGNORECASE,
)
"""Exceptions a rank gets because a peer failed (gloo and NCCL wording)."""


def timeout_hang(entries: Sequence[RankEntry]) -> tuple[list[RankEntry], list[RankEntry]]:
    """(waiting, stuck) when a collective timeout ended a hang: every failed rank failed with a
    peer-failure/timeout error (or a signal stopped it inside a collective), and some rank was
    stopped by a signal outside any collective. ([], []) otherwise."""
    failed = [e for e in entries if e.exit_code not in (None, 0) and not e.oom and e.error]
    if any(not COLLATERAL_ERRORS.search(e.error or "") for e in failed):
        return [], []  # somebody raised for a reason of its own: a crash, not a hang
    stuck = [e for e in entries if e.stopped_in is not None and e.stopped_in.op is None]
    stuck_ranks = {e.rank for e in stuck}
    waiting = [
        e
        for e in entries
        if e.rank not in stuck_ranks
        and (e in failed or (e.stopped_in is not None and e.stopped_in.op is not None))
    ]
    return (waiting, stuck) if waiting and stuck else ([], [])
