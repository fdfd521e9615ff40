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
FULL_DECODERS = ("json", "orjson", "ujson", "msgspec", "simdjson")


@dataclass
class Measurement:
    """One child process: what ran, how long, its peak RSS, and whether it succeeded."""

    label: str
    wall_s: float
    peak_rss_mb: float
    ok: bool
    detail: str = ""


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


def _child_decode(name: str, path: str) -> None:
    """Child-process body: read (gunzip if needed) and decode; prints events and seconds."""
    t0 = time.perf_counter()
    data = _read_bytes(Path(path))
    t_read = time.perf_counter() - t0
    n = _decode(name, data)
    t_total = time.perf_counter() - t0
    print(json.dumps({"events": n, "read_s": t_read, "total_s": t_total}))


TIME_BIN = "/usr/bin/time"


def run_child(label: str, argv: list[str], timeout_s: float = 3600.0) -> Measurement:
    """Run `argv` as a child: wall time around it, and the child's own peak RSS.

    Peak RSS comes from GNU time (`/usr/bin/time -f %M`), which forks the child from its own tiny
    process: Linux carries a parent's RSS into a forked child's `ru_maxrss`, so measuring with
    `os.wait4` straight from this (bigger) process would overstate small children.
    """
    rss_file = Path(f"/tmp/zdiag-bench-rss-{os.getpid()}.txt")
    use_time = os.access(TIME_BIN, os.X_OK)
    full = [TIME_BIN, "-f", "%M", "-o", str(rss_file), *argv] if use_time else argv
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(full, capture_output=True, timeout=timeout_s, check=False)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = -9, exc.stdout or b"", (exc.stderr or b"") + b" (timed out)"
    wall = time.perf_counter() - t0
    peak_mb = float("nan")
    if use_time and rss_file.exists():
        lines = [ln for ln in rss_file.read_text().splitlines() if ln.strip().isdigit()]
        if lines:
            peak_mb = int(lines[-1]) / 1024.0  # GNU time reports KiB
        rss_file.unlink()
    text_out = out.decode(errors="replace").strip()
    ok = rc == 0
    detail = text_out.splitlines()[-1] if ok and text_out else err.decode(errors="replace")[-400:]
    return Measurement(label, wall, peak_mb, ok, detail.strip())


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


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_dec = sub.add_parser("decoders", help="raw decode time and peak RSS per decoder")
    p_dec.add_argument("files", nargs="+")
    p_dec.add_argument("--only", help="comma-separated decoders (default: all)")
    p_dec.add_argument("--json-out", help="also write the rows as JSON here")
    p_child = sub.add_parser("_decode", help=argparse.SUPPRESS)
    p_child.add_argument("decoder")
    p_child.add_argument("file")
    args = parser.parse_args(argv)
    if args.cmd == "_decode":
        _child_decode(args.decoder, args.file)
        return 0
    if args.cmd == "decoders":
        return cmd_decoders(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
