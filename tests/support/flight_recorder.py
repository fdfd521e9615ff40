"""Synthetic torch.distributed flight-recorder dumps, in the format torch 2.13 writes.

`FakeJob` records, per rank, the ops a job issued (collectives and send/recv, per process
group, with torch's sequence numbering) and writes one pickle per rank as
`TORCH_FR_DUMP_TEMP_FILE` does: a dict with `version`, `pg_config`, `nccl_version` (2.9, NCCL)
or `comm_lib_version` (2.10, as gloo writes it in torch 2.13), `pg_status` and `entries`.
Tests build hangs with it (a rank missing from a collective, one behind by one op, mismatched
sizes, an unpaired send) without torch or GPUs.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TORCH_PY = "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py"


@dataclass
class _Rank:
    entries: list[dict[str, Any]] = field(default_factory=list)
    record_id: int = 0
    op_id: dict[str, int] = field(default_factory=dict)
    coll_seq: dict[str, int] = field(default_factory=dict)
    p2p_seq: dict[str, int] = field(default_factory=dict)
    last_enqueued: dict[str, int] = field(default_factory=dict)


class FakeJob:
    """A job's flight-recorder buffers, built op by op; `write` dumps them."""

    def __init__(self, world_size: int, *, version: str = "2.9", backend: str = "nccl") -> None:
        self.world_size = world_size
        self.version = version
        self.backend = backend
        self.groups: dict[str, tuple[str, list[int]]] = {
            "0": ("default_pg", list(range(world_size)))
        }
        self.pg_ids: dict[str, int] = {"0": 0}
        self.ranks = {r: _Rank() for r in range(world_size)}
        self.time_ns = 1_758_610_000_000_000_000

    def group(self, name: str, desc: str, ranks: list[int]) -> str:
        """Declare a process group (every member lists it in its pg_config)."""
        self.groups[name] = (desc, list(ranks))
        self.pg_ids[name] = len(self.pg_ids)
        return name

    def _entry(self, rank: int, pg: str, name: str, *, p2p: bool, **kw: Any) -> dict[str, Any]:
        st = self.ranks[rank]
        st.op_id[pg] = st.op_id.get(pg, 0) + 1
        if p2p:
            st.p2p_seq[pg] = st.p2p_seq.get(pg, 0) + 1
            st.last_enqueued[pg] = st.p2p_seq[pg]
        else:
            st.coll_seq[pg] = st.coll_seq.get(pg, 0) + 1
            st.last_enqueued[pg] = st.coll_seq[pg]
        self.time_ns += 1000
        state = kw.get("state", "scheduled")
        sizes = kw.get("sizes", [[1024]])
        frames = kw.get("frames")
        e: dict[str, Any] = {
            "record_id": st.record_id,
            "pg_id": self.pg_ids[pg],
            "process_group": (pg, self.groups[pg][0]),
            "collective_seq_id": st.coll_seq.get(pg, 0),
            "p2p_seq_id": st.p2p_seq.get(pg, 0),
            "op_id": st.op_id[pg],
            "profiling_name": f"{self.backend}:{name}",
            "time_created_ns": self.time_ns,
            "input_sizes": sizes,
            "input_dtypes": [kw.get("dtype", "Float")] * len(sizes),
            "output_sizes": kw.get("out_sizes", sizes),
            "output_dtypes": [kw.get("dtype", "Float")] * len(kw.get("out_sizes", sizes)),
            "state": state,
            "time_discovered_started_ns": self.time_ns + 10 if state != "scheduled" else None,
            "time_discovered_completed_ns": self.time_ns + 20 if state == "completed" else None,
            "retired": state == "completed",
            "timeout_ms": 600000,
            "is_p2p": p2p,
            "thread_name": "pt_main_thread",
            "thread_id": "140000000000000",
        }
        if frames is not None:
            e["frames"] = frames
        st.record_id += 1
        st.entries.append(e)
        return e

    def collective(
        self,
        pg: str = "0",
        op: str = "all_reduce",
        *,
        ranks: list[int] | None = None,
        state: str | dict[int, str] = "completed",
        sizes: list[list[int]] | dict[int, list[list[int]]] | None = None,
        op_by_rank: dict[int, str] | None = None,
        frames: dict[int, list[dict[str, Any]]] | None = None,
        dtype: str = "Float",
    ) -> None:
        """One collective on `pg`, issued by `ranks` (default: every member)."""
        members = self.groups[pg][1] if ranks is None else ranks
        for r in members:
            s = state if isinstance(state, str) else state.get(r, "scheduled")
            sz = sizes.get(r, [[1024]]) if isinstance(sizes, dict) else (sizes or [[1024]])
            name = (op_by_rank or {}).get(r, op)
            self._entry(
                r, pg, name, p2p=False, state=s, sizes=sz, dtype=dtype, frames=(frames or {}).get(r)
            )

    def p2p(
        self,
        pg: str,
        src: int,
        dst: int,
        *,
        sides: tuple[str, ...] = ("send", "recv"),
        state: str = "completed",
        sizes: list[list[int]] | None = None,
    ) -> None:
        """A send from global rank `src` to `dst` on `pg` (names use group-local ranks)."""
        members = self.groups[pg][1]
        ls, ld = members.index(src), members.index(dst)
        if "send" in sides:
            self._entry(src, pg, f"send {ls}->{ld}", p2p=True, state=state, sizes=sizes or [[8]])
        if "recv" in sides:
            self._entry(dst, pg, f"recv {ld}<-{ls}", p2p=True, state=state, sizes=sizes or [[8]])

    def dump_dict(self, rank: int, *, only_active: bool = False) -> dict[str, Any]:
        """The dict torch pickles for `rank` (key order as torch writes it)."""
        st = self.ranks[rank]
        mine = {n: g for n, g in self.groups.items() if rank in g[1]}
        entries = [e for e in st.entries if not (only_active and e["state"] == "completed")]
        status = {}
        for name in mine:
            done = [
                e["p2p_seq_id"] if e["is_p2p"] else e["collective_seq_id"]
                for e in st.entries
                if e["process_group"][0] == name and e["state"] == "completed"
            ]
            status[str(self.pg_ids[name])] = {
                "last_enqueued_collective": st.last_enqueued.get(name, -1),
                "last_started_collective": -1,
                "last_completed_collective": max(done) if done else -1,
            }
        lib_key = "comm_lib_version" if self.version >= "2.10" else "nccl_version"
        return {
            "version": self.version,
            "pg_config": {
                n: {"name": n, "desc": d, "ranks": str(rs)} for n, (d, rs) in mine.items()
            },
            lib_key: "2.27.3",
            "pg_status": status,
            "entries": entries,
        }

    def write(
        self,
        folder: Path,
        *,
        prefix: str = "nccl_trace_rank_",
        only_active: bool = False,
        empty: tuple[int, ...] = (),
        truncated: tuple[int, ...] = (),
        skip: tuple[int, ...] = (),
    ) -> list[Path]:
        """One dump per rank, `<prefix><rank>`; `empty` ranks get a 0-byte file (a frozen
        process), `truncated` ones the first half of theirs, `skip` ones none."""
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for rank in range(self.world_size):
            if rank in skip:
                continue
            path = folder / f"{prefix}{rank}"
            data = pickle.dumps(self.dump_dict(rank, only_active=only_active), protocol=2)
            if rank in empty:
                data = b""
            elif rank in truncated:
                data = data[: len(data) // 2]
            path.write_bytes(data)
            paths.append(path)
        return paths


def frame(name: str, filename: str, line: int) -> dict[str, Any]:
    """A frame dict as torch records it."""
    return {"name": name, "filename": filename, "line": line}
