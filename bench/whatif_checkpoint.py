"""The checkpointing what-if against re-runs: `zdiag whatif --checkpoint BLOCKS` on the user zoo's
runs without checkpointing, against the same scripts run with it (issue 27).

It reads run directories a `bench/user_zoo.py --fix-verify --workdir DIR` left behind: for each
case, `DIR/<script>__act-oom__bad<k>` (no checkpointing, no budget) and `..__fix<k>` (the zoo's
fix: checkpointing on, under the budget, which only adds a check). Per case:

- predicted: the median over the bad runs of `zdiag whatif RUN --checkpoint BLOCKS --json`'s
  job change (predicted minus measured step, on the traced steps);
- measured: the median fix step less the median bad step, from the scripts' own summary lines
  (the slowest rank's median step per run, as the zoo reads them).

    python bench/whatif_checkpoint.py --workdir /tmp/fv2 [-o out.md]
        [--case tabular_fsdp2=encoder.stages ...]

The default cases are the FSDP2 scripts of the zoo with an activation-checkpointing fix, with the
module holding their repeated blocks.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from user_zoo import parse_summaries  # noqa: E402

CASES = {
    "tabular_fsdp2": "encoder.stages",
    "seq2seq_fsdp2": "encoder.towers,decoder.towers",
    "moe_fsdp2": "body.mixers",
    "recsys_fsdp2": "interaction.towers",
}


def whatif_json(run_dir: Path, *change: str) -> dict[str, Any] | None:
    """`zdiag whatif RUN *change --json` (`zdiag.whatif/1`; None: refused, said on stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "zdiag", "whatif", str(run_dir), *change, "--json", "--no-cache"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        print(f"{run_dir}: {proc.stderr.strip()}", file=sys.stderr)
        return None
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def job_change_ms(data: dict[str, Any]) -> float:
    """A what-if's job change: the median over ranks of predicted minus measured step."""
    return statistics.median(r["predicted_ms"] - r["measured_ms"] for r in data["ranks"])


def predicted_change_ms(run_dir: Path, *change: str) -> float | None:
    """The job's predicted minus measured step for `zdiag whatif RUN *change` (None: refused)."""
    data = whatif_json(run_dir, *change)
    return None if data is None else job_change_ms(data)


def compared(
    preds: Sequence[float], base: Sequence[float], other: Sequence[float]
) -> tuple[float, float, float]:
    """(median prediction, measured change: other's median less base's, run-to-run spread: the
    larger of the two sides' max - min)."""
    meas = statistics.median(other) - statistics.median(base)
    spread = max(max(base) - min(base), max(other) - min(other))
    return statistics.median(preds), meas, spread


def verdict(pred: float, meas: float, spread: float) -> str:
    """A prediction against a measured change: "yes" (same sign, within 2x), "no", or, with
    both inside the run-to-run spread, "noise" (and whether the signs differ)."""
    if abs(meas) <= spread and abs(pred) <= spread:
        return "noise" if pred * meas >= 0 else "noise, sign differs"
    return "yes" if pred * meas > 0 and 0.5 <= pred / meas <= 2.0 else "no"


def write_table(title: str, header: list[str], rows: list[str], output: Path | None) -> None:
    """The command line, the machine and a markdown table, to `output` (else stdout)."""
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Command: `{title} {' '.join(sys.argv[1:])}` ({started}; "
        f"{platform.machine()}, Python {platform.python_version()}).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *rows,
    ]
    text = "\n".join(lines) + "\n"
    if output:
        output.write_text(text)
    else:
        print(text, end="")


def script_step_ms(run_dir: Path) -> float | None:
    """The slowest rank's median step the script printed."""
    log = run_dir / "zoo-run.log"
    return parse_summaries(log.read_text())[0] if log.is_file() else None


def row(workdir: Path, script: str, blocks: str) -> str:
    """One markdown row."""
    bad = sorted(workdir.glob(f"{script}__act-oom__bad*"))
    fix = sorted(workdir.glob(f"{script}__act-oom__fix*"))
    preds = [p for d in bad if (p := predicted_change_ms(d, "--checkpoint", blocks)) is not None]
    b = [s for d in bad if (s := script_step_ms(d)) is not None]
    f = [s for d in fix if (s := script_step_ms(d)) is not None]
    if not preds or not b or not f:
        return f"| `{script}` | `{blocks}` | - | - | - | no runs |"
    pred, meas, spread = compared(preds, b, f)
    within = "yes" if pred * meas > 0 and 0.5 <= pred / meas <= 2.0 else "no"
    if abs(meas) <= spread:
        within = "noise"
    return (
        f"| `{script}` | `{blocks}` | {pred:+.1f} | {meas:+.1f} | {spread:.1f} | {within} "
        f"| {len(bad)} / {len(fix)} |"
    )


def main() -> int:
    """Write the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, required=True, help="a --fix-verify --workdir")
    p.add_argument("--case", action="append", default=[], metavar="SCRIPT=BLOCKS",
                   help="a zoo script and the module holding its blocks (repeatable)")  # fmt: skip
    p.add_argument("-o", "--output", type=Path, help="markdown file (else stdout)")
    args = p.parse_args()
    cases = dict(c.split("=", 1) for c in args.case) if args.case else CASES
    write_table(
        "bench/whatif_checkpoint.py",
        ["script", "--checkpoint", "predicted ms/step", "measured ms/step", "spread ms",
         "within 2x", "runs (bad / fix)"],
        [row(args.workdir, s, b) for s, b in cases.items()],
        args.output,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
