"""The process groups a trace header declares: the map's part of `run/process_groups.py`.

torch >= 2.2 writes one `distributedInfo.pg_config` entry per process group the rank belongs to
(`pg_name`, `pg_desc` such as "default_pg", "mesh_shard" or a user's group name, `pg_size`,
`ranks`: the member ranks); each rank keeps them as `RankFacts.process_groups`. The members are
what identifies a group *instance*: on a 2-D mesh the shard groups of ranks 0 and 2 are
different groups ({0,1} and {2,3}), and with `split_group` they can even share a name.

`group_members(infos, names)` resolves the process-group names of a rank's collective calls to
the member ranks of the group each names (what the cross-rank matching keys groups by).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from ..inputs.events import EventKind, RankTrace

Members = tuple[int, ...]


class ProcessGroupInfo(msgspec.Struct, kw_only=True):
    """One `distributedInfo.pg_config` entry: the group's name, description, declared size and
    member ranks (None when the trace does not list them: older summaries and torch versions)."""

    name: str
    description: str = ""
    size: int | None = None
    ranks: list[int] | None = None


def declared_groups(info: Mapping[str, Any] | None) -> list[ProcessGroupInfo]:
    """The process groups a trace header declares (`distributedInfo.pg_config`), tolerant of
    missing or malformed entries (skipped) and member lists (None)."""
    entries = (info or {}).get("pg_config")
    if not isinstance(entries, list):
        return []
    out = []
    for pg in entries:
        if not isinstance(pg, dict) or not isinstance(pg.get("pg_name"), str | int):
            continue
        size = pg.get("pg_size")
        desc = pg.get("pg_desc")
        out.append(
            ProcessGroupInfo(
                name=str(pg["pg_name"]),
                description=desc if isinstance(desc, str) else "",
                size=size if isinstance(size, int) and not isinstance(size, bool) else None,
                ranks=_ranks(pg.get("ranks")),
            )
        )
    return out


MAX_CALL_RANKS_CHARS = 1 << 20
"""A per-call `Process Group Ranks` string longer than this is not read (a 100k-rank group's
list is ~700 kB)."""


def groups_from_calls(
    infos: Sequence[ProcessGroupInfo], call_args: Iterable[Mapping[str, Any]]
) -> list[ProcessGroupInfo]:
    """`infos` (the header's groups) completed by what the collective calls themselves say:
    NCCL-era traces carry `Process Group Name`, `Process Group Description` and `Process Group
    Ranks` ("[0, 1]") on each `record_param_comms` op and kernel. A group the header lists with
    its members stays as it is; one it lists without members gets the calls' members; one it
    does not list at all is added."""
    by_name = {info.name: info for info in infos}
    for args in call_args:
        name = args.get("Process Group Name")
        ranks_text = args.get("Process Group Ranks")
        if not isinstance(name, str | int) or not isinstance(ranks_text, str):
            continue
        key = str(name)
        known = by_name.get(key)
        if known is not None and known.ranks is not None:
            continue
        ranks = _parse_ranks(ranks_text)
        if ranks is None:
            continue
        desc = args.get("Process Group Description")
        by_name[key] = ProcessGroupInfo(
            name=key,
            description=known.description if known else desc if isinstance(desc, str) else "",
            size=known.size if known and known.size else len(ranks),
            ranks=ranks,
        )
    return list(by_name.values())


def _parse_ranks(text: str) -> list[int] | None:
    """ "[0, 1, 2]" -> [0, 1, 2]; None for anything else (empty, malformed, too long)."""
    if len(text) > MAX_CALL_RANKS_CHARS or not text.startswith("[") or not text.endswith("]"):
        return None
    parts = [p.strip() for p in text[1:-1].split(",")]
    if not parts or not all(p.isdigit() for p in parts):
        return None
    return _ranks([int(p) for p in parts])


def _ranks(value: object) -> list[int] | None:
    """A member list: distinct non-negative ints, sorted (None when absent or malformed)."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in value):
        return None
    return sorted(set(value))


def group_members(
    infos: Sequence[ProcessGroupInfo], names: Sequence[str]
) -> tuple[list[Members | None], set[int]]:
    """Per name of `names` (a rank's collective calls' process-group names), the members of the
    group it names on this rank (None when unknown), and the indices of the names that cannot
    be attributed: "" (the calls say no group, as on gloo) while the rank declares groups of
    different members, so any of them may have carried the call.

    "" is the rank's one group when all its declared groups have the same members (one group,
    or several spanning the same ranks)."""
    by_name: dict[str, Members] = {}
    member_sets: set[Members] = set()
    for info in infos:
        if info.ranks is not None:
            by_name.setdefault(info.name, tuple(info.ranks))
            member_sets.add(tuple(info.ranks))
    out: list[Members | None] = []
    unattributed: set[int] = set()
    for i, name in enumerate(names):
        if name:
            out.append(by_name.get(name))
        elif len(member_sets) == 1:
            out.append(next(iter(member_sets)))
        else:
            out.append(None)
            if len(member_sets) > 1:
                unattributed.add(i)
    return out, unattributed


def trace_groups(trace: RankTrace) -> list[ProcessGroupInfo]:
    """A trace's process groups: its header's (`declared_groups`), completed by the members its
    collective calls name (`groups_from_calls`). What every part of the map reads."""
    calls = (
        trace.args.get(i) or {}
        for i in trace.of_kind(EventKind.COMM_OP, EventKind.COMM_KERNEL).tolist()
    )
    return groups_from_calls(declared_groups(trace.distributed_info), calls)


def sizes_by_name(infos: Iterable[ProcessGroupInfo]) -> dict[str, int]:
    """Each declared group's size by its name (the declared size, else its member count);
    groups of unknown size are left out."""
    out: dict[str, int] = {}
    for g in infos:
        size = g.size or (len(g.ranks) if g.ranks else 0)
        if size:
            out[g.name] = size
    return out


def members_by_name(infos: Iterable[ProcessGroupInfo]) -> dict[str, tuple[int, ...]]:
    """Each declared group's member ranks by its name; groups that do not list them are left
    out."""
    return {g.name: tuple(g.ranks) for g in infos if g.ranks}
