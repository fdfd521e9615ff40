"""`hang`: the ranks that never arrived at the collective the others wait in.

Three sources, one finding, in this order: zdiag's own hang watchdog (below) when the run
directory has its records; torch.distributed flight-recorder dumps given as input
(`analyzers/inputs/flight_dumps.py` reads them, `analyzers/run/wait_graph.py` finds who never arrived; also dumps of jobs zdiag did not launch); else a hang
that a collective timeout ended before the watchdog fired (`timeout_hang`): ranks whose
collective timed out (or that a signal stopped inside one) waited, and ranks that a signal
stopped outside any collective (`stopped_in`, recorded at SIGTERM) never arrived.

Read from the hang watchdog's records in the run manifest (`collectors/hang.py`: each rank that
stopped finishing steps records the torch.distributed call its training thread was in, that
call's process group, ranks and sequence number, and its innermost user frame). The waiting ranks
sit in the same collective (group, sequence number); the culprits are the members of that group
that are not there with them: stuck in their own code, in another collective, or gone without a
record. The finding's `ranks` are the culprits, never the waiting ranks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from ...collectors.run_records import HangRecord, RankEntry
from ..report import Finding
from .context import DetectorContext
from .failures import timeout_hang
from .hang_finding import hang_findings
from .rule import Rule


def _frame(h: HangRecord | None) -> str:
    if h is None or h.user_file is None:
        return "no stack recorded"
    name = h.user_file.rsplit("/", 1)[-1]
    code = f" `{h.user_code}`" if h.user_code else ""
    return f"{name}:{h.user_line}{code}"


def _timeout_finding(entries: Sequence[RankEntry]) -> list[Finding]:
    waiting, stuck = timeout_hang(entries)
    if not stuck:
        return []
    culprits = [
        {"rank": e.rank, "at": _frame(e.stopped_in), "step": e.steps, "dump": _dump(e)}
        for e in stuck
    ]
    first = culprits[0]
    who = "rank" if len(stuck) == 1 else "ranks"
    names = ", ".join(str(e.rank) for e in stuck)
    waited = ", ".join(str(e.rank) for e in waiting)
    errors = {
        e.rank: (e.error or f"stopped in {e.stopped_in.op if e.stopped_in else '?'}")[:200]
        for e in waiting
    }
    return [
        Finding(
            id="hang",
            severity="critical",
            title=(
                f"{who} {names} never arrived at the collective rank(s) {waited} waited in until "
                f"it timed out; stuck at {first['at']}"
            ),
            ranks=[e.rank for e in stuck],
            steps=sorted({e.steps for e in stuck}),
            evidence={
                "waiting_ranks": [e.rank for e in waiting],
                "waiting_errors": errors,
                "culprits": culprits,
                "source": "collective timeout + stacks at SIGTERM",
            },
            recommendation=(
                f"Rank {first['rank']} was stuck at {first['at']} outside any collective when the "
                f"job was torn down (its stack: {first['dump'] or 'none'}); the collective "
                "timeout on the other ranks is a consequence. Look there first: a data loader, a "
                "lock, a rank-dependent branch that skips a collective, or a slow I/O call. A "
                "longer collective timeout than zdiag's hang timeout (--hang-timeout) gives a "
                "full hang dump next time."
            ),
            gain_method="not a performance finding: the run stopped making progress",
        )
    ]


def _dump(e: RankEntry) -> str | None:
    return e.stopped_in.dump if e.stopped_in is not None else None


def detect(ctx: DetectorContext) -> list[Finding]:
    """One `hang` finding when the watchdog fired on ranks of a `zdiag run`, else the
    flight-recorder dumps' finding, else a hang a collective timeout ended."""
    entries = ctx.manifest.ranks if ctx.manifest is not None else ()
    records = {e.rank: e.hang for e in entries if e.hang is not None}
    if not records:
        if ctx.flight_recorder is not None:
            return hang_findings(ctx.flight_recorder)
        return _timeout_finding(entries)
    evidence, culprits, where = _waiting_group(records, entries)
    stuck = [_culprit(r, records.get(r)) for r in culprits]
    evidence["culprits"] = stuck
    evidence["stalled_s"] = round(max(h.stalled_s for h in records.values()), 1)
    title, recommendation = _watchdog_text(stuck, where)
    return [
        Finding(
            id="hang",
            severity="critical",
            title=title,
            ranks=culprits,
            steps=sorted({h.step for h in records.values()}),
            units=[evidence["fsdp_unit"]] if evidence.get("fsdp_unit") is not None else [],
            evidence=evidence,
            recommendation=recommendation,
            gain_method="not a performance finding: the run stopped making progress",
        )
    ]


def _waiting_group(
    records: dict[int, HangRecord], entries: Sequence[RankEntry]
) -> tuple[dict[str, Any], list[int], str]:
    """(evidence, culprits, where): the collective most hung ranks wait in (group, sequence
    number) and the members of its group that are not there; without one, every hung rank."""
    waiting = {r: h for r, h in records.items() if h.op is not None}
    evidence: dict[str, Any] = {}
    if not waiting:  # no rank is in a collective: every hung rank is stuck in its own code
        evidence["waiting_ranks"] = []
        return evidence, sorted(records), "no collective (every hung rank is stuck in its own code)"
    key, _ = Counter((h.group_name, h.sequence_number) for h in waiting.values()).most_common(1)[0]
    at = {r: h for r, h in waiting.items() if (h.group_name, h.sequence_number) == key}
    sample = next(iter(at.values()))
    members = list(sample.group_ranks) or sorted(set(records) | {e.rank for e in entries})
    culprits = sorted(r for r in members if r not in at)
    op = sample.op or "a collective"
    seq = f" #{sample.sequence_number}" if sample.sequence_number is not None else ""
    unit = f" for FSDP unit {sample.fsdp_unit or '(root)'}" if sample.fsdp_unit is not None else ""
    group = f"group {sample.group_name}" if sample.group_name is not None else "its group"
    evidence.update(
        {
            "collective": op,
            "process_group": sample.group_name,
            "group_ranks": members,
            "sequence_number": sample.sequence_number,
            "fsdp_unit": sample.fsdp_unit,
            "waiting_ranks": sorted(at),
            "waiting_at": _frame(sample),
        }
    )
    return evidence, culprits, f"{op}{seq} of {group} (ranks {', '.join(map(str, members))}){unit}"


def _culprit(rank: int, h: HangRecord | None) -> dict[str, Any]:
    """What the watchdog recorded of a rank that never arrived (None: no record)."""
    return {
        "rank": rank,
        "in_collective": h.op if h is not None else None,
        "sequence_number": h.sequence_number if h is not None else None,
        "at": _frame(h),
        "step": h.step if h is not None else None,
        "dump": h.dump if h is not None else None,
    }


def _watchdog_text(stuck: list[dict[str, Any]], where: str) -> tuple[str, str]:
    """(title, recommendation) of the watchdog's hang finding."""
    if not stuck:  # every member is waiting: the group's other members are outside the run
        return (
            f"ranks hung in {where}, and no member of the group is missing from it",
            "The collective's other participants are not in this run's manifest.",
        )
    first = stuck[0]
    names = ", ".join(str(s["rank"]) for s in stuck)
    who = "rank" if len(stuck) == 1 else "ranks"
    return (
        f"{who} {names} never arrived at {where}; stuck at {first['at']}",
        f"Rank {first['rank']} is stuck at {first['at']} (its stack: {first['dump'] or 'none'}),"
        " so the ranks waiting for it cannot proceed. Look there first: a data loader, a "
        "lock, a rank-dependent branch that skips a collective, or a slow I/O call.",
    )


RULE = Rule(
    id="hang",
    summary="ranks that never arrived at the collective the others wait in",
    detect=detect,
    what=(
        "Ranks never arrived at the collective the others wait in. Three sources, in this "
        "order: zdiag's hang watchdog (each rank that stopped finishing steps records the "
        "torch.distributed call it is in, its group and sequence number, and its innermost "
        "user frame); torch.distributed flight-recorder dumps given as input; else a hang a "
        "collective timeout ended (ranks whose collective timed out waited, ranks a signal "
        "stopped outside any collective never arrived). The finding's ranks are the culprits, "
        "never the waiting ranks."
    ),
    why=(
        "A hung job shows every rank waiting, most of them in a collective: the rank to look "
        "at is the one that is not there, stuck in its own code or in another collective."
    ),
    example=(
        "rank 1 never arrived at all_reduce #12 of group 0 (ranks 0, 1); stuck at train.py:57 "
        "`batch = next(it)`."
    ),
    fix=(
        "Look at the culprit's recorded stack first: a data loader, a lock, a rank-dependent "
        "branch that skips a collective, or a slow I/O call."
    ),
    gain="None: not a performance finding (the run stopped making progress).",
    scope=(
        "run directories of `zdiag run` (watchdog records, timeouts) and torch.distributed "
        "flight-recorder dumps"
    ),
)
