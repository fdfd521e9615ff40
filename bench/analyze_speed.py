"""Speed and peak memory of `zdiag analyze` next to HTA and raw JSON decoders (issue 4).

Every measurement runs in its own child process; wall time is measured around the child and peak
RSS comes from `os.wait4` (the child's own `ru_maxrss`), so one measurement's memory never leaks
into the next. Heavy jobs run one at a time (the machine is shared).

    # raw decoders on the real traces (B1 picks the loader's decoder from this table)
    python bench/analyze_speed.py decoders /work/shared/real_traces/hta/*.json.gz

    # the full comparison: inflated 100 MB / 500 MB / 1 GB single traces and 8 ranks x 200 MB
    python bench/analyze_speed.py compare --workdir /tmp/zdiag-bench

Inputs are built by `bench/inflate_trace.py` (a real trace repeated in time) into --workdir, which
should be on a local disk with a few GB free (/tmp), never the repository.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# Decoders measured: each builds Python objects for the whole file ("full decode"), except
# msgspec-typed (decodes straight into a small typed schema of the fields an analyzer needs,
# skipping the rest) and simdjson-lazy (parses to simdjson's DOM and reads only those fields).
DECODERS = ("json", "orjson", "ujson", "msgspec", "simdjson", "msgspec-typed", "simdjson-lazy")
PATH_DECODERS = ("msgspec-chunked", "msgspec-chunked-2proc")
"""Prototypes for the loader (they read the file themselves, from an mmap): a pre-scan of the
event array as `list[msgspec.Raw]` finds event boundaries, then the events are decoded into
`_Event` Structs in batches of CHUNK_EVENTS and turned into numpy columns (ts, dur, name id,
correlation), so only one batch of Python objects is alive at a time; `-2proc` decodes the two
halves of the array in two forked processes that return columns."""
CHUNK_EVENTS = 65536
FULL_DECODERS = ("json", "orjson", "ujson", "msgspec", "simdjson")


@dataclass
class Measurement:
    """One child process: what ran, how long, its peak RSS, and whether it succeeded."""

    label: str
    wall_s: float
    peak_rss_mb: float  # the largest single process (GNU time %M)
    ok: bool
    detail: str = ""
    cpu_s: float = float("nan")  # user + system seconds of the child and its children
    tree_peak_mb: float = float("nan")  # peak of the summed RSS of the process tree (sampled)


def _read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data


def _decode(name: str, data: bytes) -> int:
    """Decode `data` with decoder `name`; returns the number of trace events seen."""
    if name == "json":
        return len(json.loads(data)["traceEvents"])
    if name == "orjson":
        import orjson

        return len(orjson.loads(data)["traceEvents"])
    if name == "ujson":
        import ujson

        return len(ujson.loads(data)["traceEvents"])
    if name == "msgspec":
        return len(msgspec.json.decode(data)["traceEvents"])
    if name == "simdjson":
        import simdjson

        return len(simdjson.loads(data)["traceEvents"])
    if name == "msgspec-typed":
        return _decode_msgspec_typed(data)
    if name == "simdjson-lazy":
        return _decode_simdjson_lazy(data)
    raise ValueError(f"unknown decoder {name!r}; choose from {', '.join(DECODERS)}")


class _Args(msgspec.Struct):
    """The kernel/op args an analyzer reads (everything else in `args` is skipped)."""

    external_id: int | None = msgspec.field(default=None, name="External id")
    correlation: int | None = None
    stream: int | None = None
    collective_name: str | None = msgspec.field(default=None, name="Collective name")
    in_nelems: int | None = msgspec.field(default=None, name="In msg nelems")
    dtype: str | None = None
    group_size: int | None = msgspec.field(default=None, name="Group size")
    pg_name: str | None = msgspec.field(default=None, name="Process Group Name")


class _Event(msgspec.Struct):
    ph: str = ""
    name: str = ""
    cat: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: float = 0.0
    dur: float = 0.0
    args: _Args | None = None


class _Trace(msgspec.Struct):
    traceEvents: list[_Event]  # the Kineto key
    distributedInfo: dict[str, Any] | None = None


def _decode_msgspec_typed(data: bytes) -> int:
    trace = msgspec.json.decode(data, type=_Trace)
    # touch the columns an analyzer needs, as a columnar loader would
    total = 0.0
    for ev in trace.traceEvents:
        total += ev.ts + ev.dur
    return len(trace.traceEvents)


def _decode_simdjson_lazy(data: bytes) -> int:
    import simdjson

    doc: Any = simdjson.Parser().parse(data)
    events: Any = doc["traceEvents"]
    total = 0.0
    n = 0
    ev: Any
    for ev in events:
        n += 1
        if ev.get("ph") == "X":
            total += float(ev.get("ts", 0)) + float(ev.get("dur", 0))
            ev.get("name")
            ev.get("cat")
    return n


class _RawTrace(msgspec.Struct):
    traceEvents: list[msgspec.Raw] | None = None  # the Kineto key


def _event_offsets(buf: Any, raws: list[msgspec.Raw], picks: list[int]) -> list[tuple[int, int]]:
    """(start, end) byte offsets in `buf` of the events at the given indices."""
    import numpy as np

    base = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    out = []
    for i in picks:
        view = np.frombuffer(raws[i], dtype=np.uint8)
        start = view.ctypes.data - base
        out.append((start, start + len(view)))
    return out


def _columns_of_chunks(path: str, chunks: list[tuple[int, int]]) -> dict[str, Any]:
    """Decode each [start, end) byte range of `path` (whole events joined by commas) into
    `_Event` Structs, one range at a time, keeping only numpy columns; file pages already
    decoded are dropped from RSS (madvise DONTNEED)."""
    import mmap

    import numpy as np

    dec = msgspec.json.Decoder(list[_Event])
    names: dict[str, int] = {}
    cols: dict[str, list[Any]] = {"ts": [], "dur": [], "name": [], "corr": []}
    page = mmap.PAGESIZE
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for start, end in chunks:
            evs = dec.decode(b"[" + mm[start:end] + b"]")
            k = len(evs)
            cols["ts"].append(np.fromiter((e.ts for e in evs), np.float64, k))
            cols["dur"].append(np.fromiter((e.dur for e in evs), np.float64, k))
            cols["name"].append(
                np.fromiter((names.setdefault(e.name, len(names)) for e in evs), np.int32, k)
            )
            cols["corr"].append(
                np.fromiter(
                    (
                        e.args.correlation
                        if e.args is not None and e.args.correlation is not None
                        else -1
                        for e in evs
                    ),
                    np.int64,
                    k,
                )
            )
            del evs
            lo = start - start % page
            mm.madvise(mmap.MADV_DONTNEED, lo, end - lo)
    out: dict[str, Any] = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
    out["names"] = list(names)
    return out


def _decode_path(name: str, path: str) -> int:
    """The chunked prototypes (PATH_DECODERS): returns the number of events decoded."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        raws = msgspec.json.decode(mm, type=_RawTrace).traceEvents or []
        n = len(raws)
        starts = list(range(0, n, CHUNK_EVENTS))
        firsts = _event_offsets(mm, raws, starts)
        lasts = _event_offsets(mm, raws, [min(s + CHUNK_EVENTS, n) - 1 for s in starts])
        del raws
        mm.madvise(mmap.MADV_DONTNEED)
    chunks = [(a[0], b[1]) for a, b in zip(firsts, lasts, strict=True)]
    if name == "msgspec-chunked-2proc" and len(chunks) > 1:
        import multiprocessing

        half = len(chunks) // 2
        with multiprocessing.get_context("fork").Pool(2) as pool:
            cols = pool.starmap(_columns_of_chunks, [(path, chunks[:half]), (path, chunks[half:])])
    else:
        cols = [_columns_of_chunks(path, chunks)]
    return sum(len(c["ts"]) for c in cols)


def _child_decode(name: str, path: str) -> None:
    """Child-process body: read (gunzip if needed) and decode; prints events and seconds."""
    t0 = time.perf_counter()
    if name in PATH_DECODERS:
        n = _decode_path(name, path)
        print(json.dumps({"events": n, "read_s": 0.0, "total_s": time.perf_counter() - t0}))
        return
    data = _read_bytes(Path(path))
    t_read = time.perf_counter() - t0
    n = _decode(name, data)
    t_total = time.perf_counter() - t0
    print(json.dumps({"events": n, "read_s": t_read, "total_s": t_total}))


TIME_BIN = "/usr/bin/time"
SAMPLE_S = 0.1


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_kb(root: int) -> int:
    """Summed RSS of a process and all its descendants, in KiB (0 once it is gone)."""
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _rss_kb(pid)
        todo += _children(pid)
    return total


def run_child(
    label: str, argv: list[str], timeout_s: float = 3600.0, stdout_path: Path | None = None
) -> Measurement:
    """Run `argv` as a child: wall time, CPU time, the largest process's peak RSS and the peak
    of the whole process tree's summed RSS (worker pools count in full).

    Peak RSS comes from GNU time (`/usr/bin/time -f %M`), which forks the child from its own tiny
    process: Linux carries a parent's RSS into a forked child's `ru_maxrss`, so measuring with
    `os.wait4` straight from this (bigger) process would overstate small children. The tree sum
    is sampled every 0.1 s from /proc. `stdout_path` sends the child's stdout to a file.
    """
    rss_file = Path(f"/tmp/zdiag-bench-rss-{os.getpid()}.txt")
    use_time = os.access(TIME_BIN, os.X_OK)
    full = [TIME_BIN, "-f", "%M %U %S", "-o", str(rss_file), *argv] if use_time else argv
    out_f = stdout_path.open("wb") if stdout_path else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        full, stdout=out_f if out_f else subprocess.PIPE, stderr=subprocess.PIPE
    )
    tree_peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal tree_peak
        while not done.is_set():
            tree_peak = max(tree_peak, tree_rss_kb(proc.pid))
            done.wait(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        rc, err = -9, (err or b"") + b" (timed out)"
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    if out_f:
        out_f.close()
    peak_mb = cpu_s = float("nan")
    if use_time and rss_file.exists():
        for line in rss_file.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0].isdigit():
                peak_mb = int(parts[0]) / 1024.0  # GNU time reports KiB
                cpu_s = float(parts[1]) + float(parts[2])
        rss_file.unlink()
    text_out = (out or b"").decode(errors="replace").strip()
    ok = rc == 0
    detail = (
        text_out.splitlines()[-1]
        if ok and text_out
        else (err or b"").decode(errors="replace")[-400:]
    )
    # the sampled tree includes GNU time itself (~2 MB); never report less than %M
    tree_mb = max(tree_peak / 1024.0, peak_mb) if tree_peak else peak_mb
    return Measurement(label, wall, peak_mb, ok, detail.strip(), cpu_s, tree_mb)


def baseline_rss_mb() -> float:
    """Peak RSS of a bare interpreter, to read the decoders' figures against."""
    m = run_child("python -c pass", [sys.executable, "-c", "pass"])
    return m.peak_rss_mb


def measure_decoders(paths: list[Path], decoders: tuple[str, ...]) -> list[dict[str, Any]]:
    """One child per (file, decoder); rows for the decoder table."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        size_mb = len(_read_bytes(path)) / 1e6
        for name in decoders:
            m = run_child(
                name, [sys.executable, __file__, "_decode", name, str(path)], timeout_s=1800
            )
            decode_s = float("nan")
            if m.ok:
                info = json.loads(m.detail)
                decode_s = info["total_s"] - info["read_s"]
            rows.append(
                {
                    "file": path.name,
                    "json_mb": round(size_mb, 1),
                    "decoder": name,
                    "decode_s": decode_s,
                    "child_wall_s": m.wall_s,
                    "peak_rss_mb": m.peak_rss_mb,
                    "ok": m.ok,
                    "error": "" if m.ok else m.detail,
                }
            )
            print(
                f"{path.name:48s} {size_mb:7.1f} MB  {name:14s} decode {decode_s:7.3f} s  "
                f"peak {m.peak_rss_mb:7.0f} MB{'' if m.ok else '  FAILED ' + m.detail[-120:]}",
                file=sys.stderr,
            )
    return rows


def decoder_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: per file, each decoder's decode time, MB/s and peak RSS."""
    lines = [
        "| trace | JSON MB | decoder | decode s | MB/s | peak RSS MB |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        mbps = r["json_mb"] / r["decode_s"] if r["ok"] and r["decode_s"] > 0 else float("nan")
        lines.append(
            f"| {r['file']} | {r['json_mb']:.1f} | {r['decoder']} | {r['decode_s']:.3f} | "
            f"{mbps:.0f} | {r['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


def machine_line() -> str:
    """Machine description for the figures: CPU model, cores, memory, Python."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores visible, {mem_gb:.0f} GiB RAM, "
        f"Python {platform.python_version()}"
    )


def cmd_decoders(args: argparse.Namespace) -> int:
    """`decoders FILE...`: the raw decoder table on the given traces."""
    paths = [Path(p) for p in args.files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"analyze_speed: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    decoders = tuple(args.only.split(",")) if args.only else DECODERS
    rows = measure_decoders(paths, decoders)
    print(f"machine: {machine_line()}; bare interpreter peak RSS {baseline_rss_mb():.0f} MB")
    print(time.strftime("date: %Y-%m-%d %H:%M UTC", time.gmtime()))
    print(decoder_table(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


# --- the end-to-end comparison ---------------------------------------------------------------

SOURCE_TRACE = REPO.parent / "shared" / "real_traces" / "hta" / "v100_ddp_rank1_of_2.json.gz"
"""The real trace repeated in time: DDP on 2x V100, 5 ProfilerSteps, NCCL, memory events."""
SINGLE_SIZES_MB = (100, 500, 1000)
RANKS, RANK_SIZE_MB = 8, 200
FULL_DECODE_ORDER = ("orjson", "msgspec", "json", "ujson", "simdjson")
BIG_DECODERS = ("orjson", "msgspec", "json", "msgspec-typed")
BIG_INPUT_MB = 150.0
"""Past this size only BIG_DECODERS run: ujson and simdjson are slower than orjson/msgspec and
need 8-12x the JSON size in memory (measured on the real traces and the 100 MB input)."""
MEM_LIMIT_MB = 12_000.0
"""Never start a child predicted to exceed this peak RSS (the machine is shared)."""
MEM_RESERVE_MB = 4_000.0
"""...nor one predicted to leave less than this of the machine's available memory."""


def _child_hta(paths: list[str]) -> None:
    """Child-process body: HTA as a user runs it (parse + temporal breakdown + overlap).

    A folder is passed to HTA as its list of *.json files with ranks 0..N-1 in name order:
    HTA's own rank discovery greps `"rank": N` with a space after the colon, so it finds no rank
    in compact JSON (such as the inflated files) and silently analyzes nothing.
    """
    sys.path.insert(0, str(REPO))
    from zdiag.analyzers.inputs.hta_adapter import hta_breakdown

    t0 = time.perf_counter()
    files = [Path(p) for p in paths]
    if len(files) == 1 and files[0].is_dir():
        files = sorted(files[0].glob("*.json"), key=lambda f: (len(f.name), f.name))
    rows = hta_breakdown(files, ranks=list(range(len(files))), parallel=True)
    if len(rows) != len(files):
        raise SystemExit(f"HTA analyzed {len(rows)} of {len(files)} traces")
    print(json.dumps({"ranks": len(rows), "s": time.perf_counter() - t0}))


def mem_available_mb() -> float:
    """MemAvailable from /proc/meminfo in MB (inf when unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("inf")


class Guard:
    """Predicts a tool's peak RSS from its smaller runs (MB of RSS per MB of JSON) and refuses
    runs predicted past MEM_LIMIT_MB or past the available memory minus MEM_RESERVE_MB."""

    def __init__(self, limit_mb: float) -> None:
        self.limit_mb = limit_mb
        self.per_mb: dict[str, float] = {}

    def record(self, tool: str, json_mb: float, peak_mb: float) -> None:
        """Remember the worst RSS-per-JSON-MB seen for `tool`."""
        if json_mb > 0 and peak_mb == peak_mb:  # not NaN
            self.per_mb[tool] = max(self.per_mb.get(tool, 0.0), peak_mb / json_mb)

    def predict(self, tool: str, json_mb: float) -> float | None:
        """Predicted peak RSS (MB), or None before any run of `tool`."""
        ratio = self.per_mb.get(tool)
        return None if ratio is None else ratio * json_mb

    def refuse(self, tool: str, json_mb: float) -> str | None:
        """Why `tool` must not run on `json_mb` of JSON, or None when it may."""
        pred = self.predict(tool, json_mb)
        if pred is None:
            return None
        room = min(self.limit_mb, mem_available_mb() - MEM_RESERVE_MB)
        if pred > room:
            return f"skipped: predicted peak {pred:,.0f} MB > {room:,.0f} MB allowed"
        return None


def build_inputs(workdir: Path, src: Path, sizes: tuple[int, ...], ranks: int) -> dict[str, Path]:
    """Inflated inputs in `workdir` (built once; reused when present)."""
    workdir.mkdir(parents=True, exist_ok=True)
    inflate = HERE / "inflate_trace.py"
    out: dict[str, Path] = {}
    for mb in sizes:
        path = workdir / f"single_{mb}mb" / "rank-0.json"
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            subprocess.run(
                [sys.executable, str(inflate), str(src), str(path), "--target-mb", str(mb)],
                check=True,
            )
        out[f"{mb} MB"] = path
    if ranks:
        folder = workdir / f"ranks{ranks}_{RANK_SIZE_MB}mb"
        if not (folder / f"rank-{ranks - 1}.json").exists():
            subprocess.run(
                [
                    sys.executable,
                    str(inflate),
                    str(src),
                    str(folder),
                    "--target-mb",
                    str(RANK_SIZE_MB),
                    "--ranks",
                    str(ranks),
                ],
                check=True,
            )
        out[f"{ranks} ranks x {RANK_SIZE_MB} MB"] = folder
    return out


def _json_mb(path: Path) -> float:
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    return sum(f.stat().st_size for f in files) / 1e6


def _row(
    name: str, json_mb: float, tool: str, m: Measurement | None, note: str = ""
) -> dict[str, Any]:
    nan = float("nan")
    return {
        "input": name,
        "json_mb": round(json_mb, 1),
        "tool": tool,
        "wall_s": m.wall_s if m else nan,
        "cpu_s": m.cpu_s if m else nan,
        "peak_rss_mb": m.peak_rss_mb if m else nan,
        "tree_peak_mb": m.tree_peak_mb if m else nan,
        "ok": bool(m and m.ok),
        "note": note if (m is None or m.ok) else (note + " FAILED: " + m.detail[-200:]).strip(),
    }


def _log(row: dict[str, Any]) -> None:
    print(
        f"{row['input']:>22s} {row['tool']:>16s}  wall {row['wall_s']:8.2f} s  cpu "
        f"{row['cpu_s']:8.2f} s  peak {row['peak_rss_mb']:8.0f} MB  tree {row['tree_peak_mb']:8.0f}"
        f" MB  {row['note']}",
        file=sys.stderr,
        flush=True,
    )


def compare(
    inputs: dict[str, Path],
    workdir: Path,
    *,
    decoders: tuple[str, ...],
    big_decoders: tuple[str, ...],
    with_hta: bool,
    guard: Guard,
) -> list[dict[str, Any]]:
    """zdiag analyze, HTA and the decoders on each input, one child at a time."""
    rows: list[dict[str, Any]] = []
    for name, path in inputs.items():
        json_mb = _json_mb(path)
        is_dir = path.is_dir()
        m = run_child(
            "zdiag",
            [sys.executable, "-m", "zdiag", "analyze", str(path), "--json", "--quiet"],
            stdout_path=workdir / "report.json",
        )
        note = ""
        if m.ok:
            report = json.loads((workdir / "report.json").read_bytes())
            steps = sum(len(r["steps"]) for r in report["ranks"])
            note = f"{len(report['ranks'])} rank(s), {steps} steps"
        rows.append(_row(name, json_mb, "zdiag analyze", m, note))
        _log(rows[-1])
        if not is_dir:
            for dec in decoders if json_mb <= BIG_INPUT_MB else big_decoders:
                why = guard.refuse(dec, json_mb)
                if why:
                    rows.append(_row(name, json_mb, dec, None, why))
                else:
                    m = run_child(dec, [sys.executable, __file__, "_decode", dec, str(path)])
                    guard.record(dec, json_mb, m.peak_rss_mb)
                    rows.append(_row(name, json_mb, dec, m))
                _log(rows[-1])
        if with_hta:
            why = guard.refuse("hta", json_mb)
            if why:
                rows.append(_row(name, json_mb, "HTA", None, why))
            else:
                m = run_child("hta", [sys.executable, __file__, "_hta", str(path)])
                guard.record("hta", json_mb, m.tree_peak_mb)
                rows.append(_row(name, json_mb, "HTA", m))
            _log(rows[-1])
    return rows


def results_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the comparison rows."""
    lines = [
        "| input | JSON MB | tool | wall s | CPU s | peak RSS MB (largest process) | peak RSS MB (all processes) | note |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["ok"]:
            nums = (
                f"{r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['peak_rss_mb']:,.0f} | "
                f"{r['tree_peak_mb']:,.0f}"
            )
        else:
            nums = "- | - | - | -"
        lines.append(f"| {r['input']} | {r['json_mb']:,.0f} | {r['tool']} | {nums} | {r['note']} |")
    return "\n".join(lines)


def targets_summary(rows: list[dict[str, Any]]) -> str:
    """The issue's targets on the largest single trace and on the multi-rank input, as text.

    Ratios are given on wall time and on CPU time (user + system): on a shared machine wall
    time carries other jobs' load, CPU time is the work each tool did.
    """
    out = []
    singles = [r for r in rows if "ranks" not in r["input"]]
    if singles:
        biggest = max(r["json_mb"] for r in singles)
        at = {r["tool"]: r for r in singles if r["json_mb"] == biggest and r["ok"]}
        z = at.get("zdiag analyze")
        h = at.get("HTA")
        full = [at[d] for d in FULL_DECODE_ORDER if d in at]
        if z:
            out.append(f"On the {biggest:,.0f} MB trace:")
            if h:
                out.append(
                    f"- vs HTA: zdiag is {h['wall_s'] / z['wall_s']:.1f}x faster (wall), "
                    f"{h['cpu_s'] / z['cpu_s']:.1f}x (CPU) [target >= 20x]; peak memory "
                    f"{z['tree_peak_mb'] / h['tree_peak_mb']:.2f} of HTA's [target <= 0.33]"
                )
            else:
                out.append("- HTA was not run at this size (see the note in its row)")
            if full:
                fw = min(full, key=lambda r: r["wall_s"])
                fc = min(full, key=lambda r: r["cpu_s"])
                out.append(
                    f"- vs the fastest full decode: {z['wall_s'] / fw['wall_s']:.2f}x "
                    f"{fw['tool']}'s wall time, {z['cpu_s'] / fc['cpu_s']:.2f}x {fc['tool']}'s "
                    "CPU time [target <= 3x]"
                )
    multi = [r for r in rows if "ranks" in r["input"] and r["tool"] == "zdiag analyze" and r["ok"]]
    for r in multi:
        out.append(
            f"{r['input']}: zdiag used {r['cpu_s'] / r['wall_s']:.2f} cores on average "
            f"(CPU {r['cpu_s']:.1f} s over {r['wall_s']:.1f} s wall) [target: both cores]"
        )
    return "\n".join(out)


def cmd_compare(args: argparse.Namespace) -> int:
    """`compare`: build the inputs, run everything, print the table (and write --json-out)."""
    src = Path(args.source)
    if not src.is_file():
        print(f"analyze_speed: source trace not found: {src}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir)
    sizes = tuple(int(x) for x in args.sizes.split(",")) if args.sizes else ()
    inputs = build_inputs(workdir, src, sizes, args.ranks)
    decoders = tuple(args.decoders.split(",")) if args.decoders else ()
    guard = Guard(args.mem_limit_mb)
    rows = compare(
        inputs,
        workdir,
        decoders=decoders,
        big_decoders=tuple(d for d in BIG_DECODERS if d in decoders),
        with_hta=not args.no_hta,
        guard=guard,
    )
    print(f"machine: {machine_line()}")
    print(time.strftime("date: %Y-%m-%d %H:%M UTC", time.gmtime()))
    print(results_table(rows))
    print()
    print(targets_summary(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """`report ROWS.json`: the table and target summary again from saved rows."""
    rows = json.loads(Path(args.rows).read_text())
    print(results_table(rows))
    print()
    print(targets_summary(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_dec = sub.add_parser("decoders", help="raw decode time and peak RSS per decoder")
    p_dec.add_argument("files", nargs="+")
    p_dec.add_argument("--only", help="comma-separated decoders (default: all)")
    p_dec.add_argument("--json-out", help="also write the rows as JSON here")
    p_cmp = sub.add_parser("compare", help="zdiag analyze vs HTA vs decoders on inflated traces")
    p_cmp.add_argument("--workdir", default="/tmp/zdiag-bench", help="scratch folder for inputs")
    p_cmp.add_argument("--source", default=str(SOURCE_TRACE), help="the real trace to inflate")
    p_cmp.add_argument(
        "--sizes", default=",".join(map(str, SINGLE_SIZES_MB)), help="single-trace MB, e.g. 100,500"
    )
    p_cmp.add_argument("--ranks", type=int, default=RANKS, help="ranks of 200 MB (0: none)")
    p_cmp.add_argument("--decoders", default=",".join((*FULL_DECODE_ORDER, "msgspec-typed")))
    p_cmp.add_argument("--no-hta", action="store_true", help="leave HTA out")
    p_cmp.add_argument("--mem-limit-mb", type=float, default=MEM_LIMIT_MB)
    p_cmp.add_argument("--json-out", help="also write the rows as JSON here")
    p_rep = sub.add_parser("report", help="print the table again from compare's --json-out")
    p_rep.add_argument("rows")
    p_child = sub.add_parser("_decode", help=argparse.SUPPRESS)
    p_child.add_argument("decoder")
    p_child.add_argument("file")
    p_hta = sub.add_parser("_hta", help=argparse.SUPPRESS)
    p_hta.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    if args.cmd == "_decode":
        _child_decode(args.decoder, args.file)
        return 0
    if args.cmd == "_hta":
        _child_hta(args.paths)
        return 0
    if args.cmd == "compare":
        return cmd_compare(args)
    if args.cmd == "report":
        return cmd_report(args)
    if args.cmd == "decoders":
        return cmd_decoders(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
