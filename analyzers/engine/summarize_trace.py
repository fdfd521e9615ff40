"""`python -m zdiag.analyzers.engine.summarize_trace TRACE OUT`: one rank's summary, made in the job.

`zdiag run` starts this in a background process (at the lowest CPU priority: `nice -n 19`, then
SCHED_IDLE on Linux) right
after a rank exports its trace (collectors/session.py), so the training process never decodes a
trace. It writes the trace's `StoredSummary` (summary_store.py) to OUT, normally the trace's
`summary_path_for` (`traces/rank-N.summary.zds`), with the empty context: `zdiag analyze` uses
it when its fingerprint still matches the trace and the run's manifest can be applied to it without
the trace (`summary_store.apply_context`), and decodes the trace otherwise.

Exit status: 0 written; 2 the trace cannot be summarized (one line on stderr, nothing written).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from zdiag.errors import InputError

NICENESS = 19


def lower_priority() -> None:
    """The lowest CPU priority this process can take: Linux's SCHED_IDLE (runs only on a core
    nothing else wants), else niceness 19 (the launcher already starts it under `nice -n 19`)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.nice(NICENESS)
    except (AttributeError, OSError):
        pass


def summarize_to(trace: Path, out: Path) -> None:
    """Summarize `trace` into `out` (InputError when the trace cannot be read)."""
    from ..rank.summary import inflate_summary
    from .summary_map import MapTask, RunContexts, map_trace
    from .summary_store import (
        EMPTY_CONTEXT_KEY,
        StoredSummary,
        fingerprint,
        write_stored,
    )

    result = map_trace(MapTask(str(trace), None, RunContexts(), decode_workers=1))
    after = fingerprint(trace)  # its stamp, taken after the decode, is likelier settled
    if not after.same_content(result.trace):
        raise InputError(f"{trace}: the trace changed while it was summarized; nothing written.")
    stored = StoredSummary(
        rank=result.rank,
        trace=after,
        context_key=EMPTY_CONTEXT_KEY,
        summary_msgpack=inflate_summary(result.summary),
    )
    if not write_stored(out, stored):
        raise InputError(f"{out}: cannot be written; no summary for {trace}.")


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m zdiag.analyzers.engine.summarize_trace TRACE OUT", file=sys.stderr)
        return 2
    lower_priority()
    try:
        summarize_to(Path(args[0]), Path(args[1]))
    except InputError as exc:
        print(f"zdiag summarize: {exc.message}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"zdiag summarize: {args[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
