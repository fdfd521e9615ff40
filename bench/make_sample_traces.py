"""Record the harness's small sample run directories: one folder per --misconfig scenario.

    python bench/make_sample_traces.py [--only NAME ...] [--out sample_traces]

Each scenario is `zdiag run --nproc-per-node 2 --harness --device cpu --misconfig NAME` with a
short schedule, written to `sample_traces/<NAME>/` (a complete run directory: manifest.json,
manifest.d/, traces/, steps/, memory/). `activation-oom` opens the profiler window at step 0 with
--profile-memory so the failing step, its memory timeline and the OOM record are captured; it
exits non-zero by design. Existing scenario folders are replaced. The analyzers' tests and
`zdiag analyze` examples read these folders; sample_traces/README.md lists what each holds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS: dict[str, dict[str, Any]] = {
    "none": {"profile": ["--profile-steps", "1:1:2"], "steps": 4, "expect_oom": False},
    "whole-model-wrap": {"profile": ["--profile-steps", "1:1:2"], "steps": 4, "expect_oom": False},
    "tiny-layer-wrap": {"profile": ["--profile-steps", "1:1:1"], "steps": 3, "expect_oom": False},
    "missing-overlap": {"profile": ["--profile-steps", "1:1:2"], "steps": 4, "expect_oom": False},
    # --profile-memory records Python stacks, so the failing step's trace is large: a narrower
    # model (and a budget scaled to it) keeps the folder under 1 MB.
    "activation-oom": {
        "profile": ["--profile-steps", "0:0:1", "--profile-memory"],
        "steps": 3,
        "expect_oom": True,
        "size": ["--layers", "2", "--dim", "128", "--heads", "4", "--vocab", "1024"],
        "extra": ["--memory-budget-gb", "0.06"],
    },
}
HARNESS_SIZE = ["--layers", "4", "--dim", "256", "--heads", "8", "--vocab", "4096"]


def record(name: str, out_root: Path) -> dict[str, Any]:
    """Run one scenario into out_root/name; a summary of what it wrote."""
    spec = SCENARIOS[name]
    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    cmd = [
        sys.executable,
        "-m",
        "zdiag",
        "run",
        "--nproc-per-node",
        "2",
        "--out",
        str(out.relative_to(ROOT) if out.is_relative_to(ROOT) else out),
    ]
    cmd += [*spec["profile"], "--harness", "--device", "cpu", "--misconfig", name]
    cmd += [*spec.get("size", HARNESS_SIZE), *spec.get("extra", [])]
    cmd += ["--steps", str(spec["steps"])]
    print(f"make_sample_traces: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    manifest = json.loads((out / "manifest.json").read_text())
    failed = proc.returncode != 0
    if failed != spec["expect_oom"] or manifest["exit"]["oom"] != spec["expect_oom"]:
        raise SystemExit(
            f"scenario {name}: unexpected exit {proc.returncode}\n{proc.stderr[-3000:]}"
        )
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    traces = [r["trace"] for r in manifest["ranks"] if r.get("trace")]
    return {
        "name": name,
        "exit": proc.returncode,
        "bytes": size,
        "traces": len(traces),
        "oom": manifest["exit"]["oom"],
    }


def main() -> int:
    """Record the chosen scenarios (all by default) and print their sizes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "sample_traces")
    args = parser.parse_args()
    out_root = args.out.resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    for name in args.only or list(SCENARIOS):
        info = record(name, out_root)
        print(
            f"{info['name']:18s} exit {info['exit']}  traces {info['traces']}  oom {info['oom']}  "
            f"{info['bytes'] / 1e6:.2f} MB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
