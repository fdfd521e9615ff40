"""The HSDP fixes' what-ifs against re-runs: each `zdiag whatif` change on an example HSDP
script, against the same script with `exposed-replicate-allreduce`'s code for it (issue 27):

- `--all-reduce-once` on examples/mesh/hsdp_accum.py (a (2, 2) mesh, 4 micro-batches per step,
  each all-reduced across the replicas), against it with `model.set_requires_all_reduce(i == 3)`
  in its `before_backward` hook;
- `--reduce-dtype bf16` on examples/mesh/hsdp.py, against it with
  `mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)` on each `fully_shard`. The
  what-if refuses it on CPU runs (gloo sums bf16 on the host), so this row needs NCCL ranks.

Per case and repeat, one run of each script (interleaved), 4 gloo ranks:

- predicted: the median over the original's runs of the replay's job change (predicted minus
  measured step, on the traced steps);
- measured: the patched script's median step less the original's, each the slowest rank's
  median step from zdiag's step logs (the first two steps left out);
- spread: the larger of the two sides' max - min.

    python bench/whatif_hsdp_fixes.py [--case all-reduce-once|bf16-reduce] [--repeats 3]
        [--steps 16] [--workdir DIR] [-o out.md]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from user_zoo import step_log_ms  # noqa: E402
from whatif_checkpoint import compared, predicted_change_ms, verdict, write_table  # noqa: E402

MESH = ROOT / "examples" / "mesh"
HOOK = '    """Called before micro-batch i\'s backward (i = 0 .. MICRO_BATCHES - 1)."""\n'
MP = "mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)"


def _once(text: str) -> str:
    return text.replace(HOOK, HOOK + "    model.set_requires_all_reduce(i == 3)\n")


def _bf16(text: str) -> str:
    text = text.replace("mesh=mesh)", f"mesh=mesh, {MP})")
    return text.replace(
        "from torch.distributed.fsdp import fully_shard",
        "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard",
    )


# case: (script, the finding's change pasted in, the what-if's arguments)
CASES: dict[str, tuple[str, Callable[[str], str], tuple[str, ...]]] = {
    "all-reduce-once": ("hsdp_accum.py", _once, ("--all-reduce-once",)),
    "bf16-reduce": ("hsdp.py", _bf16, ("--reduce-dtype", "bf16")),
}


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
    return step_log_ms(out)[0]


def row(workdir: Path, case: str, repeats: int, steps: int) -> str:
    """One markdown row: record both scripts, replay the original's runs, compare."""
    name, patch, change = CASES[case]
    script = MESH / name
    text = script.read_text()
    fixed = workdir / f"{case}_{name}"
    fixed.write_text(patch(text))
    if fixed.read_text() == text:
        return f"| `{name}` | `{' '.join(change)}` | - | - | - | - | the patch no longer applies |"
    before: list[float] = []
    after: list[float] = []
    preds: list[float] = []
    for i in range(repeats):
        d = workdir / f"{case}_before{i}"
        if (s := record(d, script, steps)) is not None:
            before.append(s)
            if (q := predicted_change_ms(d, *change)) is not None:
                preds.append(q)
        if (s := record(workdir / f"{case}_after{i}", fixed, steps)) is not None:
            after.append(s)
    if not before or not after or not preds:
        return f"| `{name}` | `{' '.join(change)}` | - | - | - | - | no complete runs |"
    pred, meas, spread = compared(preds, before, after)
    within = verdict(pred, meas, spread)
    return (
        f"| `{name}` | `{' '.join(change)}` | {statistics.median(before):.1f} | {pred:+.1f} "
        f"| {meas:+.1f} | {spread:.1f} | {within} |"
    )


def main() -> int:
    """Write the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", choices=sorted(CASES), default=[],
                   help="a change (repeatable; default: all)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="runs of each script")
    p.add_argument("--steps", type=int, default=16, help="training steps per run")
    p.add_argument("--workdir", type=Path, default=None, help="keep run directories here")
    p.add_argument("-o", "--output", type=Path, help="markdown file (else stdout)")
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="zdiag-hsdp-fixes-"))
    workdir.mkdir(parents=True, exist_ok=True)
    write_table(
        "bench/whatif_hsdp_fixes.py",
        ["script", "what-if", "ms/step", "predicted change ms", "measured change ms",
         "spread ms", "within 2x"],
        [row(workdir, c, args.repeats, args.steps) for c in (args.case or sorted(CASES))],
        args.output,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
