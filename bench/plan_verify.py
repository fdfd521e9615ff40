"""Apply `zdiag plan`'s best plan to each misconfigured user-zoo run and race it against the
zoo's own fix.

For every FSDP2 and FSDP1 case of `bench/user_zoo.py` whose misconfiguration is one the planner
searches (a wrap or prefetch mistake: whole-model-wrap, tiny-layer-wrap, missing-overlap):

1. `zdiag plan RUN --json` on the misconfigured run (one already in `--workdir`, named as
   `user_zoo.py --fix-verify` names it, or a new one);
2. the plan's code is pasted into the script as a user would (`--paste FILE`: the zoo's
   `trainkit.wrap_or_paste`, which runs the code in place of the script's wrap when the code
   wraps, else after it); a plan of "nothing" re-runs the variant as it is;
3. the applied plan and the zoo's fix are run `--repeats` times each, interleaved, and their
   median steps compared (the step log after the first 2 steps, slowest rank).

A plan is "at least as fast" when its median step is no slower than the fix's, or slower by
less than the larger run-to-run spread of the two sides ("noise").

    .venv/bin/python bench/plan_verify.py --workdir /tmp/fv2 -o /tmp/plan_verify.md
    .venv/bin/python bench/plan_verify.py --only cnn_fsdp2 --repeats 3
    .venv/bin/python bench/plan_verify.py --workdir /tmp/fv8 --steps 20   # 18 measured steps
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import user_zoo as uz  # bench/, beside this script

REPO = Path(__file__).resolve().parent.parent
PLANNED = {"whole-model-wrap", "tiny-layer-wrap", "missing-overlap"}


@dataclass
class PlanRow:
    """One case: the plan, its applied and the fix's measured steps."""

    case: str
    fix: str
    plan: str
    predicted_ms: float | None
    measured_bad_ms: float | None
    plan_ms: list[float]
    fix_ms: list[float]
    error: str = ""

    def verdict(self) -> str:
        """yes / noise / no / - (see the module docstring)."""
        if self.error or not self.plan_ms or not self.fix_ms:
            return "-"
        p, f = statistics.median(self.plan_ms), statistics.median(self.fix_ms)
        if p <= f:
            return "yes"
        spread = max(max(xs) - min(xs) for xs in (self.plan_ms, self.fix_ms))
        return "noise" if p - f <= spread else "no"


def plan_of(run_dir: Path, timeout_s: float) -> dict[str, Any]:
    """`zdiag plan RUN --json` (no stored summaries: today's code)."""
    proc = subprocess.run(
        [sys.executable, "-m", "zdiag", "plan", str(run_dir), "--json", "--no-cache"],
        capture_output=True, text=True, timeout=timeout_s,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["no output"])[-1])
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def verify(
    case: Any, root: Path, repeats: int, timeout_s: float, steps: int | None = None
) -> PlanRow:
    """Plan the misconfigured run, apply the plan, race it against the fix (`steps`: the
    scripts' --steps, else theirs)."""
    name = case.name
    fix = " ".join(case.fix) or "(the script's defaults)"
    bad_dir = root / (name.replace(":", "__") + "__bad0")
    if not (bad_dir / "manifest.json").is_file():
        bad = uz.run_case(case, root, args=case.args, tag="bad0", timeout_s=timeout_s, steps=steps)
        if bad.error:
            return PlanRow(name, fix, "-", None, None, [], [], bad.error)
    try:
        plan = plan_of(bad_dir, timeout_s)
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        return PlanRow(name, fix, "-", None, None, [], [], f"plan: {exc}")
    predicted = plan["plans"][0]["predicted_ms"]
    args = list(case.args)
    code = plan.get("code")
    if code:
        paste = root / (name.replace(":", "__") + "__plan.py")
        paste.write_text(code + "\n")
        args += ["--paste", str(paste)]
    row = PlanRow(name, fix, str(plan["best"]), predicted, plan.get("measured_ms"), [], [])
    for k in range(repeats):
        applied = uz.run_case(
            case, root, args=args, tag=f"plan{k}", timeout_s=timeout_s, steps=steps
        )
        fixed = uz.run_case(
            case, root, args=case.fix, tag=f"pfix{k}", timeout_s=timeout_s, steps=steps
        )
        for r, side in ((applied, row.plan_ms), (fixed, row.fix_ms)):
            if r.error or r.step_ms is None:
                row.error = r.error or f"{r.run_dir}: no step time"
            else:
                side.append(r.step_ms)
    return row


def markdown(rows: list[PlanRow]) -> str:
    """The table and its tally."""
    lines = [
        "| case | zoo fix | best plan | predicted ms | plan applied ms | fix ms | "
        "at least as fast |",
        "|---|---|---|---|---|---|---|",
    ]

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.1f}" if xs else "-"

    for r in rows:
        pred = "-" if r.predicted_ms is None else f"{r.predicted_ms:.1f}"
        verdict = r.verdict() + (f" ({r.error})" if r.error else "")
        lines.append(
            f"| `{r.case}` | `{r.fix}` | `{r.plan}` | {pred} | {med(r.plan_ms)} "
            f"| {med(r.fix_ms)} | {verdict} |"
        )
    judged = [r for r in rows if r.verdict() != "-"]
    ok = sum(r.verdict() in ("yes", "noise") for r in judged)
    lines += ["", f"At least as fast (or inside the spread): {ok} of {len(judged)}."]
    return "\n".join(lines)


def main() -> int:
    """Run the check; write the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", default=[], help="case name substring (repeatable)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each side")
    p.add_argument("--workdir", type=Path, required=True, help="run directories (reused)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per zdiag run")
    p.add_argument("--steps", type=int, default=None,
                   help="the scripts' --steps (default: theirs, 6); a --workdir of "
                   "user_zoo.py --fix-verify --steps N reuses its variant runs")  # fmt: skip
    p.add_argument("-o", "--output", type=Path, default=None, help="markdown file (else stdout)")
    args = p.parse_args()
    cases = [
        c
        for c in uz.CASES
        if c.group == "core"
        and c.expected & PLANNED
        and c.info.framework in ("fsdp2", "fsdp1")
        and (not args.only or any(s in c.name for s in args.only))
    ]
    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = []
    for case in cases:
        row = verify(case, args.workdir, args.repeats, args.timeout_s, args.steps)
        print(f"{row.case}: {row.plan} -> {row.verdict()}", file=sys.stderr, flush=True)
        rows.append(row)
    head = (
        f"Command: `bench/plan_verify.py {' '.join(sys.argv[1:])}` ({stamp}, "
        f"{time.perf_counter() - started:.0f} s). Machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}.\n\n"
    )
    text = head + markdown(rows) + "\n"
    if args.output:
        args.output.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
