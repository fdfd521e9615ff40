"""Time `zdiag analyze` on flight-recorder dumps: a synthetic job of N ranks (TP groups of 8,
M collectives each, then one rank missing from a default-group all-reduce), written by the test
generator, and optionally folders of real dumps.

    python bench/fr_speed.py --ranks 512 --entries 1000 [DUMP_DIR ...]

docs/flight-recorder.md quotes its output.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.flight_recorder import FakeJob
from zdiag.analyzers.inputs.flight_dumps import find_dumps, read_dumps
from zdiag.analyzers.run.wait_graph import analyze_dumps


def _time(paths: list[Path]) -> tuple[float, float, tuple[int, ...]]:
    t0 = time.perf_counter()
    dumps = read_dumps(paths)
    t1 = time.perf_counter()
    analysis = analyze_dumps(dumps)
    return t1 - t0, time.perf_counter() - t1, analysis.culprit_ranks


def main() -> int:
    """Print read and analysis times."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="*", type=Path)
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--entries", type=int, default=1000)
    args = parser.parse_args()
    for folder in args.folders:
        read_s, analyze_s, culprits = _time(find_dumps([folder])[0])
        print(
            f"{folder}: read {read_s * 1000:.1f} ms, analyze {analyze_s * 1000:.1f} ms, culprits {culprits}"
        )
    job = FakeJob(args.ranks)
    groups = [
        job.group(str(100 + i), "TP", list(range(i * 8, i * 8 + 8))) for i in range(args.ranks // 8)
    ]
    for _ in range(args.entries):
        for g in groups:
            job.collective(g, op="_all_gather_base")
    job.collective(ranks=[r for r in range(args.ranks) if r != 5], state="scheduled")
    with tempfile.TemporaryDirectory() as tmp:
        paths = job.write(Path(tmp))
        mib = sum(p.stat().st_size for p in paths) / 2**20
        read_s, analyze_s, culprits = _time(paths)
    print(
        f"synthetic {args.ranks} ranks x {args.entries + 1} entries ({mib:.0f} MiB): "
        f"read {read_s:.2f} s, analyze {analyze_s:.2f} s, culprits {culprits}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
