"""The micro-batch what-if against re-runs: `zdiag whatif RUN --micro-batches K` on a user-zoo
run at batch B, against the same script run at batch B/K with K-step gradient accumulation (the
same global batch; issue 27).

Per case, `--repeats` runs of each side, interleaved (full batch, then accumulated):

- predicted: the median over the full-batch runs of `zdiag whatif RUN --micro-batches K --json`'s
  job change (predicted minus measured step, on the traced steps);
- measured: the median accumulated step less the median full-batch step, from the scripts' own
  summary lines (the slowest rank's median step per run, as the zoo reads them);
- spread: the larger of the two sides' max - min.

    python bench/whatif_micro_batch.py [--case trunk_fsdp2:256:2 ...] [--repeats 3]
        [--workdir DIR] [-o out.md]
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
from user_zoo import ZOO, parse_summaries  # noqa: E402
from whatif_checkpoint import compared, predicted_change_ms, verdict, write_table  # noqa: E402

# script:batch:K, FSDP2 scripts of the zoo that take --grad-accum
CASES = ("trunk_fsdp2:256:2", "trunk_fsdp2:256:4", "tabular_fsdp2:256:2", "seq2seq_fsdp2:16:2")


def record(out: Path, script: str, args: list[str]) -> float | None:
    """`zdiag run` one zoo script on 2 ranks; the slowest rank's median step it printed."""
    proc = subprocess.run(
        [sys.executable, "-m", "zdiag", "run", "--nproc-per-node", "2", "--out", str(out),
         str(ZOO / f"{script}.py"), *args],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        print(f"{out}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        return None
    return parse_summaries(proc.stdout + proc.stderr)[0]


def row(workdir: Path, case: str, repeats: int) -> str:
    """One markdown row: record both sides, predict, compare."""
    script, batch, k = case.split(":")
    full_args = ["--batch", batch]
    accum_args = ["--batch", str(int(batch) // int(k)), "--grad-accum", k]
    full: list[float] = []
    accum: list[float] = []
    preds: list[float] = []
    for i in range(repeats):
        d = workdir / f"{script}_b{batch}_k{k}_full{i}"
        if (s := record(d, script, full_args)) is not None:
            full.append(s)
            if (p := predicted_change_ms(d, "--micro-batches", k)) is not None:
                preds.append(p)
        if (
            s := record(workdir / f"{script}_b{batch}_k{k}_acc{i}", script, accum_args)
        ) is not None:
            accum.append(s)
    if not full or not accum or not preds:
        return f"| `{script}` | {batch} | {k} | - | - | - | - | no runs |"
    pred, meas, spread = compared(preds, full, accum)
    within = verdict(pred, meas, spread)
    return (
        f"| `{script}` | {batch} | {k} | {statistics.median(full):.1f} | {pred:+.1f} "
        f"| {meas:+.1f} | {spread:.1f} | {within} |"
    )


def main() -> int:
    """Write the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", default=[], metavar="SCRIPT:BATCH:K",
                   help="a zoo script, its full batch and the micro-batches (repeatable)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="runs of each side")
    p.add_argument("--workdir", type=Path, default=None, help="keep run directories here")
    p.add_argument("-o", "--output", type=Path, help="markdown file (else stdout)")
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="zdiag-micro-"))
    workdir.mkdir(parents=True, exist_ok=True)
    write_table(
        "bench/whatif_micro_batch.py",
        ["script", "batch", "K", "full-batch ms/step", "predicted change ms",
         "measured change ms", "spread ms", "within 2x"],
        [row(workdir, c, args.repeats) for c in (args.case or CASES)],
        args.output,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
