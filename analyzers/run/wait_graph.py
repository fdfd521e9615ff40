"""Who waits for whom in a hung job, from its ranks' flight-recorder dumps (values only).

`analyze_dumps`, per process group (matched across ranks by name and member ranks):

- collectives: each rank's first not-completed collective is where it waits. A member that never
  enqueued that sequence number (its last one is lower, or it has no entry in the group, and no
  member completed it) is *missing*; a member that still shows pending an earlier collective the
  waiting rank completed, and went on issuing ops after it, is *stuck* (for ops that need every
  member's data, a peer cannot complete without it, so its device or progress thread stopped);
  members with a different op, sizes or dtypes at the same sequence number are *mismatched*;
- point-to-point: pending sends from A to B are paired with pending receives on B from A; an
  unpaired op means its peer never posted the other side.

Waiting ranks point at the ranks they wait for. The culprits are the stuck and mismatched ranks
plus the ranks that others wait for and that wait for nobody themselves (the terminal strongly
connected components of that graph: a rank missing from one group because it waits in another is
not a culprit; a cycle is a deadlock and all its ranks are named; a rank without a readable dump
is named "no dump"). The work grows linearly with what the dumps hold: waiters waiting for the
same members share one node of the graph, and the ranks named in all are capped at
MAX_WORLD_SIZE. The dumps are read by analyzers/inputs/flight_dumps.py; the `hang` finding is
built by analyzers/detectors/hang_finding.py; docs/flight-recorder.md has the details and the
checks on real dumps.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from zdiag.errors import InputError

from ..inputs.flight_dump_parse import MAX_WORLD_SIZE, Entry, Frame, RankDump

# Collectives that cannot complete on any member before every member contributed its data: a
# peer that completed one proves the others ran it (a rank still showing it pending is stuck).
_NEEDS_ALL_DATA = re.compile(
    r"^_?(all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|barrier)", re.IGNORECASE
)
_TORCH_FRAME = re.compile(r"[/\\]torch[/\\]|^<frozen |^<string>|^\?\?$|^$")


@dataclass(frozen=True)
class RankAtOp:
    """A member of a process group at the op where the group disagrees."""

    rank: int
    # "waiting" (reached it, not completed), "completed", "missing" (never reached it),
    # "stuck" (earlier op not completed though peers completed it), "mismatched",
    # "no dump" (empty, cut short or not given)
    status: str
    last_seq: int | None  # the last sequence number this rank enqueued in the group
    profiling_name: str = ""
    input_sizes: tuple[tuple[int, ...], ...] = ()
    input_dtypes: tuple[str, ...] = ()
    frame: Frame | None = None  # innermost user frame of its entry, when the dump has stacks
    state: str = ""  # its entry's state: "scheduled", "started" (with timing on), "completed"


@dataclass(frozen=True)
class Disagreement:
    """The first op of a process group where its members disagree."""

    pg_name: str
    pg_desc: str
    group_ranks: tuple[int, ...]
    kind: str  # "missing", "stuck", "mismatch", "p2p"
    seq: int  # collective_seq_id (p2p: the waiting op's p2p_seq_id)
    profiling_name: str
    ranks: tuple[RankAtOp, ...]

    def with_status(self, *statuses: str) -> tuple[int, ...]:
        """The ranks in one of these statuses."""
        return tuple(r.rank for r in self.ranks if r.status in statuses)


@dataclass(frozen=True)
class Culprit:
    """A rank that others wait for, why, in which groups, and where it was last seen."""

    rank: int
    reason: str  # "missing", "stuck", "mismatched", "no dump", "deadlock"
    groups: tuple[str, ...]  # "pg_name:desc" of the groups where it is the cause
    last_op: str  # its last op in the buffer ("" when none)
    frame: Frame | None


@dataclass(frozen=True)
class HangAnalysis:
    """What the dumps of one job say about a hang."""

    ranks: tuple[int, ...]  # ranks with a dump file (readable or not)
    unreadable: tuple[int, ...]  # empty or cut-short dumps
    expected_ranks: tuple[int, ...]  # all ranks the process groups name
    disagreements: tuple[Disagreement, ...]  # the first per group, earliest-blocking first
    culprits: tuple[Culprit, ...]
    waiting: tuple[int, ...]  # ranks waiting for another rank
    version: str
    comm_lib_version: str

    @property
    def culprit_ranks(self) -> tuple[int, ...]:
        """The culprits' ranks, ascending."""
        return tuple(sorted(c.rank for c in self.culprits))


def user_frame(frames: tuple[Frame, ...]) -> Frame | None:
    """The innermost frame outside torch (the user's code), else the innermost frame."""
    for f in frames:
        if not _TORCH_FRAME.search(f.filename):
            return f
    return frames[0] if frames else None


@dataclass
class _Group:
    name: str
    desc: str
    ranks: tuple[int, ...]
    # per rank: this group's entries, in record order
    entries: dict[int, list[Entry]]


def _collect_groups(dumps: list[RankDump]) -> dict[tuple[str, tuple[int, ...]], _Group]:
    """Process groups by (name, members), with each member's entries in them. A group that no
    pg_config lists (gloo writes none) gets the ranks that have entries in it as members, or
    every dumped rank for the default group. A member tuple is hashed and turned into a set
    once per list object (`read_dumps` shares the lists its dumps repeat), not per dump or
    entry: hashing the 10,000-rank default group per entry took seconds."""
    groups: dict[tuple[str, tuple[int, ...]], _Group] = {}
    by_rank_name: dict[tuple[int, str], _Group] = {}
    member_sets: dict[int, tuple[tuple[int, ...], frozenset[int]]] = {}
    by_list: dict[tuple[int, str], _Group] = {}  # (id(ranks), name) -> its group
    for d in dumps:
        for g in d.groups:
            ranks = member_sets.get(id(g.ranks))
            if ranks is None or ranks[0] is not g.ranks:
                ranks = member_sets[id(g.ranks)] = (g.ranks, frozenset(g.ranks))
            group = by_list.get((id(g.ranks), g.name))
            if group is None:
                group = groups.setdefault((g.name, g.ranks), _Group(g.name, g.desc, g.ranks, {}))
                by_list[(id(g.ranks), g.name)] = group
            if d.rank in ranks[1]:
                by_rank_name[(d.rank, g.name)] = group
    unlisted: dict[str, set[int]] = defaultdict(set)
    descs: dict[str, str] = {}
    for d in dumps:
        for e in d.entries:
            if (d.rank, e.pg_name) not in by_rank_name:
                unlisted[e.pg_name].add(d.rank)
                descs[e.pg_name] = e.pg_desc
    everyone = tuple(sorted(d.rank for d in dumps))
    for name, members in unlisted.items():
        ranks_t = everyone if descs[name] == "default_pg" else tuple(sorted(members))
        group = groups.setdefault((name, ranks_t), _Group(name, descs[name], ranks_t, {}))
        for r in members:  # the ranks with entries in it: the only ones looked up below
            by_rank_name.setdefault((r, name), group)
    for d in dumps:
        for e in d.entries:
            by_rank_name[(d.rank, e.pg_name)].entries.setdefault(d.rank, []).append(e)
    return groups


def _at(rank: int, status: str, last: int | None, e: Entry | None) -> RankAtOp:
    if e is None:
        return RankAtOp(rank, status, last)
    return RankAtOp(
        rank,
        status,
        last,
        e.profiling_name,
        e.input_sizes,
        e.input_dtypes,
        user_frame(e.frames),
        e.state,
    )


@dataclass
class _Progress:
    """How far each member of a group got in its collectives (group-local values of
    `_collective_analysis`)."""

    coll: dict[int, dict[int, Entry]]  # rank -> collective_seq_id -> its collective entry
    last: dict[int, int]  # the last collective each member enqueued
    first_pending: dict[int, int]  # rank -> its first not-completed collective
    frontier: int  # every member reached it (see `_progress`)
    newest: dict[int, int]  # rank -> record id of its last entry in the group
    readable: set[int]

    def reached(self, r: int, s: int) -> bool:
        """Whether member `r` enqueued collective `s`."""
        return s <= self.frontier or (r in self.readable and self.last.get(r, -1) >= s)

    def went_on_beyond(self, m: int) -> bool:
        """Whether member `m` enqueued frontier + 1 or issued ops after its first pending one."""
        return (
            self.reached(m, self.frontier + 1)
            or self.newest[m] > self.coll[m][self.first_pending[m]].record_id
        )


def _progress(g: _Group, readable: set[int]) -> _Progress | None:
    """The group's progress, None when no member has a collective pending."""
    coll = {r: {e.collective_seq_id: e for e in es if not e.is_p2p} for r, es in g.entries.items()}
    # The last collective each member enqueued: p2p entries carry the collective counter too.
    last = {r: max(e.collective_seq_id for e in es) for r, es in g.entries.items() if es}
    first_pending = {
        r: min(s for s, e in by_seq.items() if not e.completed)
        for r, by_seq in coll.items()
        if any(not e.completed for e in by_seq.values())
    }
    if not first_pending:
        return None

    # Everything up to the frontier was completed by some member; a collective completes on no
    # member before every member issued it, so every member reached the frontier (this is what
    # tells an absent dump or an evicted entry apart from a rank that never arrived).
    frontier = max(
        (first_pending[r] - 1 if r in first_pending else last[r] for r in last if r in readable),
        default=-1,
    )
    newest = {r: es[-1].record_id for r, es in g.entries.items() if es}
    return _Progress(coll, last, first_pending, frontier, newest, readable)


def _wait_edges(
    g: _Group,
    p: _Progress,
    edges: dict[int, set[int]],
    node_ids: Iterator[int],
    blame: dict[int, str],
    points: set[tuple[int, str]],
) -> None:
    """Add the group's wait edges (waiting rank -> ranks it waits for) to `edges`, the stuck
    members to `blame`, and the (seq, kind) points where members disagree to `points`."""
    first_pending = p.first_pending
    # Every waiter waits at or before frontier + 1 (the frontier counts its own completed ops),
    # and every member reached the frontier: only waiters at frontier + 1 can miss anyone.
    beyond = p.frontier + 1
    top_waiters = [w for w, s_w in first_pending.items() if s_w == beyond]
    if top_waiters:
        missing = [m for m in g.ranks if not p.reached(m, beyond)]  # never enqueued it
        if missing:
            node = next(node_ids)
            edges[node].update(missing)
            for w in top_waiters:
                edges[w].add(node)
            points.add((beyond, "missing"))

    # A member m still showing s_m pending that a waiter at s_w > s_m completed: for an op that
    # needs every member's data, m's part ran, so m's device or progress stopped: m is stuck, if
    # it went on issuing ops after s_m (a rank's last op may show pending only because the
    # backend marks completion late, as gloo's `retired` does). Below the frontier every member
    # went on; at frontier + 1, only those that enqueued it or issued later ops.
    pending_at = sorted(set(first_pending.values()))
    for m, s_m in first_pending.items():
        nxt = bisect.bisect_right(pending_at, s_m)  # the next waiting point after s_m
        if nxt == len(pending_at):
            continue
        if pending_at[nxt] <= p.frontier or p.went_on_beyond(m):
            points.add((s_m, "stuck"))
            if _NEEDS_ALL_DATA.match(p.coll[m][s_m].op):
                blame[m] = "stuck"
    # Waiters below the frontier wait for every member pending earlier: a chain of nodes, the
    # node of the i-th waiting point standing for the members pending at it or before.
    by_point: dict[int, list[int]] = defaultdict(list)
    for m, s_m in first_pending.items():
        by_point[s_m].append(m)
    chain: list[int] = []
    for w, s_w in first_pending.items():
        if s_w > p.frontier:
            continue
        i = bisect.bisect_left(pending_at, s_w) - 1  # the last waiting point before s_w
        while len(chain) <= i:  # built only as far as a waiter needs it
            node = next(node_ids)
            edges[node].update(by_point[pending_at[len(chain)]])
            if chain:
                edges[node].add(chain[-1])
            chain.append(node)
        if i >= 0:
            edges[w].add(chain[i])
    if top_waiters:
        behind = [m for m, s_m in first_pending.items() if s_m < beyond and p.went_on_beyond(m)]
        if behind:
            node = next(node_ids)
            edges[node].update(behind)
            for w in top_waiters:
                edges[w].add(node)


def _first_mismatch(
    coll: dict[int, dict[int, Entry]], blame: dict[int, str], points: set[tuple[int, str]]
) -> None:
    """The first sequence number where members hold different ops, sizes or dtypes, not
    completed everywhere: its odd members (all of them when no signature has a majority) go to
    `blame` as "mismatched", the point to `points`."""
    held_at: dict[int, dict[int, Entry]] = defaultdict(dict)
    for r, by_seq in coll.items():
        for s, e in by_seq.items():
            held_at[s][r] = e
    for s in sorted(held_at):
        held = held_at[s]
        if len(held) < 2 or all(e.completed for e in held.values()):
            continue  # what completed everywhere did not hang the job
        sigs: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for r, e in held.items():
            sigs[e.signature].append(r)
        if len(sigs) > 1:
            ranked = sorted(sigs.values(), key=len, reverse=True)
            odd = [r for rs in ranked[1:] for r in rs]
            if len(ranked[0]) == len(ranked[1]):  # no majority: all of them
                odd = [r for rs in ranked for r in rs]
            for r in odd:
                blame[r] = "mismatched"
            points.add((s, "mismatch"))
            return


def _disagreement(
    g: _Group, p: _Progress, seq: int, kind: str, blame: dict[int, str]
) -> Disagreement:
    """The group's members at collective `seq`, where they first disagree (`kind`)."""
    coll = p.coll
    # whether some member completed `seq` (listed as completed, or passed: its first pending
    # op is later)
    seq_done = any(seq in by_seq and by_seq[seq].completed for by_seq in coll.values()) or any(
        s_r > seq for s_r in p.first_pending.values()
    )
    statuses = []
    ref: Entry | None = None
    for r in g.ranks:
        at: Entry | None = coll.get(r, {}).get(seq)
        if r not in p.readable:
            status = "no dump"
        elif kind == "mismatch" and blame.get(r) == "mismatched":
            status = "mismatched"
        elif at is not None and not at.completed:
            status = "stuck" if seq_done else "waiting"
        elif p.reached(r, seq):
            status = "completed"
        else:
            status = "missing"
        if at is not None and ref is None:
            ref = at
        if at is None and g.entries.get(r):  # not at this op: its last op in the group
            at = g.entries[r][-1]
        statuses.append(_at(r, status, p.last.get(r), at))
    return Disagreement(
        g.name, g.desc, g.ranks, kind, seq, ref.profiling_name if ref else "", tuple(statuses)
    )


def _collective_analysis(
    g: _Group, readable: set[int], edges: dict[int, set[int]], node_ids: Iterator[int]
) -> tuple[Disagreement | None, dict[int, str]]:
    """The group's first disagreement among its collectives, the blame per rank ("stuck",
    "mismatched"), and the wait edges (waiting rank -> ranks it waits for) added to `edges`.

    Waiters that wait for the same set of members share one node standing for that set (a
    negative id from `node_ids`), so the edges grow with the members, not with members x
    waiters (every rank of a 10,000-rank job waiting in one all-reduce made 10^8 of them)."""
    p = _progress(g, readable)
    if p is None:
        return None, {}
    blame: dict[int, str] = {}
    points: set[tuple[int, str]] = set()  # (seq, kind) where members disagree
    _wait_edges(g, p, edges, node_ids, blame, points)
    _first_mismatch(p.coll, blame, points)
    if not points:
        return None, blame
    seq, kind = min(points)
    return _disagreement(g, p, seq, kind, blame), blame


def _p2p_analysis(g: _Group, readable: set[int], edges: dict[int, set[int]]) -> Disagreement | None:
    """Pending sends paired with pending receives, per (src, dst) pair in order; an unpaired op
    means the peer never posted its side: the op's owner waits for the peer."""
    pending: dict[tuple[int, int, str], list[tuple[int, Entry]]] = defaultdict(list)
    for r, es in g.entries.items():
        for e in es:
            if not e.is_p2p or e.completed or e.src is None or e.dst is None:
                continue
            if min(e.src, e.dst) < 0 or max(e.src, e.dst) >= len(g.ranks):
                continue
            src, dst = g.ranks[e.src], g.ranks[e.dst]
            pending[(src, dst, e.op)].append((r, e))
    first: tuple[int, int, int, Entry] | None = None  # (p2p seq, waiting rank, peer, entry)
    for (src, dst, op), ops in pending.items():
        if op != "send":
            continue
        recvs = pending.get((src, dst, "recv"), [])
        for extra, waiter, peer in ((ops[len(recvs) :], src, dst), (recvs[len(ops) :], dst, src)):
            for _, e in extra:
                edges[waiter].add(peer)
                if first is None or e.p2p_seq_id < first[0]:
                    first = (e.p2p_seq_id, waiter, peer, e)
    for (src, dst, op), recvs in pending.items():
        if op == "recv" and (src, dst, "send") not in pending:
            for _, e in recvs:
                edges[dst].add(src)
                if first is None or e.p2p_seq_id < first[0]:
                    first = (e.p2p_seq_id, dst, src, e)
    if first is None:
        return None
    seq, waiter, peer, e = first
    peer_entries = g.entries.get(peer, [])
    peer_last = peer_entries[-1] if peer_entries else None
    return Disagreement(
        g.name,
        g.desc,
        g.ranks,
        "p2p",
        seq,
        e.profiling_name,
        (
            _at(waiter, "waiting", None, e),
            _at(peer, "missing" if peer in readable else "no dump", None, peer_last),
        ),
    )


def _terminal_components(nodes: set[int], edges: dict[int, set[int]]) -> list[set[int]]:
    """Strongly connected components with no edge leaving them (iterative Kosaraju). A node
    with no edge out (a rank without a dump, say: there may be 10^5 of them) is one such
    component by itself and is not walked."""
    sinks = {n for n in nodes if not edges.get(n)}
    order: list[int] = []
    seen: set[int] = set(sinks)
    for start in sorted(nodes):
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(sorted(edges.get(start, ()))))]
        while stack:
            node, it = stack[-1]
            nxt = next((n for n in it if n not in seen), None)
            if nxt is None:
                order.append(node)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(sorted(edges.get(nxt, ())))))
    reverse: dict[int, set[int]] = defaultdict(set)
    for a, bs in edges.items():
        for b in bs:
            if b not in sinks:
                reverse[b].add(a)
    comp: dict[int, int] = {}
    comps: list[set[int]] = []
    for root in reversed(order):
        if root in comp:
            continue
        members = {root}
        comp[root] = len(comps)
        todo = [root]
        while todo:
            n = todo.pop()
            for m in reverse.get(n, ()):
                if m not in comp:
                    comp[m] = len(comps)
                    members.add(m)
                    todo.append(m)
        comps.append(members)
    return [
        c for i, c in enumerate(comps) if all(comp.get(b) == i for a in c for b in edges[a])
    ] + [{n} for n in sorted(sinks)]


def _expected_ranks(dumps: list[RankDump], groups: Iterable[_Group]) -> set[int]:
    """The ranks with a dump and those the process groups name; InputError beyond
    MAX_WORLD_SIZE (each member list counted once, however many dumps repeat it)."""
    expected_set = {d.rank for d in dumps}
    for ranks in {id(g.ranks): g.ranks for g in groups}.values():
        expected_set.update(ranks)
        if len(expected_set) > MAX_WORLD_SIZE:
            raise InputError(
                f"{dumps[0].path}: the process groups of these dumps name more than "
                f"{MAX_WORLD_SIZE} ranks (MAX_WORLD_SIZE), more than any torch.distributed job "
                "has; pass the dumps of one job."
            )
    return expected_set


def _culprit_reasons(
    edges: dict[int, set[int]],
    sure: dict[int, set[int]],
    blame: dict[int, str],
    readable: set[int],
) -> dict[int, str]:
    """Rank -> why it is a culprit: its blame ("stuck", "mismatched"), else, for a rank others
    wait for in a terminal component of the `sure` waits, "no dump", "deadlock" (the component
    holds several ranks) or "missing"."""
    awaited = {b for bs in edges.values() for b in bs if b >= 0}
    nodes = set(edges) | {b for bs in edges.values() for b in bs}
    culprit_reason: dict[int, str] = dict(blame)
    for comp in _terminal_components(nodes, sure):
        roots = comp & awaited
        for r in roots:
            if r not in readable:
                culprit_reason.setdefault(r, "no dump")
            elif sum(x >= 0 for x in comp) > 1:
                culprit_reason.setdefault(r, "deadlock")
            else:
                culprit_reason.setdefault(r, "missing")
    return culprit_reason


def _culprits(
    dumps: list[RankDump], found: list[Disagreement], culprit_reason: dict[int, str]
) -> list[Culprit]:
    """The culprits by rank: why, the groups where they are a cause, their last op and frame."""
    last_entry = {d.rank: d.entries[-1] for d in dumps if d.entries}
    at_fault: dict[int, set[str]] = defaultdict(set)  # rank -> groups where it is a cause
    for x in found:
        for at in x.ranks:
            if at.status not in ("waiting", "completed") and at.rank in culprit_reason:
                at_fault[at.rank].add(f"{x.pg_name}:{x.pg_desc}")
    culprits = []
    for r, why in sorted(culprit_reason.items()):
        where = sorted(at_fault.get(r, ()))
        e = last_entry.get(r)
        culprits.append(
            Culprit(
                r,
                why,
                tuple(where),
                e.profiling_name if e else "",
                user_frame(e.frames) if e else None,
            )
        )
    return culprits


def analyze_dumps(dumps: list[RankDump]) -> HangAnalysis:
    """The first disagreement per process group and the culprit ranks (see the module doc).
    InputError when the groups and dumps name more than MAX_WORLD_SIZE ranks in all."""
    readable = {d.rank for d in dumps if d.readable}
    groups = _collect_groups([d for d in dumps if d.readable])
    expected_set = _expected_ranks(dumps, groups.values())
    # waiting rank -> the ranks it waits for; negative ids are nodes standing for a set of ranks
    edges: dict[int, set[int]] = defaultdict(set)
    node_ids = itertools.count(-1, -1)
    p2p_edges: dict[int, set[int]] = defaultdict(set)
    blame: dict[int, str] = {}
    found: list[Disagreement] = []
    for g in groups.values():
        dis, group_blame = _collective_analysis(g, readable, edges, node_ids)
        for r, why in group_blame.items():
            blame.setdefault(r, why)
        p2p = _p2p_analysis(g, readable, p2p_edges)
        found.extend(x for x in (dis, p2p) if x is not None)
    # A pending send/recv whose peer left no dump may be paired on the peer's side: that wait
    # is a guess, so it does not make its owner a waiter (it still makes the peer a suspect).
    sure = {w: set(bs) for w, bs in edges.items()}
    for w, bs in p2p_edges.items():
        sure.setdefault(w, set()).update(b for b in bs if b in readable)
        edges[w] |= bs
    culprit_reason = _culprit_reasons(edges, sure, blame, readable)
    culprits = _culprits(dumps, found, culprit_reason)
    culprit_set = set(culprit_reason)
    # Earliest-blocking first: groups where a culprit is at fault, then by time of the op.
    found.sort(
        key=lambda x: (
            not any(at.rank in culprit_set and at.status != "waiting" for at in x.ranks),
            x.pg_desc,
            x.pg_name,
        )
    )
    expected = sorted(expected_set)
    first_readable = next(d for d in dumps if d.readable)
    return HangAnalysis(
        ranks=tuple(d.rank for d in dumps),
        unreadable=tuple(d.rank for d in dumps if not d.readable),
        expected_ranks=tuple(expected),
        disagreements=tuple(found),
        culprits=tuple(culprits),
        waiting=tuple(
            sorted(w for w, bs in edges.items() if bs and w >= 0 and w not in culprit_set)
        ),
        version=first_readable.version,
        comm_lib_version=first_readable.comm_lib_version,
    )
