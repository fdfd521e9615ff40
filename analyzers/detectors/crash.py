"""`crash`: which ranks raised what, at which step and line, and which ranks were only torn down.

Read from the run manifest (`zdiag run` records each rank's exit code, exception, the user's line
it came from, how many steps it finished and whether a signal ended it). When one rank raises,
its peers fail too: their next collective finds the connection closed, or torchrun SIGTERMs them.
Those ranks are not the culprits. A rank is a culprit when its exception is not one of those
consequences (`COLLATERAL_ERRORS`); when every failing rank's exception is a consequence (a
timeout everywhere, say), the rank that ended first is named. Out-of-memory failures are left to
`activation-oom`, which explains them.
"""

from __future__ import annotations

from typing import Any

from ...collectors.run_records import RankEntry
from ..report import Finding
from .context import DetectorContext
from .failures import COLLATERAL_ERRORS, timeout_hang
from .rule import Rule

MAX_ERROR_CHARS = 300


def _torn_down(entry: RankEntry) -> bool:
    """Ended by a signal, or by a peer's failure, or never recorded how it ended."""
    if entry.hang is not None:
        return False
    if entry.ended_by is not None:
        return True
    if entry.exit_code is None and not entry.missing:
        return True
    return entry.raised and bool(COLLATERAL_ERRORS.search(entry.error or ""))


def _ended_a_hang(entries: list[RankEntry]) -> bool:
    return bool(timeout_hang(entries)[1])


def _where(entry: RankEntry) -> str:
    src = entry.error_source
    if src is None:
        return "an unknown line (the traceback did not pass through the script)"
    name = src.file.rsplit("/", 1)[-1]
    code = f" `{src.code}`" if src.code else ""
    return f"{name}:{src.line}{code}"


def _when(entry: RankEntry) -> str:
    """When the rank raised, from the steps it finished: "at step 3", or "before its first step
    ended" (a rank that finished no step raised while setting up or in its first step, which
    the manifest does not tell apart)."""
    return f"at step {entry.steps}" if entry.steps else "before its first step ended"


def culprit_ranks(entries: list[RankEntry]) -> list[RankEntry]:
    """The ranks whose exception is not a consequence of a peer's failure (module docstring),
    or, when every failing rank's is, the one that ended first; [] when no rank raised (or
    only out of memory)."""
    failed = [e for e in sorted(entries, key=lambda e: e.rank) if e.raised]
    own = [e for e in failed if not COLLATERAL_ERRORS.search(e.error or "")]
    return own or sorted(failed, key=lambda e: (e.ended_at or "~", e.rank))[:1]


def detect(ctx: DetectorContext) -> list[Finding]:
    """One `crash` finding when ranks of a `zdiag run` raised (not out of memory)."""
    if ctx.manifest is None:
        return []
    entries = sorted(ctx.manifest.ranks, key=lambda e: e.rank)
    culprits = culprit_ranks(entries)
    if not culprits or _ended_a_hang(entries):
        return []  # nothing raised, or the errors are a hang's timeouts (the `hang` finding)
    names = {e.rank for e in culprits}
    torn = [e.rank for e in entries if e.rank not in names and _torn_down(e)]
    first = culprits[0]
    raised: list[dict[str, Any]] = []
    for e in culprits:
        src = e.error_source
        raised.append(
            {
                "rank": e.rank,
                "step": e.steps,
                "error": (e.error or "")[:MAX_ERROR_CHARS],
                "file": src.file if src else None,
                "line": src.line if src else None,
                "function": src.function if src else None,
                "code": src.code if src else None,
            }
        )
    others = {
        e.rank: (e.error or e.ended_by or "ended without a recorded cause")[:MAX_ERROR_CHARS]
        for e in entries
        if e.rank in torn
    }
    who = "rank" if len(culprits) == 1 else "ranks"
    ranks_text = ", ".join(str(e.rank) for e in culprits)
    kind = (first.error or "an exception").split(":")[0]
    title = f"{who} {ranks_text} raised {kind} {_when(first)} ({_where(first)})"
    if torn:
        title += (
            f"; rank {torn[0]} was torn down by it"
            if len(torn) == 1
            else f"; ranks {', '.join(map(str, torn))} were torn down by it"
        )
    recommendation = (
        f"Fix the exception on {who} {ranks_text}: {(first.error or '')[:160]} "
        f"raised at {_where(first)} {_when(first)}."
    )
    if torn:
        recommendation += (
            " The other failing ranks are consequences (their peer's connection closed, or "
            "torchrun ended them with SIGTERM), not separate problems."
        )
    return [
        Finding(
            id="crash",
            severity="critical",
            title=title,
            ranks=sorted(names),
            steps=sorted({e.steps for e in culprits}),
            evidence={"raised": raised, "torn_down": torn, "torn_down_errors": others},
            recommendation=recommendation,
            gain_method="not a performance finding: the run did not finish",
        )
    ]


RULE = Rule(
    id="crash",
    summary="ranks that raised an exception, and the ranks it tore down",
    detect=detect,
    what=(
        "Ranks of a `zdiag run` raised an exception (not out of memory): which ranks raised "
        "what, at which step and user line, and which ranks were only torn down by it. A rank "
        "is a culprit when its exception is not a consequence of a peer's failure (a closed "
        "connection, a collective timeout, torchrun's SIGTERM); when every failing rank's "
        "exception is one, the rank that ended first is named."
    ),
    why=(
        "When one rank raises, its peers fail too, and every log shows an error: the first "
        "one to read is the culprit's, not the connection errors it caused."
    ),
    example=(
        "rank 1 raised ValueError at step 3 (train.py:42 `loss = model(x)`); rank 0 was torn "
        "down by it."
    ),
    fix="Fix the exception on the culprit rank, at the line it was raised.",
    gain="None: not a performance finding (the run did not finish).",
    scope=(
        "run directories of `zdiag run` (the manifest records each rank's exit), traces or not: "
        "a script that fails in its setup, before the profiler writes one, is diagnosed too"
    ),
)
