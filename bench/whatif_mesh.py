"""The mesh-shape what-if against re-runs: `zdiag whatif RUN --mesh-shape R,S` on a user-zoo
FSDP2 run, against the same script run on that (replicate, shard) mesh (issue 27).

Each configuration (script, ranks, mesh shape) is recorded `--repeats` times with `zdiag run`
(interleaved over the configurations, so a slow minute of the machine hits them alike). Per
case (a recorded shape -> another):

- predicted: the median over the recorded shape's runs of `zdiag whatif RUN --mesh-shape R,S
  --json`'s job change (predicted minus measured step, on the traced steps), and its memory
  delta;
- measured: the other shape's median step less the recorded one's, from the scripts' own
  summary lines (the slowest rank's median step per run, as the zoo reads them), and the same
  for the largest peak the scripts' memory emulator printed (parameters, gradients, optimizer
  states, gathered units, activations);
- spread: the larger of the two shapes' max - min.

    python bench/whatif_mesh.py [--case tabular_fsdp2:4:1,4:2,2 ...] [--repeats 3]
        [--workdir DIR] [-o out.md]

Runs an earlier call left in `--workdir` (with their `zoo-run.log`) are read, not run again.
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
from whatif_checkpoint import compared, job_change_ms, verdict, whatif_json, write_table  # noqa: E402

# script:ranks:recorded shape:replayed shape (replicate,shard)
CASES = (
    "tabular_fsdp2:4:1,4:2,2",
    "tabular_fsdp2:4:1,4:4,1",
    "tabular_fsdp2:4:2,2:1,4",
    "tabular_fsdp2:4:2,2:4,1",
    "trunk_fsdp2:2:1,2:2,1",
    "trunk_fsdp2:4:1,4:2,2",
    "seq2seq_fsdp2:4:1,4:2,2",
    "seq2seq_fsdp2:4:2,2:1,4",
    "tabular_fsdp2:2:1,2:2,1",
    "seq2seq_fsdp2:2:1,2:2,1",
)


def record(
    out: Path, script: str, ranks: str, shape: str, steps: int
) -> tuple[float, float] | None:
    """`zdiag run` one zoo script on `ranks` ranks and mesh `shape`; (slowest rank's median step
    ms, largest peak MiB) it printed. A run directory holding a complete log is read again
    instead (`--workdir` of an earlier call: the predictions re-made on the same runs)."""
    log = out / "zoo-run.log"
    if log.is_file():
        step, peak = parse_summaries(log.read_text())
        if step is not None and peak is not None:
            return step, peak
    proc = subprocess.run(
        [sys.executable, "-m", "zdiag", "run", "--nproc-per-node", ranks, "--out", str(out),
         str(ZOO / f"{script}.py"), "--mesh-shape", shape, "--steps", str(steps)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    step, peak = parse_summaries(proc.stdout + proc.stderr)
    if out.is_dir():
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or step is None or peak is None:
        print(f"{out}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        return None
    return step, peak


def predicted(run_dir: Path, shape: str) -> tuple[float, float] | None:
    """(job's predicted minus measured step ms, memory delta MiB) of the replay (None: refused)."""
    data = whatif_json(run_dir, "--mesh-shape", shape)
    if data is None:
        return None
    return job_change_ms(data), (data["memory_delta_bytes"] or 0) / 2**20


def main() -> int:
    """Record every configuration, replay each case, write the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", default=[], metavar="SCRIPT:RANKS:FROM:TO",
                   help="a zoo script, its ranks, the recorded and the replayed shape")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration")
    p.add_argument("--steps", type=int, default=16, help="training steps per run")
    p.add_argument("--workdir", type=Path, default=None, help="keep run directories here")
    p.add_argument("-o", "--output", type=Path, help="markdown file (else stdout)")
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="zdiag-mesh-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cases = [c.split(":") for c in (args.case or CASES)]
    configs = sorted({(c[0], c[1], shape) for c in cases for shape in c[2:]})
    runs: dict[tuple[str, str, str], list[tuple[Path, float, float]]] = {k: [] for k in configs}
    for i in range(args.repeats):
        for script, ranks, shape in configs:
            d = workdir / f"{script}_n{ranks}_{shape.replace(',', 'x')}_{i}"
            if (got := record(d, script, ranks, shape, args.steps)) is not None:
                runs[(script, ranks, shape)].append((d, *got))
    rows = []
    for script, ranks, src, dst in cases:
        base, other = runs[(script, ranks, src)], runs[(script, ranks, dst)]
        preds = [q for d, _s, _m in base if (q := predicted(d, dst)) is not None]
        if not base or not other or not preds:
            rows.append(f"| `{script}` | {ranks} | {src} -> {dst} | - | - | - | - | - | - | - |")
            continue
        steps = [s for _d, s, _m in base], [s for _d, s, _m in other]
        mems = [m for _d, _s, m in base], [m for _d, _s, m in other]
        pred, meas, spread = compared([q[0] for q in preds], *steps)
        pred_mem, meas_mem, _ = compared([q[1] for q in preds], *mems)
        rows.append(
            f"| `{script}` | {ranks} | {src} -> {dst} | {statistics.median(steps[0]):.1f} "
            f"| {pred:+.1f} | {meas:+.1f} | {spread:.1f} | {verdict(pred, meas, spread)} "
            f"| {pred_mem:+.1f} / {meas_mem:+.1f} | {verdict(pred_mem, meas_mem, 0.0)} |"
        )
    write_table(
        "bench/whatif_mesh.py",
        ["script", "ranks", "shape (replicate,shard)", "recorded ms/step", "predicted change ms",
         "measured change ms", "spread ms", "step within 2x", "memory MiB predicted / measured",
         "memory within 2x"],
        rows,
        args.output,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
