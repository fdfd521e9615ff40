"""The all-reduce-once what-if against re-runs: `zdiag whatif RUN --all-reduce-once` on
examples/mesh/hsdp_accum.py (HSDP on a (2, 2) mesh, 4 micro-batches per step, each all-reduced
across the replicas), against the same script with `exposed-replicate-allreduce`'s code pasted
into its `before_backward` hook (`model.set_requires_all_reduce(i == 3)`; issue 27).

Per repeat, one run of each script (interleaved), 4 gloo ranks:

- predicted: the median over the original's runs of the replay's job change (predicted minus
  measured step, on the traced steps);
- measured: the patched script's median step less the original's, each the slowest rank's
  median step from zdiag's step logs (the first two steps left out);
- spread: the larger of the two sides' max - min.

    python bench/whatif_all_reduce_once.py [--repeats 3] [--steps 16] [--workdir DIR] [-o out.md]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from user_zoo import step_log_ms  # noqa: E402
from whatif_checkpoint import predicted_change_ms, write_table  # noqa: E402

SCRIPT = ROOT / "examples" / "mesh" / "hsdp_accum.py"
HOOK = '    """Called before micro-batch i\'s backward (i = 0 .. MICRO_BATCHES - 1)."""\n'
FIX = "    model.set_requires_all_reduce(i == 3)\n"


def record(out: Path, script: Path, steps: int) -> float | None:
    """`zdiag run` the script on 4 ranks; the slowest rank's median step from the step logs."""
    proc = subprocess.run(
        [sys.executable, "-m", "zdiag", "run", "--nproc-per-node", "4", "--out", str(out),
         str(script), "--steps", str(steps)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        print(f"{out}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        return None
    return step_log_ms(out)


def main() -> int:
    """Record both scripts, replay the original's runs, write the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="runs of each script")
    p.add_argument("--steps", type=int, default=16, help="training steps per run")
    p.add_argument("--workdir", type=Path, default=None, help="keep run directories here")
    p.add_argument("-o", "--output", type=Path, help="markdown file (else stdout)")
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="zdiag-allreduce-"))
    workdir.mkdir(parents=True, exist_ok=True)
    text = SCRIPT.read_text()
    if HOOK not in text:
        print(f"{SCRIPT}: its before_backward hook changed; update HOOK", file=sys.stderr)
        return 2
    fixed = workdir / "hsdp_accum_once.py"
    fixed.write_text(text.replace(HOOK, HOOK + FIX))
    before: list[float] = []
    after: list[float] = []
    preds: list[float] = []
    for i in range(args.repeats):
        d = workdir / f"accum{i}"
        if (s := record(d, SCRIPT, args.steps)) is not None:
            before.append(s)
            if (q := predicted_change_ms(d, "--all-reduce-once")) is not None:
                preds.append(q)
        if (s := record(workdir / f"once{i}", fixed, args.steps)) is not None:
            after.append(s)
    if not before or not after or not preds:
        print("no complete runs", file=sys.stderr)
        return 1
    pred = statistics.median(preds)
    meas = statistics.median(after) - statistics.median(before)
    spread = max(max(before) - min(before), max(after) - min(after))
    within = "yes" if pred * meas > 0 and 0.5 <= pred / meas <= 2.0 else "no"
    if abs(meas) <= spread and abs(pred) <= spread:
        within = "noise" if pred * meas >= 0 else "noise, sign differs"
    write_table(
        "bench/whatif_all_reduce_once.py",
        ["script", "ms/step", "predicted change ms", "measured change ms", "spread ms",
         "within 2x"],
        [f"| `examples/mesh/hsdp_accum.py` | {statistics.median(before):.1f} | {pred:+.1f} "
         f"| {meas:+.1f} | {spread:.1f} | {within} |"],
        args.output,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
