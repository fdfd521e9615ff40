"""Who a rank is compared with in the straggler ranking: the ranks it shares a process group with.

On a 2-D mesh (HSDP: shard groups {0,1}, {2,3}, replicate groups {0,2}, {1,3}) rank 0 never meets
rank 3 at a collective, so neither its chance of arriving last nor its compute, idle or the
waiting it causes is judged against rank 3's. `RankPeers.of(result)` derives, from the matching
table's group instances (their member ranks, where the traces list them):

- `peers[r]`: the analyzed ranks sharing a group with r (all ranks where no member list is known,
  as on single-group runs, so those are judged as before);
- `group_size[r]`: how many analyzed ranks r's groups hold, most often (the chance that a rank no
  slower than the others arrives last is 1/size);
- `delayed_groups(r)`: the group instances where r arrived last (above the noise), to name a
  slow rank once with the groups it delays;
- `subgroups`: whether any group holds fewer than all analyzed ranks (a 2-D or 3-D job).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from .crossrank import SKEW_NOISE_US, CrossRankResult


@dataclass(frozen=True)
class RankPeers:
    """The ranks each rank is compared with (see the module docstring)."""

    peers: dict[int, frozenset[int]]
    group_size: dict[int, int]
    delayed: dict[int, list[str]]
    subgroups: bool

    @staticmethod
    def of(result: CrossRankResult) -> RankPeers:
        """The peers of each analyzed rank from the matching's group instances."""
        ranks = frozenset(result.ranks)
        t = result.table
        present: dict[int, frozenset[int]] = {}  # group code -> its analyzed members
        for g in np.unique(t.group).tolist():
            members = t.members_of(int(g))
            if members is not None:
                present[int(g)] = frozenset(members) & ranks
        world = any(group == ranks for group in present.values())  # then all are peers
        partial: dict[int, set[int]] = {}
        sizes: dict[int, Counter[int]] = {}
        for group in present.values():
            for r in group:
                if not world:
                    partial.setdefault(r, set()).update(group)
                sizes.setdefault(r, Counter())[len(group)] += 1
        subgroups = any(m != ranks for m in present.values())
        noisy = t.skew_us >= SKEW_NOISE_US
        delayed: dict[int, list[str]] = {}
        for r, g in sorted(
            set(zip(t.last_rank[noisy].tolist(), t.group[noisy].tolist(), strict=True))
        ):
            delayed.setdefault(int(r), []).append(_label(t.groups[g], t.members_of(int(g))))
        return RankPeers(
            peers={r: frozenset(partial[r]) if r in partial else ranks for r in ranks},
            group_size={
                r: max(sizes[r].items(), key=lambda kv: (kv[1], kv[0]))[0]
                if r in sizes
                else len(ranks)
                for r in ranks
            },
            delayed={r: sorted(labels) for r, labels in delayed.items()},
            subgroups=subgroups,
        )

    def size_of(self, rank: int, default: int) -> int:
        """How many ranks `rank` is compared with at a collective (itself included)."""
        return self.group_size.get(rank, default)

    def others(self, rank: int) -> frozenset[int] | None:
        """The ranks `rank` shares a group with, itself excluded (None: all ranks)."""
        mine = self.peers.get(rank)
        return None if mine is None else mine - {rank}


def _label(name: str, members: tuple[int, ...] | None) -> str:
    """A group instance as text: its name and members ("3 [0, 1]")."""
    shown = name or "(unnamed)"
    return f"{shown} {list(members)}" if members is not None else shown
