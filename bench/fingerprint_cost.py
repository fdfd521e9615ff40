"""What does the whole-content fingerprint of a stored summary cost, against what it saves?
(issue 24; figures in docs/benchmarks.md, "Stored summaries: trust and fingerprint cost")

A stored summary is reused only when the trace's size and SHA-256 match
(analyzers/engine/summary_store.py `fingerprint`). This times, on the same files:

- `fingerprint(path)`: the whole-content SHA-256 (the file read from the page cache, as on a
  second analysis right after the first);
- the old edge digest (SHA-1 of the size and the first and last 64 KiB), for comparison;
- `map_trace`: decoding and summarizing the trace, what a hit saves.

for an uncompressed trace of `--target-mb` MB (bench/inflate_trace.py repeats the sample trace)
and the gzip trace `zdiag run` writes for the same events.

    python bench/fingerprint_cost.py [--target-mb 500] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_traces" / "none" / "traces" / "rank-0.json.gz"
EDGE = 64 * 1024


def edge_digest(path: Path) -> str:
    """The fingerprint digest used before issue 24 (size, first and last 64 KiB)."""
    with path.open("rb") as f:
        size = path.stat().st_size
        h = hashlib.sha1(str(size).encode(), usedforsecurity=False)
        h.update(f.read(EDGE))
        if size > EDGE:
            f.seek(max(EDGE, size - EDGE))
            h.update(f.read(EDGE))
    return h.hexdigest()


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of `repeats` calls (the first call warms the page cache and is dropped)."""
    fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> int:
    """Build the inputs, time the three operations, print a Markdown table."""
    from zdiag.analyzers.engine.summary_map import MapTask, RunContexts, map_trace
    from zdiag.analyzers.engine.summary_store import fingerprint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-mb", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="zdiag-fp-") as tmp:
        big = Path(tmp) / "rank-0.json"
        subprocess.run(
            [sys.executable, str(ROOT / "bench" / "inflate_trace.py"), str(SAMPLE), str(big),
             "--target-mb", str(args.target_mb)],
            check=True, capture_output=True,
        )  # fmt: skip
        packed = Path(tmp) / "rank-0.json.gz"
        with big.open("rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, "
              f"python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")  # fmt: skip
        print("| file | MB | SHA-256 whole (s) | GB/s | edge digest (s) | decode + summarize (s) "
              "| hash / decode |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|")
        for path in (big, packed):
            mb = path.stat().st_size / 1e6
            full = statistics.median(timed(partial(fingerprint, path), args.repeats))
            edge = statistics.median(timed(partial(edge_digest, path), args.repeats))
            task = MapTask(str(path), None, RunContexts())
            decode = statistics.median(timed(partial(map_trace, task), max(1, args.repeats - 1)))
            print(f"| {path.name} | {mb:.0f} | {full:.3f} | {mb / 1000 / full:.2f} | {edge:.4f} "
                  f"| {decode:.2f} | {full / decode:.1%} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
