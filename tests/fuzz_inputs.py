"""Malformed-input generators shared by the fuzz tests and `bench/fuzz_long.py`.

Every generator is a pure function of a `random.Random`, so a seed reproduces a case. The base
inputs are small slices of the real traces under `sample_traces/` and `tests/data/` (the first
events of one profiled step, plus collective kernels carrying Kineto's collective args), so
mutations exercise the decoding paths real files take.
"""

from __future__ import annotations

import copy
import gzip
import json
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASE_TRACES = (
    ROOT / "sample_traces" / "missing-overlap" / "traces" / "rank-0.json.gz",
    ROOT / "tests" / "data" / "deepspeed_zero2" / "traces" / "rank-0.json.gz",
)
BASE_EVENTS = 600

# Values an adversary puts where a field belongs.
HOSTILE_VALUES: tuple[Any, ...] = (
    None,
    True,
    -3,
    0,
    2**63,
    2**64 + 1,
    -(2**63) - 1,
    10**30,
    1e300,
    -1e300,
    1.7e308,
    -1.7e308,
    5e-324,
    1.5,
    "",
    "x",
    "12",
    "nan",
    "1e999",
    "\u202e\u0000",
    [],
    [1, [2, [3]]],
    {},
    {"a": {"b": None}},
    "A" * 5000,
)


class Deep:
    """A placeholder for a value nested `depth` lists deep: `dumps` writes it as text, so no
    Python object that deep is ever built (the json module cannot encode one)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth


def deep(depth: int) -> Deep:
    """A value nested `depth` lists deep (see `Deep`)."""
    return Deep(depth)


def dumps(doc: Any) -> bytes:
    """JSON text of `doc`, `Deep` placeholders written out (NaN/Infinity allowed, as Python's
    json module writes them)."""
    depths: set[int] = set()

    def placeholder(o: Any) -> str:
        if isinstance(o, Deep):
            depths.add(o.depth)
            return f"__deep_{o.depth}__"
        raise TypeError(type(o).__name__)

    text = json.dumps(doc, default=placeholder).encode()
    for d in depths:
        text = text.replace(f'"__deep_{d}__"'.encode(), deep_json(d))
    return text


def deep_json(depth: int, opener: str = "[") -> bytes:
    """JSON text nested `depth` deep (no Python object is built)."""
    closer = {"[": "]", "{": "}"}[opener]
    if opener == "{":
        return (b'{"a":' * depth) + b"0" + (b"}" * depth)
    return (opener * depth + "0" + closer * depth).encode()


_BASE_CACHE: dict[int, dict[str, Any]] = {}


def base_trace(which: int = 0) -> dict[str, Any]:
    """A small real trace: the header and the first `BASE_EVENTS` events of a real one, plus two
    collective kernels with Kineto's collective args and one ProfilerStep span over them."""
    if which not in _BASE_CACHE:
        doc = json.loads(gzip.decompress(BASE_TRACES[which].read_bytes()))
        events = doc["traceEvents"]
        meta = [e for e in events if e.get("ph") == "M"]
        spans = [e for e in events if e.get("ph") == "X" and isinstance(e.get("ts"), int | float)]
        spans.sort(key=lambda e: e["ts"])
        kept = spans[:BASE_EVENTS]
        t0 = kept[0]["ts"]
        t1 = max(e["ts"] + e.get("dur", 0) for e in kept)
        step = {
            "ph": "X",
            "cat": "user_annotation",
            "name": "ProfilerStep#7",
            "pid": kept[0]["pid"],
            "tid": kept[0]["tid"],
            "ts": t0,
            "dur": t1 - t0,
            "args": {"External id": 1},
        }
        coll_args = {
            "External id": 2099,
            "Process Group Name": "0",
            "Out msg nelems": 2049000,
            "Process Group Ranks": "[0, 1]",
            "Group size": 2,
            "In msg nelems": 2049000,
            "dtype": "Float",
            "Process Group Description": "default_pg",
            "Collective name": "allreduce",
            "Input Dims": [[2049000]],
        }
        comm = [
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "record_param_comms",
                "pid": kept[0]["pid"],
                "tid": kept[0]["tid"],
                "ts": t0 + 10,
                "dur": 5,
                "args": dict(coll_args),
            },
            {
                "ph": "X",
                "cat": "kernel",
                "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
                "pid": 0,
                "tid": 7,
                "ts": t0 + 12,
                "dur": 20,
                "args": dict(coll_args, correlation=5),
            },
        ]
        doc["traceEvents"] = [*meta, step, *kept, *comm]
        _BASE_CACHE[which] = doc
    return copy.deepcopy(_BASE_CACHE[which])


def trace_bytes(doc: Any) -> bytes:
    """A trace document as JSON text."""
    return dumps(doc)


# --- trace mutations ------------------------------------------------------------------------

_EVENT_FIELDS = ("ph", "cat", "name", "pid", "tid", "ts", "dur", "args")
_ARG_FIELDS = (
    "External id",
    "correlation",
    "In msg nelems",
    "Out msg nelems",
    "Group size",
    "Input Dims",
    "Input type",
    "Collective name",
    "dtype",
    "Process Group Ranks",
    "Process Group Name",
    "name",
)
_HEADER_FIELDS = (
    "distributedInfo",
    "deviceProperties",
    "host_name",
    "baseTimeNanoseconds",
    "traceEvents",
)


def hostile(rng: random.Random) -> Any:
    """One hostile value: a fixed one, a deep nest, or a random number at the edges."""
    r = rng.random()
    if r < 0.7:  # a copy: a mutation inside it must not change the table (or make a cycle)
        return copy.deepcopy(rng.choice(HOSTILE_VALUES))
    if r < 0.8:
        return deep(rng.choice((5, 200, 2000)))
    if r < 0.9:
        return rng.choice((1, -1)) * 2 ** rng.randint(50, 80)
    return rng.uniform(-1e3, 1e3) * 10 ** rng.randint(0, 300)


def mutate_trace_fields(rng: random.Random, doc: dict[str, Any], n: int = 3) -> dict[str, Any]:
    """`n` field mutations: an event field, a collective arg, the ProfilerStep number, a header
    block (distributedInfo's rank included) set to a hostile value, or dropped."""
    events = doc.get("traceEvents") or []
    for _ in range(n):
        what = rng.random()
        if what < 0.35 and events:
            e = rng.choice(events)
            key = rng.choice(_EVENT_FIELDS)
            if rng.random() < 0.15:
                e.pop(key, None)
            else:
                e[key] = hostile(rng)
        elif what < 0.6 and events:
            with_args = [e for e in events if isinstance(e.get("args"), dict)]
            e = rng.choice(with_args or events)
            args = e.setdefault("args", {}) if isinstance(e, dict) else {}
            if isinstance(args, dict):
                args[rng.choice(_ARG_FIELDS)] = hostile(rng)
        elif what < 0.7 and events:
            steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
            if steps:
                number = rng.choice(("9" * 25, str(2**63), "-1", "x", "1e5", "", "٣"))
                steps[0]["name"] = f"ProfilerStep#{number}"
        elif what < 0.85:
            info = doc.setdefault("distributedInfo", {})
            if isinstance(info, dict):
                info[rng.choice(("rank", "world_size", "backend", "pg_config"))] = hostile(rng)
        else:
            doc[rng.choice(_HEADER_FIELDS)] = hostile(rng)
    return doc


def flip_bytes(rng: random.Random, data: bytes, n: int = 1) -> bytes:
    """`data` with `n` random bytes changed (invalid UTF-8 and broken structure included)."""
    buf = bytearray(data)
    for _ in range(n):
        i = rng.randrange(len(buf))
        r = rng.random()
        if r < 0.5:
            buf[i] ^= 1 << rng.randrange(8)
        elif r < 0.8:
            buf[i] = rng.choice((0x80, 0xC0, 0xFF, 0xED, 0x00, 0x22, 0x5C, 0x5B, 0x7B))
        else:
            buf[i] = rng.randrange(256)
    return bytes(buf)


def structured_trace(rng: random.Random) -> bytes:
    """A structurally malformed trace document (hand-written shapes, then randomized)."""
    ev = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1.0, "dur": 2.0}
    shapes: list[Callable[[], Any]] = [
        lambda: {"traceEvents": deep(rng.choice((600, 5000, 30000)))},
        lambda: {"traceEvents": [dict(ev, args=deep(3000))]},
        lambda: {"traceEvents": [dict(ev, name=deep(1000))]},
        lambda: {"traceEvents": [dict(ev, ts=None), dict(ev, ts=5.0)]},
        lambda: {"traceEvents": [dict(ev, ts=1e300), dict(ev, ts=3.0)]},
        lambda: {"traceEvents": [dict(ev, ts=t) for t in (1.0, 2.0, 1e18)]},
        lambda: {"traceEvents": [ev], "distributedInfo": {"rank": hostile(rng)}},
        lambda: {"traceEvents": [dict(ev, args={"External id": 2**63})]},
        lambda: {"traceEvents": [dict(ev, args={"External id": -(2**70)})]},
        lambda: {"traceEvents": [dict(ev, args="oops")]},
        lambda: {"traceEvents": [dict(ev, args=[1, 2])]},
        lambda: {"traceEvents": [dict(ev, pid=hostile(rng), tid=hostile(rng))]},
        lambda: {"traceEvents": [dict(ev, ph=hostile(rng))]},
        lambda: {"traceEvents": {"not": "a list"}},
        lambda: {"traceEvents": [None, 1, "x", []]},
        lambda: {"traceEvents": [dict(ev, dur=hostile(rng))]},
        lambda: {"traceEvents": [dict(ev, ts=hostile(rng))]},
        lambda: {"traceEvents": [ev], "deviceProperties": hostile(rng)},
        lambda: {"traceEvents": [ev], "baseTimeNanoseconds": hostile(rng)},
        lambda: [ev, dict(ev, ts=hostile(rng))],
    ]
    doc = rng.choice(shapes)()
    text = dumps(doc)
    if rng.random() < 0.2:  # and some damage on top
        text = flip_bytes(rng, text, rng.randint(1, 3))
    if rng.random() < 0.1:
        text = text[: rng.randrange(1, len(text))]
    return text


def raw_junk(rng: random.Random) -> bytes:
    """Bytes that are not a trace at all (deep JSON, binary, invalid UTF-8, a gzip of junk)."""
    choice = rng.randrange(6)
    if choice == 0:
        return deep_json(rng.choice((1000, 10000, 60000)), rng.choice("[{"))
    if choice == 1:
        return b'{"traceEvents": [' + deep_json(rng.choice((2000, 20000))) + b"]}"
    if choice == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))
    if choice == 3:
        return b'{"traceEvents": [{"ph": "X", "name": "\xff\xfe\xc0", "ts": 1, "dur": 1}]}'
    if choice == 4:
        return gzip.compress(bytes(rng.randrange(256) for _ in range(200)))
    return b'{"traceEvents": []}' + b"\x00" * rng.randint(0, 10)


# --- memory timelines -----------------------------------------------------------------------


def memory_timeline(rng: random.Random) -> bytes:
    """A malformed memory timeline (coalesced or raw form)."""
    n = rng.randint(0, 6)
    times = [1_000_000 + i for i in range(n)]
    sizes = [[0, 10 * i, 0, 0, 0, 5, 0, 0, 0] for i in range(n)]
    raw = [[1000 * (i + 1), rng.choice((1, 2, 3, 4)), 100, rng.randrange(8)] for i in range(n)]
    shapes: list[Callable[[], Any]] = [
        lambda: [times, sizes],
        lambda: [times, [[hostile(rng)] * 9 for _ in times]],
        lambda: [[hostile(rng) for _ in times], sizes],
        lambda: [times, [[2**63] * 9 for _ in times]],
        lambda: [times, sizes[:-1]],
        lambda: [times, [hostile(rng) for _ in times]],
        lambda: [[], []],
        lambda: raw,
        lambda: [[r[0], r[1], hostile(rng), r[3]] for r in raw],
        lambda: [[2**63, 1, 1, 1], *raw],
        lambda: [[1, 9, 1, 99]],
        lambda: [hostile(rng), hostile(rng)],
        lambda: hostile(rng),
        lambda: deep(rng.choice((500, 5000, 50000))),
        lambda: [times, deep(3000)],
    ]
    text = dumps(rng.choice(shapes)())
    if rng.random() < 0.2:
        text = flip_bytes(rng, text, 1)
    return gzip.compress(text) if rng.random() < 0.5 else text


# --- snapshots ------------------------------------------------------------------------------


def snapshot_doc() -> dict[str, Any]:
    """A small, plausible `torch.cuda.memory._snapshot()` dict."""
    frames = [
        {"filename": "/x/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
        {"filename": "/x/train.py", "line": 9, "name": "step"},
    ]
    blocks = [
        {"size": 1 << 20, "state": "active_allocated", "frames": frames},
        {"size": 1 << 19, "state": "inactive", "frames": []},
    ]
    return {
        "segments": [{"device": 0, "total_size": 4 << 20, "blocks": blocks}],
        "device_traces": [[{"action": "oom", "size": 1 << 21, "device_free": 100}]],
    }


def snapshot_pickle(rng: random.Random) -> bytes:
    """A malformed or hostile snapshot pickle (wrong types, shared references, memo tricks)."""
    choice = rng.randrange(9)
    doc = snapshot_doc()
    if choice == 0:  # a field of the wrong type
        seg = doc["segments"][0]
        target = rng.choice((seg, seg["blocks"][0], doc["device_traces"][0][0], doc))
        target[rng.choice(list(target))] = hostile(rng)
        return pickle.dumps(doc, protocol=rng.choice((2, 4, 5)))
    if choice == 1:  # shared references: one segment repeated many times
        seg = doc["segments"][0]
        seg["blocks"] = seg["blocks"] * 500
        doc["segments"] = [seg] * 2000
        return pickle.dumps(doc, protocol=4)
    if choice == 2:  # memo index far out (PUT/GET tricks)
        return rng.choice(
            (
                b"\x80\x04]r\xff\xff\xff\x07.",  # LONG_BINPUT 2**27-ish
                b"\x80\x04]r\xff\xff\xff\xff.",
                b"\x80\x04]q\xffh\xff.",
                b"\x80\x02]p99999999999\n.",
                b"\x80\x04]j\xff\xff\xff\x7f.",  # LONG_BINGET of a missing index
            )
        )
    if choice == 3:  # a global (must never be loaded)
        return b"cos\nsystem\n(S'true'\ntR."
    if choice == 4:  # truncated
        data = pickle.dumps(doc)
        return data[: rng.randrange(1, len(data))]
    if choice == 5:
        return flip_bytes(rng, pickle.dumps(doc, protocol=4), rng.randint(1, 4))
    if choice == 6:  # a declared length far beyond the data
        return b"\x80\x04\x8e\xff\xff\xff\xff\xff\xff\x00\x00."
    if choice == 7:  # deep nesting
        n = rng.choice((100, 900, 100_000))  # {"segments": [[[...]]]}, written opcode by opcode
        return b"\x80\x04}(\x8c\x08segments" + b"]" * n + b"a" * (n - 1) + b"u."
    return pickle.dumps(hostile(rng))


def shared_reference_bomb(levels: int = 28) -> bytes:
    """A ~200-byte pickle whose every list holds the previous one twice (2**levels leaves if
    walked naively): the shape a "40 KB pickle that runs for minutes" takes."""
    ops = bytearray(b"\x80\x04")
    ops += b"}\x94"  # EMPTY_DICT, MEMOIZE (memo 0): the innermost block-like dict
    for i in range(levels):  # MARK, BINGET i, BINGET i, LIST, MEMOIZE (memo i+1)
        ops += b"(h" + bytes([i]) + b"h" + bytes([i]) + b"l\x94"
    ops += b"."
    return bytes(ops)


# --- run directories (manifest, OOM records, timelines, snapshots through `zdiag analyze`) ----

SAMPLE_RUN = ROOT / "sample_traces" / "activation-oom"


def _json_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value in a JSON tree (keys and indices), the root excluded."""
    out = []
    stack = [(prefix, node)]
    while stack:
        path, value = stack.pop()
        items: list[tuple[Any, Any]] = []
        if isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, list):
            items = list(enumerate(value))
        for k, v in items:
            out.append((*path, k))
            stack.append(((*path, k), v))
    return out


def mutate_json_doc(rng: random.Random, doc: Any, n: int = 2) -> Any:
    """`n` mutations of a JSON document: a value anywhere replaced by a hostile one, or removed."""
    for _ in range(n):
        paths = _json_paths(doc)
        if not paths:
            return hostile(rng)
        path = rng.choice(paths)
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if rng.random() < 0.15 and isinstance(parent, dict):
            parent.pop(path[-1], None)
        else:
            parent[path[-1]] = hostile(rng)
    return doc


def make_run_dir(dst: Path) -> Path:
    """A small run directory shaped like `zdiag run`'s: two ranks' traces (small real slices),
    the manifest, memory timelines, OOM records and a CUDA snapshot for rank 0."""
    (dst / "traces").mkdir(parents=True)
    (dst / "memory").mkdir()
    manifest = json.loads((SAMPLE_RUN / "manifest.json").read_text())
    for rank in (0, 1):
        doc = base_trace(0)
        doc["distributedInfo"]["rank"] = rank
        (dst / "traces" / f"rank-{rank}.json.gz").write_bytes(gzip.compress(dumps(doc), 1))
        for name in (f"rank-{rank}.timeline.json.gz", f"rank-{rank}.oom.json"):
            (dst / "memory" / name).write_bytes((SAMPLE_RUN / "memory" / name).read_bytes())
    (dst / "memory" / "rank-0.snapshot.pickle").write_bytes(pickle.dumps(snapshot_doc()))
    # rank 0's OOM record names no categories, so `zdiag analyze` reads its snapshot
    oom = json.loads((dst / "memory" / "rank-0.oom.json").read_text())
    oom["error"] = "CUDA out of memory. Tried to allocate 2.00 MiB."
    oom["memory_snapshot"] = "memory/rank-0.snapshot.pickle"
    (dst / "memory" / "rank-0.oom.json").write_text(json.dumps(oom))
    manifest["ranks"][0]["memory_snapshot"] = "memory/rank-0.snapshot.pickle"
    manifest["ranks"][0]["device"] = "cuda:0"
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


RUN_DIR_TARGETS = ("manifest", "timeline", "oom", "snapshot", "trace")


def mutate_run_dir(rng: random.Random, run_dir: Path, target: str) -> None:
    """Damage one file of a `make_run_dir` folder: field mutations or byte flips."""
    if target == "manifest":
        path = run_dir / "manifest.json"
        doc = mutate_json_doc(rng, json.loads(path.read_text()), rng.randint(1, 3))
        data = dumps(doc)
    elif target == "oom":
        path = run_dir / "memory" / "rank-0.oom.json"
        data = dumps(mutate_json_doc(rng, json.loads(path.read_text()), rng.randint(1, 3)))
    elif target == "timeline":
        path = run_dir / "memory" / "rank-0.timeline.json.gz"
        data = memory_timeline(rng)
    elif target == "snapshot":
        path = run_dir / "memory" / "rank-0.snapshot.pickle"
        data = snapshot_pickle(rng)
    else:
        path = run_dir / "traces" / "rank-1.json.gz"
        data = gzip.compress(dumps(mutate_trace_fields(rng, base_trace(0), rng.randint(1, 3))), 1)
    if rng.random() < 0.2 and target in ("manifest", "oom"):
        data = flip_bytes(rng, data, rng.randint(1, 3))
    path.write_bytes(data)


# --- running a case ---------------------------------------------------------------------------


def run_zdiag(argv: list[str]) -> tuple[int, str, float]:
    """`zdiag.cli.main(argv)` in this process: (exit code, stderr, seconds). stdout is dropped."""
    import contextlib
    import io
    import time

    from zdiag.cli import main

    err = io.StringIO()
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    start = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse
            rc = int(exc.code or 0)
    return rc, err.getvalue(), time.perf_counter() - start


def verdict(rc: int, stderr: str) -> str | None:
    """What is wrong with a case's outcome (None when fine): an exit code other than 0, 1 or 2
    (70 is an internal error), a traceback, or an error that is not one line."""
    if rc not in (0, 1, 2):
        return f"exit {rc}: {stderr.strip()[-300:]}"
    if "Traceback" in stderr:
        return f"traceback on stderr: {stderr[-300:]}"
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    if rc == 2 and len(errors) != 1:
        return f"exit 2 without exactly one error sentence: {stderr[-300:]!r}"
    return None


# --- flight-recorder dumps ------------------------------------------------------------------


def make_dump_dir(dst: Path) -> Path:
    """Four ranks' flight-recorder dumps of a job hung at its 4th all-reduce (rank 2 missing),
    as `tests/support/flight_recorder.FakeJob` writes them (torch 2.13's format)."""
    from support.flight_recorder import FakeJob

    job = FakeJob(4)
    frames = [{"filename": "/x/train.py", "line": 3, "name": "step"}]
    for _ in range(3):
        job.collective(frames={r: frames for r in range(4)})
    job.collective(ranks=[0, 1, 3], state="scheduled")
    dst.mkdir(parents=True)
    job.write(dst)
    return dst


def mutate_dump(rng: random.Random, path: Path, shared: tuple[int, int] = (1000, 100)) -> None:
    """Damage one rank's dump: field mutations, wrong types, shared references (`shared`: one
    entry referenced that many times, with a stack that deep), memo tricks, byte flips or
    truncation (the pickle is rewritten in place)."""
    data = path.read_bytes()
    doc = pickle.loads(data)
    choice = rng.randrange(6)
    if choice == 0:
        out = pickle.dumps(mutate_json_doc(rng, doc, rng.randint(1, 4)), protocol=2)
    elif choice == 1:  # one entry referenced many times, with a long shared stack
        entry = doc["entries"][-1]
        stack = [{"filename": f"/x/{i}.py", "line": i, "name": "f"} for i in range(shared[1])]
        entry["frames"] = stack
        doc["entries"] = [entry] * shared[0]
        out = pickle.dumps(doc, protocol=2)
    elif choice == 2:  # a memo index far out, inside a dump that sniffs as one
        out = (
            b"\x80\x02}q\x00(X\x07\x00\x00\x00versionq\x01X\x03\x00\x00\x002.9q\x02"
            b"X\x07\x00\x00\x00entriesq\x03]r\xff\xff\xff\x07u."
        )
    elif choice == 3:
        out = flip_bytes(rng, data, rng.randint(1, 4))
    elif choice == 4:
        out = data[: rng.randrange(1, len(data))]
    else:
        doc["entries"] = [hostile(rng) for _ in range(rng.randint(1, 4))]
        out = pickle.dumps(doc, protocol=2)
    path.write_bytes(out)
