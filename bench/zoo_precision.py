"""Precision and recall of the misconfiguration detectors over a grid of harness shapes.

Every grid cell is the harness under `zdiag run` (2 CPU ranks, gloo) with one `--misconfig`
(or `none`), analyzed with `zdiag.analyzers.engine.pipeline.analyze_paths`. For each of the four
misconfiguration detectors: a true positive is its finding on a run injected with its
misconfiguration, a false positive its finding on any other run (healthy or another
misconfiguration), a false negative its silence on its own misconfiguration.

    .venv/bin/python bench/zoo_precision.py               # full grid (about 10 minutes on 2 cores)
    .venv/bin/python bench/zoo_precision.py --quick       # 2 shapes
    .venv/bin/python bench/zoo_precision.py --jobs 2      # two runs at a time
    .venv/bin/python bench/zoo_precision.py --variants    # + healthy variants (bf16, AC, fixed
                                                          #   OOM) and implicit prefetch
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.misconfigs import MISCONFIGS, SCENARIOS

# Healthy variants (label "none": none of the four may fire) and one reported apart:
# "ac-fixed" is the activation-oom preset and budget with the fix applied (--ac block);
# "implicit" is FSDP2's default prefetch, whose forward gathers block the only thread on CPU
# (no overlap there, unlike CUDA where the host runs ahead): not counted in the scores.
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "none+bf16": ("none", ["--precision", "bf16"]),
    "none+ac": ("none", ["--ac", "block"]),
    "ac-fixed": ("none", ["--misconfig", "activation-oom", "--ac", "block"]),
    "implicit": ("implicit", ["--prefetch", "implicit"]),
}


@dataclass(frozen=True)
class Shape:
    """One harness model shape and ZeRO mode."""

    layers: int
    dim: int
    heads: int
    vocab: int
    zero: int

    @property
    def label(self) -> str:
        """Short name: L3-d64-v512-z3."""
        return f"L{self.layers}-d{self.dim}-v{self.vocab}-z{self.zero}"

    def args(self) -> list[str]:
        """Harness options for this shape."""
        return [
            "--layers", str(self.layers), "--dim", str(self.dim), "--heads", str(self.heads),
            "--vocab", str(self.vocab), "--zero", str(self.zero),
        ]  # fmt: skip


GRID = [
    Shape(2, 64, 4, 512, 3),
    Shape(3, 64, 4, 512, 2),
    Shape(4, 96, 4, 256, 3),
    Shape(4, 96, 4, 256, 2),
    Shape(6, 64, 4, 1024, 3),
    Shape(3, 128, 8, 512, 2),
]
QUICK = [Shape(3, 64, 4, 512, 3), Shape(4, 96, 4, 256, 2)]


@dataclass
class Cell:
    """One run of the grid and what the detectors said; `label` is the expected finding."""

    shape: Shape
    scenario: str
    label: str = ""
    seconds: float = 0.0
    exit_code: int = 0
    fired: set[str] = field(default_factory=set)
    error: str = ""


def command(out: Path, shape: Shape, scenario: str) -> list[str]:
    """`zdiag run` for one cell (same settings as tests/integration/runs/test_zoo.py)."""
    if scenario in VARIANTS:
        args = VARIANTS[scenario][1]
        misconfig = args[args.index("--misconfig") + 1] if "--misconfig" in args else "none"
        extra = [a for a in args if a not in ("--misconfig", misconfig)]
    else:
        misconfig, extra = scenario, []
    if misconfig == "activation-oom":
        extra, profile = [*extra, "--memory-budget-gb", "0.03"], "0:0:2"
    else:
        extra, profile = [*extra, "--seq", "64", "--batch", "2"], "1:1:2"
    return [
        sys.executable, "-m", "zdiag", "run", "--nproc-per-node", "2", "--out", str(out),
        "--profile-steps", profile, "--harness", *shape.args(), *extra,
        "--steps", "4", "--misconfig", misconfig,
    ]  # fmt: skip


def run_cell(root: Path, shape: Shape, scenario: str) -> Cell:
    """Run and analyze one cell."""
    label = VARIANTS[scenario][0] if scenario in VARIANTS else scenario
    cell = Cell(shape, scenario, label)
    out = root / f"{shape.label}-{scenario}"
    start = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        command(out, shape, scenario), capture_output=True, text=True, timeout=600, env=env
    )
    cell.exit_code = proc.returncode
    try:
        report = analyze_paths([out])
        cell.fired = {f.id for f in report.findings if f.id in MISCONFIGS}
    except Exception as exc:  # report the cell, keep the benchmark going
        cell.error = f"{type(exc).__name__}: {exc}"
    cell.seconds = time.perf_counter() - start
    return cell


def scores(cells: list[Cell]) -> dict[str, tuple[int, int, int]]:
    """Per detector: (true positives, false positives, false negatives)."""
    out = {}
    for det in MISCONFIGS:
        scored = [c for c in cells if c.label in SCENARIOS]
        tp = sum(1 for c in scored if c.label == det and det in c.fired)
        fp = sum(1 for c in scored if c.label != det and det in c.fired)
        fn = sum(1 for c in scored if c.label == det and det not in c.fired)
        out[det] = (tp, fp, fn)
    return out


def main() -> int:
    """Run the grid and print the per-cell results and the precision/recall table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 shapes instead of 6")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument(
        "--variants", action="store_true", help="also the healthy variants and implicit prefetch"
    )
    args = parser.parse_args()
    grid = QUICK if args.quick else GRID
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zdiag-zoo-") as tmp:
        root = Path(tmp)
        jobs = [(shape, scenario) for shape in grid for scenario in SCENARIOS]
        if args.variants:
            jobs += [(shape, v) for shape in QUICK for v in VARIANTS]
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            cells = list(pool.map(lambda job: run_cell(root, *job), jobs))
    total = time.perf_counter() - started
    print(
        f"# zoo precision/recall: {len(cells)} runs, {total:.0f} s, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} CPUs, python {platform.python_version()}"
    )
    print()
    print("| shape | scenario | expected | exit | fired (of the four) | s |")
    print("|---|---|---|---|---|---|")
    for c in cells:
        fired = ", ".join(sorted(c.fired)) or "-"
        if c.error:
            fired += f" (analyze failed: {c.error})"
        print(
            f"| {c.shape.label} | {c.scenario} | {c.label} | {c.exit_code} | {fired} "
            f"| {c.seconds:.0f} |"
        )
    print()
    print("| detector | TP | FP | FN | precision | recall |")
    print("|---|---|---|---|---|---|")
    for det, (tp, fp, fn) in scores(cells).items():
        precision = f"{tp / (tp + fp):.2f}" if tp + fp else "n/a"
        recall = f"{tp / (tp + fn):.2f}" if tp + fn else "n/a"
        print(f"| {det} | {tp} | {fp} | {fn} | {precision} | {recall} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
