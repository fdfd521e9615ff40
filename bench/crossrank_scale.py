"""The reduce's cross-rank matching alone, at many ranks x many collectives (issue 16.4).

Builds, per rank, the packed collective columns a rank summary holds (`CollectiveCalls`: 3
steps, all-gather / reduce-scatter / all-reduce in turn, one process group; every rank arrives
within 30 us of the others except one straggler, 2 ms late everywhere; device collectives, so
ends line up), then, in a child process per measurement, runs what `reduce_run` runs on them:
the matching, `straggler_stats` and `find_stragglers`. Peak RSS is the child's high-water mark
minus its RSS once the inputs are built, i.e. what the matching adds on top of the summaries.

    PYTHONPATH=. python bench/crossrank_scale.py --ranks 1024 --collectives 28,4096
    PYTHONPATH=. python bench/crossrank_scale.py --ranks 1024 --collectives 4096 --code /tmp/old

`--code DIR` runs the zdiag under DIR instead (e.g. `git archive` of an earlier commit): both
the matching of this version (`CollectiveCalls.columns`) and the earlier one
(`CollectiveCalls.to_rank_collectives`) are driven the way their reduce drove them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time
import numpy as np
from zdiag.analyzers.run import crossrank
from zdiag.analyzers.rank.summary import CollectiveCalls
try:
    from zdiag.analyzers.run.crossrank_match import match_collectives
except ImportError:  # older code (--code): the matcher lived in crossrank
    match_collectives = crossrank.match_collectives
try:
    from zdiag.analyzers.run.stragglers import find_stragglers, straggler_stats
except ImportError:  # older code (--code): the ranking lived in crossrank
    find_stragglers, straggler_stats = crossrank.find_stragglers, crossrank.straggler_stats

n_ranks, n_coll, straggler = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
kinds = ["all_gather", "reduce_scatter", "all_reduce"]
per_step = -(-n_coll // 3)
step = np.repeat(np.arange(3, dtype=np.int32), per_step)[:n_coll]
kind = (np.arange(n_coll) % 3).astype(np.uint16)
t0 = 1.7e15 + np.arange(n_coll) * 5_000.0
leave = t0 + 2_000.0 + 400.0
calls = []
for r in range(n_ranks):
    start = t0 + rng.uniform(0, 30, n_coll) + (2_000.0 if r == straggler else 0.0)
    end = leave + rng.uniform(0, 5, n_coll)
    calls.append(CollectiveCalls(
        start_us=start.tobytes(), end_us=end.tobytes(), kind=kind.tobytes(),
        group=np.zeros(n_coll, np.uint16).tobytes(), step=step.tobytes(),
        kinds=kinds, groups=["0"], ends_align=True))
del start, end

def rss_mb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
base = rss_mb("VmRSS")
t = time.perf_counter()
cpu = time.process_time()
if hasattr(CollectiveCalls, "columns"):
    result = match_collectives(c.columns(r) for r, c in enumerate(calls))
else:
    result = match_collectives([c.to_rank_collectives(r) for r, c in enumerate(calls)])
stats = straggler_stats(result)
found = find_stragglers(result)
wall = time.perf_counter() - t
print(json.dumps({
    "wall_s": round(wall, 2), "cpu_s": round(time.process_time() - cpu, 2),
    "inputs_mb": round(base, 1), "added_peak_mb": round(rss_mb("VmHWM") - base, 1),
    "matched_per_rank": max(s.matched_collectives for s in stats),
    "straggler": [f.ranks for f in found],
}))
"""


def measure(code: Path, ranks: int, collectives: int, timeout_s: float) -> dict[str, object]:
    """One child run of the matching on `code`'s zdiag."""
    env = dict(os.environ, PYTHONPATH=str(code))
    # -P: no current directory on sys.path, so PYTHONPATH alone picks the code
    cmd = [sys.executable, "-P", "-c", CHILD, str(ranks), str(collectives), str(ranks // 3 + 1)]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, timeout=timeout_s, check=True)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout_s:.0f} s"}
    except subprocess.CalledProcessError as exc:
        return {"error": exc.stderr.decode()[-300:]}
    result: dict[str, object] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", default="1024", help="comma list")
    p.add_argument("--collectives", default="28,4096", help="per rank; comma list")
    p.add_argument("--code", type=Path, default=ROOT, help="the zdiag checkout to run")
    p.add_argument("--timeout-s", type=float, default=600.0)
    a = p.parse_args()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.node()}: "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; load average "
        f"{os.getloadavg()[0]:.1f}; code {a.code}"
    )
    for n in (int(x) for x in a.ranks.split(",")):
        for c in (int(x) for x in a.collectives.split(",")):
            r = measure(a.code, n, c, a.timeout_s)
            print(json.dumps({"ranks": n, "collectives_per_rank": c, **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
