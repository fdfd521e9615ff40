"""`zdiag plan` under a memory budget, where only activation checkpointing fits, applied and run
again (issue 27): predicted against measured step time and peak memory.

For each Hugging Face model of examples/library/checkpoint_budget.py (GPT-2, ViT; FSDP2 on each
block, then the root, on 2 gloo ranks):

1. one `zdiag run --profile-memory` (which measures what each block's forward saves for
   backward) and `zdiag plan RUN --memory-budget-gb B --json`, B = the run's peak less half of
   what checkpointing every block is predicted to free (`zdiag whatif --checkpoint`): the plan's
   predicted peak change and its code;
2. `--repeats` plain `zdiag run`s (no memory profiling, which slows the steps): the predicted
   step change, the median over runs of `zdiag whatif RUN <the plan's change>`'s job change;
3. `--repeats` pairs of plain `torchrun` runs of the script as it is and with the plan's code
   pasted (`--paste`), interleaved: measured step change (the slowest rank's median step,
   medians over runs) from runs as they are, and peak change (the largest rank's peak resident
   memory after the first step, medians over runs) from runs with `MALLOC_MMAP_THRESHOLD_=65536`,
   so that freed tensors leave the resident set (which slows the steps: every tensor of 64 KiB
   or more is mapped and unmapped on its own); spread: the larger of the two sides' max - min.

A second row per model does the same for `zdiag whatif --micro-batches K` against the script's
`--grad-accum K` (the same global batch; gradients reduced in the last micro-batch only).

    python bench/plan_checkpoint.py [--model gpt2 --model vit] [--repeats 3] [--micro-batches 2]
        [--workdir DIR] [-o out.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from whatif_checkpoint import compared, job_change_ms, verdict, whatif_json, write_table  # noqa: E402

SCRIPT = ROOT / "examples" / "library" / "checkpoint_budget.py"
BLOCKS = {"gpt2": "transformer.h", "vit": "vit.layers"}
MIB = 2**20
LINE = re.compile(r"rank (\d+): median step ([\d.]+) ms, peak rss ([\d.]+) MiB")


def _zdiag(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zdiag", *args], capture_output=True, text=True, timeout=900,
        check=False,
    )  # fmt: skip


def _record(out: Path, model: str, *flags: str) -> Path:
    """A `zdiag run` of the script (2 ranks), reused when already there."""
    if not (out / "manifest.json").is_file():
        proc = _zdiag("run", "--nproc-per-node", "2", *flags, "--out", str(out), str(SCRIPT),
                      "--model", model)  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"{out}: zdiag run failed: {proc.stderr[-2000:]}")
    return out


def _torchrun(model: str, paste: Path | None, *extra: str, memory: bool) -> tuple[float, float]:
    """(slowest rank's median step ms, largest rank's peak RSS MiB) of one plain run; with
    `memory`, freed tensors leave the resident set (a fixed mmap threshold: every tensor of
    64 KiB or more mapped and unmapped on its own, which slows the steps, so the step time is
    taken from the runs without it)."""
    env = dict(os.environ, **({"MALLOC_MMAP_THRESHOLD_": "65536"} if memory else {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(SCRIPT), "--model", model, *(["--paste", str(paste)] if paste else []),
           *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, check=False)
    found = LINE.findall(proc.stdout)
    if proc.returncode != 0 or len(found) != 2:
        raise SystemExit(f"torchrun {model} failed: {proc.stderr[-2000:]}")
    return max(float(s) for _, s, _ in found), max(float(m) for _, _, m in found)


def _plan(run: Path, model: str) -> dict[str, Any]:
    """The plan under a budget that only checkpointing meets (see the module docstring)."""
    ckpt = whatif_json(run, "--checkpoint", BLOCKS[model])
    if ckpt is None or ckpt.get("memory_delta_bytes") is None:
        raise SystemExit(f"{run}: no checkpointing memory figure")
    peak = max(r["peak_bytes"] for r in ckpt["ranks"] if r.get("peak_bytes"))
    budget = (peak + ckpt["memory_delta_bytes"] / 2) / 2**30
    proc = _zdiag("plan", str(run), "--memory-budget-gb", f"{budget:.6f}", "--json", "--no-cache")
    if proc.returncode != 0:
        raise SystemExit(f"{run}: zdiag plan failed: {proc.stderr}")
    data: dict[str, Any] = json.loads(proc.stdout)
    data["budget_gib"] = budget
    return data


def _line(model: str, change: str, pred: tuple[list[float], float], base: list[tuple[float, float]],
          other: list[tuple[float, float]]) -> str:  # fmt: skip
    """One markdown row: (step predictions, peak prediction MiB) against measured runs."""
    preds, mem_pred = pred
    p, meas, spread = compared(preds, [b[0] for b in base], [f[0] for f in other])
    mem_meas = statistics.median(f[1] for f in other) - statistics.median(b[1] for b in base)
    mem_spread = max(
        max(b[1] for b in base) - min(b[1] for b in base),
        max(f[1] for f in other) - min(f[1] for f in other),
    )
    return (
        f"| `{model}` | `{change}` | {statistics.median(b[0] for b in base):.0f} "
        f"| {p:+.1f} | {meas:+.1f} | {spread:.1f} | {verdict(p, meas, spread)} "
        f"| {mem_pred:+.1f} | {mem_meas:+.1f} | {mem_spread:.1f} "
        f"| {verdict(mem_pred, mem_meas, mem_spread)} |"
    )


def rows(workdir: Path, model: str, repeats: int, micro_batches: int) -> list[str]:
    """The plan's row and the micro-batches' row of one model."""
    memory_run = _record(workdir / f"{model}_memory", model, "--profile-memory")
    plan = _plan(memory_run, model)
    best = plan["plans"][0]
    if not plan.get("code"):
        return [f"| `{model}` | (nothing) | - | - | - | - | - | - | - | - | - |"]
    paste = workdir / f"{model}_plan.py"
    paste.write_text(plan["code"] + "\n")
    accum = ("--micro-batches", str(micro_batches))
    mb = whatif_json(memory_run, *accum)
    plain = [_record(workdir / f"{model}_plain{k}", model) for k in range(repeats)]
    preds: dict[str, list[float]] = {"plan": [], "mb": []}
    for run in plain:
        for key, flags in (("plan", best["change"].split()), ("mb", accum)):
            data = whatif_json(run, *flags)
            if data is not None:
                preds[key].append(job_change_ms(data))
    base: list[tuple[float, float]] = []
    fixed: list[tuple[float, float]] = []
    accumulated: list[tuple[float, float]] = []
    accum_flags = ("--grad-accum", str(micro_batches))
    for _ in range(repeats):  # (step time from a plain run, peak from a run that unmaps)
        for side, paste_or_none, extra in ((base, None, ()), (fixed, paste, ()),
                                           (accumulated, None, accum_flags)):  # fmt: skip
            step, _ = _torchrun(model, paste_or_none, *extra, memory=False)
            _, peak = _torchrun(model, paste_or_none, *extra, memory=True)
            side.append((step, peak))
    out = [
        _line(model, best["change"],
              (preds["plan"], (best["predicted_peak_bytes"] - plan["measured_peak_bytes"]) / MIB),
              base, fixed),
    ]  # fmt: skip
    if mb is not None and mb.get("memory_delta_bytes") is not None and preds["mb"]:
        out.append(
            _line(
                model,
                " ".join(accum),
                (preds["mb"], mb["memory_delta_bytes"] / MIB),
                base,
                accumulated,
            )
        )
    return out


def main() -> int:
    """Write the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", choices=sorted(BLOCKS), default=[],
                   help="a model (repeatable; default: all)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="runs of each side")
    p.add_argument("--micro-batches", type=int, default=2, help="K of the accumulation row")
    p.add_argument("--workdir", type=Path, default=None, help="keep run directories here")
    p.add_argument("-o", "--output", type=Path, help="markdown file (else stdout)")
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="zdiag-plan-checkpoint-"))
    workdir.mkdir(parents=True, exist_ok=True)
    write_table(
        "bench/plan_checkpoint.py",
        ["model", "plan", "ms/step", "predicted change ms", "measured change ms", "spread ms",
         "within 2x", "predicted peak change MiB", "measured peak change MiB", "spread MiB",
         "within 2x"],
        [r for m in (args.model or sorted(BLOCKS)) for r in rows(workdir, m, args.repeats, args.micro_batches)],
        args.output,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
