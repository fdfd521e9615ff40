"""Check `pipeline-bubble`'s replayed gains against re-runs: each case runs a pipeline script
as recorded (the baseline) and with the change the replay predicts for (twice the
micro-batches, or blocks moved across the split), `--repeats` times each, interleaved.

- predicted: the schedule replay on each baseline run (analyzers/whatif/pipeline_replay.py:
  the median over its profiled steps of the slowest pipeline's phase, unchanged minus
  changed), the median over the baselines; the replay runs whether or not the finding fires;
- measured: the median step of the baselines minus that of the changed runs (the step log over
  steps 10 and later, slowest rank: the profiled steps, the trace's export and the steps that
  share the host with its compression are left out);
- spread: the larger max-min of the two sides' medians;
- model check: the unchanged replay's largest error against the measured phase.

A prediction agrees when it is within 2x of the measurement, or both lie inside the spread with
the same sign.

    .venv/bin/python bench/pipeline_verify.py --workdir /tmp/pv -o /tmp/pipeline_verify.md
    .venv/bin/python bench/pipeline_verify.py --only gpt-6,2-m8 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import user_zoo as uz  # bench/, beside this script

from zdiag.analyzers.detectors.pipeline_bubble import Bubble, bubble_of
from zdiag.analyzers.engine.summary_pipeline import SummaryOptions, analyze_via_summaries
from zdiag.analyzers.whatif.pipeline_replay import Replayed

REPO = Path(__file__).resolve().parent.parent
MESH = REPO / "examples" / "mesh"
SKIP_STEPS = 10
STEPS = "30"


@dataclass(frozen=True)
class Case:
    """A pipeline script, its baseline and changed arguments, and which gain the change checks."""

    name: str
    ranks: int
    script: str
    base: tuple[str, ...]
    changed: tuple[str, ...]
    change: str  # "microbatches" (twice as many) or "split" (blocks moved)


GPT, FSDP_PP = "pipeline_gpt.py", "pipeline.py"
CASES = (
    Case("gpt-6,2-m8", 2, GPT, ("--split", "6,2"), ("--split", "6,2", "--microbatches", "8"), "microbatches"),
    Case("gpt-6,2-to-4,4", 2, GPT, ("--split", "6,2"), ("--split", "4,4"), "split"),
    Case("gpt-gpipe-4,4-m8", 2, GPT, ("--split", "4,4", "--schedule", "gpipe"), ("--split", "4,4", "--schedule", "gpipe", "--microbatches", "8"), "microbatches"),
    Case("fsdp-pp-2r-6,1-m8", 2, FSDP_PP, ("--stage-blocks", "6,1"), ("--stage-blocks", "6,1", "--microbatches", "8"), "microbatches"),
    Case("fsdp-pp-2r-6,1-to-4,3", 2, FSDP_PP, ("--stage-blocks", "6,1"), ("--stage-blocks", "4,3"), "split"),
    Case("fsdp-pp-4r-3,1-m8", 4, FSDP_PP, ("--stage-blocks", "3,1"), ("--stage-blocks", "3,1", "--microbatches", "8"), "microbatches"),
    Case("gpt-4r-3,1,1,1-m8", 4, GPT, ("--split", "3,1,1,1"), ("--split", "3,1,1,1", "--microbatches", "8"), "microbatches"),
    Case("gpt-4r-3,1,1,1-to-2,2,1,1", 4, GPT, ("--split", "3,1,1,1"), ("--split", "2,2,1,1"), "split"),
    Case("fsdp-pp-4r-6,1-to-4,3", 4, FSDP_PP, ("--stage-blocks", "6,1"), ("--stage-blocks", "4,3"), "split"),
    Case("gpt-gpipe-4,4-m2-to-m4", 2, GPT, ("--split", "4,4", "--schedule", "gpipe", "--microbatches", "2"), ("--split", "4,4", "--schedule", "gpipe", "--microbatches", "4"), "microbatches"),
    Case("gpt-4,4-m2-to-m4", 2, GPT, ("--split", "4,4", "--microbatches", "2"), ("--split", "4,4", "--microbatches", "4"), "microbatches"),
    Case("gpt-il-2,2,2,2-m8", 2, GPT, ("--split", "2,2,2,2", "--schedule", "interleaved"), ("--split", "2,2,2,2", "--schedule", "interleaved", "--microbatches", "8"), "microbatches"),
    Case("gpt-bfs-2,2,2,2-m8", 2, GPT, ("--split", "2,2,2,2", "--schedule", "bfs"), ("--split", "2,2,2,2", "--schedule", "bfs", "--microbatches", "8"), "microbatches"),
    Case("gpt-il-4r-8x1-m8", 4, GPT, ("--split", "1,1,1,1,1,1,1,1", "--schedule", "interleaved"), ("--split", "1,1,1,1,1,1,1,1", "--schedule", "interleaved", "--microbatches", "8"), "microbatches"),
)  # fmt: skip


def record(out: Path, case: Case, args: tuple[str, ...]) -> float:
    """The run's median step (ms), recording it under `zdiag run` unless `out` holds it."""
    if not (out / "steps").exists():
        cmd = [sys.executable, "-m", "zdiag", "run", "--nproc-per-node", str(case.ranks),
               "--out", str(out), str(MESH / case.script), *args, "--steps", STEPS]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, timeout=900)
    step, _ = uz.step_log_ms(out, skip=SKIP_STEPS)
    if step is None:
        raise SystemExit(f"{out}: no step log")
    return float(step)


def replay_of(run: Path) -> Bubble:
    """The baseline's measured pipeline and schedule replay, as `pipeline-bubble` computes them."""
    result = analyze_via_summaries([run], SummaryOptions(use_stored=False, write_cache=False))
    b = bubble_of(result.context) if result.context is not None else None
    if b is None or not isinstance(b.replayed, Replayed):
        raise SystemExit(f"{run}: no pipeline replay ({b.replayed if b else 'no pipeline'})")
    return b


def check(case: Case, root: Path, repeats: int) -> str:
    """One markdown row."""
    base, changed, predicted, errors = [], [], [], []
    for k in range(repeats):
        b_dir, c_dir = root / f"{case.name}-base-{k}", root / f"{case.name}-changed-{k}"
        base.append(record(b_dir, case, case.base))
        changed.append(record(c_dir, case, case.changed))
        b = replay_of(b_dir)
        gain = b.gain_mb if case.change == "microbatches" else b.gain_bal
        if gain is not None:
            predicted.append(gain)
        assert isinstance(b.replayed, Replayed)
        errors.append(b.replayed.error)
    measured = statistics.median(base) - statistics.median(changed)
    spread = max(max(base) - min(base), max(changed) - min(changed))
    pred = statistics.median(predicted) if predicted else None
    if pred is None:
        verdict = "not replayed"
    elif measured and 0.5 <= pred / measured <= 2.0:
        verdict = "within 2x"
    elif abs(measured) <= spread and abs(pred) <= spread and pred * measured >= 0:
        verdict = "inside the spread, same sign"
    else:
        verdict = "**miss**"
    shown = f"{pred:.1f}" if pred is not None else "-"
    return (
        f"| {case.name} | {case.ranks} | {' '.join(case.changed)} | {shown} | {measured:.1f} | "
        f"{spread:.1f} | {max(errors):.1%} | {verdict} |"
    )


def main() -> int:
    """Run the cases and print (or write) the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/pipeline_verify"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", action="append", help="case name (repeatable)")
    p.add_argument("-o", "--output", type=Path, help="markdown file (else stdout)")
    args = p.parse_args()
    cases = [c for c in CASES if not args.only or c.name in args.only]
    started = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    for case in cases:
        rows.append(check(case, args.workdir, args.repeats))
        print(rows[-1], file=sys.stderr, flush=True)
    text = (
        f"Command: `bench/pipeline_verify.py --repeats {args.repeats}`, "
        f"{started:%Y-%m-%d %H:%M} UTC, {platform.node()} ({platform.machine()}), "
        f"Python {platform.python_version()}\n\n"
        "| case | ranks | changed run | predicted gain ms | measured gain ms | spread ms | "
        "model check | verdict |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    if args.output:
        args.output.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
