"""A synthesized 1024-rank job on every path: local, cache, in-job summaries, Ray (issue 16).

Each measurement runs `analyze_via_summaries` (what `zdiag analyze` runs) in its own child
process; wall time is measured around the child and peak RSS is the child's own `ru_maxrss`
(os.wait4; worker processes are not included: their largest RSS is printed separately when the
child reports it). Every line says which rank the report names as the straggler.

    python bench/synth_job.py /tmp/job1024 --ranks 1024
    python bench/scale_bench.py /tmp/job1024 --paths local,cache,in-job
    /work/venv-ray/bin/python bench/scale_bench.py /tmp/job1024 --paths ray --workers 1,2 --ranks-subset 256:512

Paths:
- `local`: no stored summary is read or written (`--no-cache`); the map on this machine's cores;
- `cache`: the summary cache written by a first run (made here if absent), read back;
- `in-job`: summaries beside the traces (made here with `summarize_trace.summarize_to`, the
  function the in-job process runs, if absent), the cache moved aside;
- `ray`: the map as Ray tasks on a local Ray started with `--workers` CPUs, nothing stored.

`--ranks-subset A:B` analyzes the files of ranks A..B-1 only (for the scaling runs).
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
from pathlib import Path
from zdiag.analyzers.engine.summary_pipeline import SummaryOptions, analyze_via_summaries
from zdiag.analyzers.engine.summary_engines import LocalEngine, RayEngine
path, files, workers = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
ray = path.endswith("@ray")
path = path.removesuffix("@ray")
inputs = [Path(f) for f in files] if files else [Path(path)]
if ray:
    engine = RayEngine(num_cpus=workers)
else:
    engine = LocalEngine(workers)
stored = sys.argv[4] == "stored"
t = time.perf_counter()
run = analyze_via_summaries(inputs, SummaryOptions(use_stored=stored, write_cache=stored, engine=engine))
wall = time.perf_counter() - t
f = next((x for x in run.report.findings if x.id == "straggler"), None)
print(json.dumps({
    "inner_s": wall,
    "sources": vars(run.sources),
    "top_straggler": run.report.stragglers[0].rank if run.report.stragglers else None,
    "finding_ranks": f.ranks if f else [],
    "ranks": len(run.report.ranks),
    "children_maxrss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
}))
"""


def measure(job: Path, files: list[str], workers: int, mode: str, ray: bool) -> dict[str, object]:
    """One child run; its report plus wall time and peak RSS."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), ZDIAG_CACHE="on")
    arg = str(job) + ("@ray" if ray else "")
    cmd = [sys.executable, "-c", CHILD, arg, json.dumps(files), str(workers), mode]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = proc.stdout.read() if proc.stdout else b""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if status != 0:
        return {"error": f"exit status {status}", "wall_s": wall}
    result: dict[str, object] = json.loads(out.decode().strip().splitlines()[-1])
    result["wall_s"] = round(wall, 2)
    result["maxrss_mb"] = round(usage.ru_maxrss / 1024, 1)
    result["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 2)  # the child and its children
    return result


def make_in_job(job: Path, files: list[Path]) -> None:
    """In-job summaries beside the traces that lack one (summarize_trace.summarize_to)."""
    sys.path.insert(0, str(ROOT))
    from zdiag.analyzers.engine.summarize_trace import summarize_to
    from zdiag.collectors.rundir import summary_path_for

    for t in files:
        out = summary_path_for(t)
        if not out.exists():
            summarize_to(t, out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("job", type=Path)
    p.add_argument("--paths", default="local,cache,in-job")
    p.add_argument("--workers", default=str(os.cpu_count() or 1), help="comma list")
    p.add_argument("--ranks-subset", help="A:B: the files of ranks A..B-1 only")
    a = p.parse_args()
    all_files = sorted(a.job.glob("rank-*.json"), key=lambda f: int(f.name[5:-5]))
    files: list[str] = []
    if a.ranks_subset:
        lo, hi = (int(x) for x in a.ranks_subset.split(":"))
        files = [str(f) for f in all_files[lo:hi]]
    n = len(files) or len(all_files)
    cache = a.job / ".zdiag-cache"
    aside = a.job / ".zdiag-cache-aside"
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.node()}: "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; load average "
        f"{os.getloadavg()[0]:.1f}; job {a.job} ({n} ranks)"
    )
    for path in a.paths.split(","):
        for w in (int(x) for x in a.workers.split(",")):
            if path == "local":
                r = measure(a.job, files, w, "fresh", ray=False)
            elif path == "ray":
                r = measure(a.job, files, w, "fresh", ray=True)
            elif path == "cache":
                if aside.exists() and not cache.exists():
                    aside.rename(cache)
                if not cache.exists():
                    print("(first run writes the cache)")
                    print(json.dumps(measure(a.job, files, w, "stored", ray=False)))
                r = measure(a.job, files, w, "stored", ray=False)
            elif path == "in-job":
                make_in_job(a.job, [Path(f) for f in files] or all_files)
                if cache.exists():
                    cache.rename(aside)
                r = measure(a.job, files, w, "stored", ray=False)
                if aside.exists():
                    aside.rename(cache)
            else:
                raise SystemExit(f"unknown path {path!r}")
            r.pop("inner_s", None)
            print(json.dumps({"path": path, "workers": w, **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
