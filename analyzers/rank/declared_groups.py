"""The process groups a trace header declares: the map's part of `run/process_groups.py`.

torch >= 2.2 writes one `distributedInfo.pg_config` entry per process group (`pg_name`,
`pg_desc` such as "default_pg" or a user's group name, `pg_size`); each rank keeps them as
`RankFacts.process_groups` (name, description, declared size; not the member list, which would
make every summary O(world size)).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec


class ProcessGroupInfo(msgspec.Struct, kw_only=True):
    """One `distributedInfo.pg_config` entry: the group's name, description and declared size."""

    name: str
    description: str = ""
    size: int | None = None


def declared_groups(info: Mapping[str, Any] | None) -> list[ProcessGroupInfo]:
    """The process groups a trace header declares (`distributedInfo.pg_config`), tolerant of
    missing or malformed entries (skipped)."""
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
            )
        )
    return out
