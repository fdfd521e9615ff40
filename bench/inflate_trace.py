"""Build big benchmark traces by repeating a real Kineto trace in time.

Copy k of the events is shifted by k x period (period = the trace's span plus a 1 ms gap), its
`ProfilerStep#N` renumbered to N + k x (steps per copy) so step numbers stay increasing and
unique, and its ids (`correlation`, `External id`, flow `id`) offset so they stay unique.
Metadata events (`"ph": "M"`) are written once. Whole copies only: the output is the fewest
copies that reach the target size (compact JSON), so it overshoots by less than one source trace.

    python bench/inflate_trace.py SRC.json.gz OUT.json --target-mb 1000
    python bench/inflate_trace.py SRC.json.gz OUTDIR --target-mb 200 --ranks 8

With --ranks N, OUTDIR gets rank-0.json ... rank-{N-1}.json whose `distributedInfo` says rank r of
N (the same events on each rank: a benchmark input, not a model of stragglers).
Write outputs to /tmp (or another scratch disk), never into the repository.
"""

from __future__ import annotations

import argparse
import gzip
import math
import re
import sys
from pathlib import Path
from typing import Any

import orjson

GAP_US = 1000.0
"""Idle gap between copies, so the copies never overlap in time."""

_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
_ID_ARGS = ("correlation", "External id")


def load_trace(path: Path) -> dict[str, Any]:
    """The trace's top-level object (gunzipped when the file is gzip)."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    trace = orjson.loads(data)
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Kineto trace (no 'traceEvents' list)")
    return trace


def _numeric_ts(ev: dict[str, Any]) -> bool:
    return isinstance(ev.get("ts"), int | float)


def plan(events: list[dict[str, Any]]) -> tuple[float, int, int]:
    """(period_us, steps per copy, id offset per copy) for repeating `events`."""
    starts = [float(e["ts"]) for e in events if _numeric_ts(e) and e.get("ph") != "M"]
    ends = [
        float(e["ts"]) + float(e.get("dur") or 0)
        for e in events
        if _numeric_ts(e) and e.get("ph") != "M"
    ]
    if not starts:
        raise ValueError("the trace has no timed events to repeat")
    period = float(math.ceil(max(ends) - min(starts) + GAP_US))
    step_numbers = [
        int(m.group(1)) for e in events if (m := _STEP_RE.match(str(e.get("name", ""))))
    ]
    steps_per_copy = (max(step_numbers) - min(step_numbers) + 1) if step_numbers else 0
    max_id = 0
    for e in events:
        args = e.get("args")
        if isinstance(args, dict):
            for key in _ID_ARGS:
                v = args.get(key)
                if isinstance(v, int):
                    max_id = max(max_id, v)
        v = e.get("id")
        if isinstance(v, int):
            max_id = max(max_id, v)
    return period, steps_per_copy, max_id + 1


def shift_copy(
    events: list[dict[str, Any]], dt_us: float, dstep: int, did: int
) -> list[dict[str, Any]]:
    """In place: shift timed events by dt_us, step numbers by dstep, ids by did (deltas)."""
    out = []
    for e in events:
        if e.get("ph") == "M" or not _numeric_ts(e):
            continue
        e["ts"] = e["ts"] + (int(dt_us) if isinstance(e["ts"], int) else dt_us)
        if dstep and (m := _STEP_RE.match(str(e.get("name", "")))):
            e["name"] = f"ProfilerStep#{int(m.group(1)) + dstep}"
        if did:
            args = e.get("args")
            if isinstance(args, dict):
                for key in _ID_ARGS:
                    v = args.get(key)
                    if isinstance(v, int) and v >= 0:
                        args[key] = v + did
            v = e.get("id")
            if isinstance(v, int):
                e["id"] = v + did
        out.append(e)
    return out


def write_inflated(
    trace: dict[str, Any], out: Path, copies: int, rank: int | None = None, world: int = 1
) -> int:
    """Write `copies` time-shifted copies of `trace` to `out`; returns the bytes written."""
    events: list[dict[str, Any]] = trace["traceEvents"]
    period, steps_per_copy, id_stride = plan(events)
    header = {k: v for k, v in trace.items() if k != "traceEvents"}
    if rank is not None:
        info = dict(header.get("distributedInfo") or {})
        info.update({"rank": rank, "world_size": world})
        info.pop("pg_config", None)  # the source's groups name other ranks
        header["distributedInfo"] = info
    head = orjson.dumps(header)[:-1]  # drop the closing brace
    written = 0
    tmp = out.with_name(out.name + ".part")
    with tmp.open("wb") as f:
        f.write(head + (b',"traceEvents":[' if header else b'{"traceEvents":['))
        meta = [e for e in events if e.get("ph") == "M" or not _numeric_ts(e)]
        first = True
        if meta:
            f.write(orjson.dumps(meta)[1:-1])
            first = False
        timed = [e for e in events if e.get("ph") != "M" and _numeric_ts(e)]
        for k in range(copies):
            # copy k = copy k-1 shifted by one period (mutated in place: one copy in memory)
            shifted = timed if k == 0 else shift_copy(timed, period, steps_per_copy, id_stride)
            chunk = orjson.dumps(shifted)[1:-1]
            if chunk:
                if not first:
                    f.write(b",")
                f.write(chunk)
                first = False
        f.write(b"]}")
        written = f.tell()
    tmp.replace(out)
    return written


def json_size(trace: dict[str, Any]) -> int:
    """Bytes of the trace as compact JSON (what one copy adds, near enough)."""
    return len(orjson.dumps(trace))


def copies_for(target_mb: float, one_copy_bytes: int) -> int:
    """The fewest whole copies whose total size reaches the target (at least 1)."""
    return max(1, math.ceil(target_mb * 1e6 / one_copy_bytes))


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="a real Kineto trace (.json or .json.gz)")
    ap.add_argument("out", type=Path, help="output .json file, or a folder with --ranks")
    ap.add_argument("--target-mb", type=float, required=True, help="uncompressed size per file")
    ap.add_argument("--ranks", type=int, default=0, help="write this many rank files into OUT")
    args = ap.parse_args(argv)
    try:
        trace = load_trace(args.src)
    except (OSError, ValueError, orjson.JSONDecodeError) as exc:
        print(f"inflate_trace: cannot read {args.src}: {exc}", file=sys.stderr)
        return 2
    copies = copies_for(args.target_mb, json_size(trace))
    if args.ranks:
        args.out.mkdir(parents=True, exist_ok=True)
        for r in range(args.ranks):
            # each rank re-reads the source: write_inflated shifts the events in place
            t = trace if r == 0 else load_trace(args.src)
            n = write_inflated(t, args.out / f"rank-{r}.json", copies, rank=r, world=args.ranks)
            print(f"{args.out / f'rank-{r}.json'}: {copies} copies, {n / 1e6:.0f} MB")
    else:
        n = write_inflated(trace, args.out, copies)
        print(f"{args.out}: {copies} copies, {n / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
