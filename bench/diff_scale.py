"""`zdiag diff` of two 1000-rank jobs from their stored summaries (issue 28.6).

Two jobs are synthesized from one real trace (bench/synth_job.py): A with its default straggler,
B with another rank slowed and its slow node's collectives 8x longer (A: 3x). Each rank gets its in-job summary (the function the
in-job process runs), then `zdiag diff A B --json` runs in a child process, which must read only
stored summaries: the child checks that no trace was decoded (`SummarySources.mapped == 0` on
both sides) and prints the diff's headline, its wall time and peak RSS.

    python bench/diff_scale.py /tmp/diffscale --ranks 1000

Making the jobs and their summaries takes minutes (done once; kept in the work folder); the
diff itself is what is timed.
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
import json, sys, time
from pathlib import Path
from zdiag.analyzers.compare.diff import diff_reports
from zdiag.analyzers.compare.model import encode_diff
from zdiag.analyzers.engine.summary_pipeline import SummaryOptions, analyze_via_summaries
opts = SummaryOptions(use_stored=True, write_cache=False)
t = time.perf_counter()
runs = [analyze_via_summaries([Path(p)], opts) for p in sys.argv[1:3]]
d = diff_reports(runs[0].report, runs[1].report, baseline=sys.argv[1], candidate=sys.argv[2])
size = len(encode_diff(d))
print(json.dumps({
    "inner_s": round(time.perf_counter() - t, 2),
    "decoded": [r.sources.mapped for r in runs],
    "stored": [r.sources.in_job + r.sources.cache for r in runs],
    "ranks": [len(r.report.ranks) for r in runs],
    "diff_json_bytes": size,
    "headline": d.headline,
}))
"""


def synthesize(out: Path, ranks: int, extra: list[str]) -> None:
    """A job of `ranks` traces in `out`, with in-job summaries beside them (made once)."""
    if not (out / "synth-job.txt").is_file():
        subprocess.run(
            [sys.executable, str(ROOT / "bench" / "synth_job.py"), str(out), "--ranks", str(ranks),
             *extra],
            check=True,
        )  # fmt: skip
    sys.path.insert(0, str(ROOT))
    from zdiag.analyzers.engine.summarize_trace import summarize_to
    from zdiag.collectors.rundir import summary_path_for

    for trace in sorted(out.glob("rank-*.json")):
        target = summary_path_for(trace)
        if not target.exists():
            summarize_to(trace, target)


def main() -> int:
    """Synthesize both jobs once, then time the diff in a child process."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("work", type=Path, help="folder for the two jobs (kept between runs)")
    p.add_argument("--ranks", type=int, default=1000)
    a = p.parse_args()
    job_a, job_b = a.work / "a", a.work / "b"
    started = time.perf_counter()
    synthesize(job_a, a.ranks, [])
    synthesize(job_b, a.ranks, ["--straggler", str(a.ranks // 2), "--slow-factor", "8"])
    made = time.perf_counter() - started
    env = dict(os.environ, PYTHONPATH=str(ROOT), ZDIAG_CACHE="off")
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(job_a), str(job_b)], env=env, stdout=subprocess.PIPE
    )
    out = proc.stdout.read() if proc.stdout else b""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.node()}: "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; load average "
        f"{os.getloadavg()[0]:.1f}; jobs and summaries ready in {made:.0f} s"
    )
    if status != 0:
        print(f"the diff failed (status {status})")
        return 1
    result = json.loads(out.decode().strip().splitlines()[-1])
    result["wall_s"] = round(wall, 2)
    result["maxrss_mb"] = round(usage.ru_maxrss / 1024, 1)
    print(json.dumps(result, indent=1))
    return 0 if result["decoded"] == [0, 0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
