"""The `hang` finding from the flight-recorder dumps' wait graph: its title, evidence and advice.

`hang_findings` turns a `HangAnalysis` (analyzers/run/wait_graph.py) into one critical finding
naming the culprit ranks; `dump_warnings` says what the dumps could not tell.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..report import Finding
from ..run.wait_graph import Disagreement, HangAnalysis

MAX_FINDING_GROUPS = 8
"""Process groups listed in the finding's evidence (all are in `HangAnalysis.disagreements`)."""


def _ranks_text(ranks: Iterable[int]) -> str:
    """ "rank 3", "ranks 1, 3", runs of three or more as "ranks 2-999" (a finding may name every
    rank of a large job that left no dump)."""
    rs = sorted(ranks)
    parts = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{rs[i]}-{rs[j]}")
        else:
            parts.extend(map(str, rs[i : j + 1]))
        i = j + 1
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(parts)


def _group_evidence(d: Disagreement) -> dict[str, Any]:
    out: dict[str, Any] = {
        "pg": d.pg_name,
        "desc": d.pg_desc,
        "kind": d.kind,
        "seq": d.seq,
        "op": d.profiling_name,
    }
    for status in ("waiting", "completed", "missing", "stuck", "mismatched", "no dump"):
        ranks = d.with_status(status)
        if ranks:
            out[status.replace(" ", "_")] = list(ranks)
    ahead = max((a.last_seq for a in d.ranks if a.last_seq is not None), default=None)
    behind = {
        str(a.rank): ahead - a.last_seq
        for a in d.ranks
        if a.status == "missing" and a.last_seq is not None and ahead is not None
    }
    if behind:
        out["behind_by"] = behind
    frames = {str(a.rank): str(a.frame) for a in d.ranks if a.frame is not None}
    if frames:  # where each rank issued its op there (its last op in the group when missing)
        out["frames"] = frames
    return out


def _title(culprits: tuple[int, ...], head: Disagreement | None) -> str:
    """The finding's title: who is at fault at the first blocking op (`head`), and where."""
    if head is None:
        return f"{_ranks_text(culprits)} never arrived (their peers wait for them)"
    where = (
        f"{head.pg_desc or 'process group'} (pg {head.pg_name}) "
        f"{'p2p op' if head.kind == 'p2p' else 'collective'} #{head.seq} {head.profiling_name}"
    )
    if head.kind == "stuck":
        title = (
            f"{_ranks_text(head.with_status('stuck'))} stuck in {where}, which "
            f"{_ranks_text(head.with_status('completed'))} completed"
        )
    elif head.kind == "mismatch":
        title = f"{_ranks_text(head.with_status('mismatched'))} issued a different op at {where}"
    else:
        title = (
            f"{_ranks_text(head.with_status('missing', 'no dump'))} never arrived at {where}, "
            f"where {_ranks_text(head.with_status('waiting'))} wait"
        )
    if set(culprits) - set(head.with_status("stuck", "missing", "no dump", "mismatched")):
        title += f" (culprits: {_ranks_text(culprits)})"
    return title


def _evidence(analysis: HangAnalysis, blocking: list[Disagreement]) -> dict[str, Any]:
    """The culprits, their reasons and frames, the waiting ranks and the blocking groups (the
    first MAX_FINDING_GROUPS of them)."""
    head = blocking[0] if blocking else None
    frames = {str(c.rank): str(c.frame) for c in analysis.culprits if c.frame is not None}
    return {
        "culprit_ranks": list(analysis.culprit_ranks),
        "reasons": {str(c.rank): c.reason for c in analysis.culprits},
        "waiting_ranks": list(analysis.waiting),
        "first_group": _group_evidence(head) if head else None,
        "culprit_frames": frames,
        "unreadable_dumps": list(analysis.unreadable),
        "dumps": len(analysis.ranks),
        "expected_ranks": len(analysis.expected_ranks),
        "groups_disagreeing": len(analysis.disagreements),
        "fr_version": analysis.version,
        "groups": [_group_evidence(d) for d in blocking[:MAX_FINDING_GROUPS]],
    }


def _recommendation(reasons: set[str]) -> str:
    """What to look at, per reason the culprits have."""
    advice = []
    if reasons & {"missing", "no dump", "deadlock"}:
        advice.append(
            "look at what the culprit ranks were doing instead of the collective (their last op "
            "and stack, their logs, py-spy dump of the process)"
        )
    if "stuck" in reasons:
        advice.append(
            "a stuck rank's device stopped completing ops its peers finished: check its GPU "
            "(Xid errors in dmesg, nvidia-smi) and its host"
        )
    if "mismatched" in reasons:
        advice.append("make every rank issue the same collectives in the same order and shapes")
    if "no dump" in reasons:
        advice.append("an empty or missing dump means the process was frozen or killed")
    return "; ".join(advice) + "."


def hang_findings(analysis: HangAnalysis) -> list[Finding]:
    """The `hang` Finding (critical; `ranks` = the culprits), or none when no rank disagrees."""
    if not analysis.culprits:
        return []
    culprits = analysis.culprit_ranks
    blocking = [
        d
        for d in analysis.disagreements
        if any(a.rank in culprits and a.status != "waiting" for a in d.ranks)
    ]
    return [
        Finding(
            id="hang",
            severity="critical",
            title=_title(culprits, blocking[0] if blocking else None),
            ranks=list(culprits),
            evidence=_evidence(analysis, blocking),
            recommendation=_recommendation({c.reason for c in analysis.culprits}),
            gain_method="",
        )
    ]


def dump_warnings(analysis: HangAnalysis) -> list[str]:
    """What the dumps could not tell (empty or absent dumps, no disagreement found: no culprit,
    so no `hang` finding)."""
    out = [
        f"rank {r}: its flight-recorder dump is empty or cut short (the process was frozen or "
        "killed while dumping)"
        for r in analysis.unreadable
    ]
    absent = sorted(set(analysis.expected_ranks) - set(analysis.ranks))
    if absent:
        out.append(
            f"no flight-recorder dump for {_ranks_text(absent)} of the {len(analysis.expected_ranks)} "
            "ranks its process groups name"
        )
    if not analysis.culprits:
        out.append(
            f"flight-recorder dumps of {len(analysis.ranks)} rank(s): no collective where ranks "
            "disagree (no rank is missing, stuck or mismatched)"
        )
    return out
