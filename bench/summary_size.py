"""Size of a rank's `RankSummary` (zdiag.rank-summary/1, msgpack) next to its trace's JSON.

For each source trace and each target size, the trace is inflated (bench/inflate_trace.py: the
trace repeated in time; 0 = the source as it is), analyzed by the map (`analyze_rank`),
summarized and encoded; the table gives the trace's JSON bytes, the summary's bytes, their
ratio, the summary's bytes by part (msgpack before compression), and what the parts grow with (collectives, FSDP ledger
records, steps, timeline spans).

    python bench/summary_size.py SRC [SRC ...] --target-mb 0 100 500 --workdir /tmp/zdiag-summary

Inflated files go to --workdir (a scratch disk, never the repository) and are deleted after use.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import os
import platform
import sys
import time
from pathlib import Path

import msgspec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import inflate_trace  # noqa: E402  (bench/inflate_trace.py, next to this file)

from zdiag.analyzers.inputs.loader import load_rank_trace  # noqa: E402
from zdiag.analyzers.rank.rank_analysis import analyze_rank  # noqa: E402
from zdiag.analyzers.rank.summary import RankSummary, encode_summary, summarize  # noqa: E402

PARTS = ("collectives", "ledger", "timeline", "steps", "collective_stats", "warnings")


def json_bytes(path: Path) -> int:
    """Uncompressed bytes of a trace file."""
    if path.suffix == ".gz":
        with gzip.open(path, "rb") as f:
            return sum(len(chunk) for chunk in iter(lambda: f.read(1 << 20), b""))
    return path.stat().st_size


def part_bytes(summary: RankSummary) -> dict[str, int]:
    """Bytes of each large part of a summary, msgpack before compression ("other": the rest)."""
    enc = msgspec.msgpack.encode
    out = {name: len(enc(getattr(summary, name))) for name in PARTS}
    out["other"] = len(enc(summary)) - sum(out.values())
    return out


def measure(path: Path) -> dict[str, object]:
    """One row: sizes and counts for one trace file."""
    t0 = time.perf_counter()
    trace = load_rank_trace(path)
    analysis = analyze_rank(trace)
    summary = summarize(analysis)
    blob = encode_summary(summary)
    secs = time.perf_counter() - t0
    row: dict[str, object] = {
        "json": json_bytes(path),
        "summary": len(blob),
        "collectives": len(analysis.collectives),
        "records": len(analysis.ledger.records),
        "steps": len(analysis.breakdown),
        "spans": len(analysis.timeline.spans) if analysis.timeline else 0,
        "events": len(trace),
        "seconds": secs,
        "parts": part_bytes(summary),
    }
    del trace, analysis, summary
    gc.collect()
    return row


def _mb(n: object) -> str:
    assert isinstance(n, int)
    return f"{n / 1e6:,.1f}" if n >= 1e7 else f"{n / 1e6:.3f}"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", type=Path, nargs="+")
    ap.add_argument("--target-mb", type=float, nargs="+", default=[0.0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/zdiag-summary"))
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(
        f"# {_cpu()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(
        "| trace | target MB | JSON MB | events | collectives | FSDP records | steps | "
        "summary MB | summary / JSON | uncompressed: collectives / ledger / timeline / steps / "
        "other (KB) | "
        "map s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for src in args.sources:
        for target in args.target_mb:
            path = src
            inflated = None
            if target > 0:
                trace = inflate_trace.load_trace(src)
                copies = inflate_trace.copies_for(target, inflate_trace.json_size(trace))
                inflated = args.workdir / f"{src.name.split('.')[0]}-{int(target)}mb.json"
                inflate_trace.write_inflated(trace, inflated, copies)
                del trace
                gc.collect()
                path = inflated
            try:
                row = measure(path)
            finally:
                if inflated is not None:
                    inflated.unlink(missing_ok=True)
            parts = row["parts"]
            assert isinstance(parts, dict)
            kb = " / ".join(
                f"{parts[k] / 1e3:,.0f}"
                for k in ("collectives", "ledger", "timeline", "steps", "other")
            )
            json_b, sum_b = row["json"], row["summary"]
            assert isinstance(json_b, int) and isinstance(sum_b, int)
            seconds = row["seconds"]
            assert isinstance(seconds, float)
            print(
                f"| {'/'.join(src.parts[-3:])} | {target:g} | {_mb(json_b)} | {row['events']:,} | "
                f"{row['collectives']:,} | {row['records']:,} | {row['steps']:,} | {_mb(sum_b)} | "
                f"{sum_b / json_b:.3%} | {kb} | {seconds:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
