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

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

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
