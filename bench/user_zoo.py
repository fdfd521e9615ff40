"""Score zdiag's detectors on the user zoo: training scripts that are not the harness.

Every case is one script of `examples/user_zoo/` with one set of flags, run with zdiag's default
options (`zdiag run --nproc-per-node 2 --out DIR script.py ARGS`, then
`zdiag analyze DIR --json -o DIR/report.json`), one at a time. `CASES` is the ground truth: the
finding ids each case must raise (none for a healthy run). Per detector, a true positive is its
finding on a case that expects it, a false positive its finding on any other case, a false
negative its silence on a case that expects it. Per case the table also gives the other findings,
the predicted gain, the step time (median of the step log after the first 2 steps, slowest rank)
and the peak memory the script reports (`summary: ... peak_mem_mib=`: on CPU the scripts' own
count of parameter state + gathered FSDP2 parameters + saved activations; on CUDA
`torch.cuda.max_memory_allocated`).

    .venv/bin/python bench/user_zoo.py -o /tmp/zoo.md                  # every core case
    .venv/bin/python bench/user_zoo.py --only cnn_fsdp2 --only tabular  # substring filters
    .venv/bin/python bench/user_zoo.py --faults                         # + crash/hang cases
    .venv/bin/python bench/user_zoo.py --fix-verify --repeats 3 --only cnn_fsdp2:whole
        # variant vs its fix, interleaved, medians: predicted vs measured gain
    .venv/bin/python bench/user_zoo.py --fix-verify --repeats 3 --steps 20
        # each run's median over 18 steps, not 4: a smaller run-to-run spread

DeepSpeed cases need a Python with deepspeed (`--ds-python /work/venv-ds/bin/python`, run with
PYTHONPATH set to this checkout and DS_ACCELERATOR=cpu on CPU); without one they are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from zdiag.analyzers.misconfigs import MISCONFIGS

REPO = Path(__file__).resolve().parent.parent
ZOO = REPO / "examples" / "user_zoo"

# Finding ids scored per detector: the misconfigurations (defined once, in
# zdiag.analyzers.misconfigs), stragglers and `host-sync` (per-block `.item()` in the user's own
# code; scored all the same when no detector of that id exists, so its recall is then 0).
SCORED = (*MISCONFIGS, "straggler", "host-sync")
FAULT_IDS = ("crash", "hang")


@dataclass(frozen=True)
class Script:
    """One zoo script: its framework, architecture and what a wrap recommendation must name."""

    name: str
    framework: str  # fsdp2, fsdp1, ddp, deepspeed
    arch: str
    unit_hints: tuple[str, ...] = ()  # a right wrap recommendation names one of these


SCRIPTS: dict[str, Script] = {
    s.name: s
    for s in (
        Script("cnn_fsdp2", "fsdp2", "cnn", ("backbone.stages", "ConvUnit")),
        Script("cnn_fsdp1", "fsdp1", "cnn", ("ConvUnit",)),
        Script("cnn_ddp", "ddp", "cnn"),
        Script("tabular_fsdp2", "fsdp2", "tabular-resnet", ("encoder.stages", "ResidualMLP")),
        Script("tabular_fsdp1", "fsdp1", "tabular-resnet", ("ResidualMLP",)),
        Script("tabular_deepspeed", "deepspeed", "tabular-resnet"),
        Script("trunk_fsdp2", "fsdp2", "mlp-trunk", ("trunk.cells", "GatedCell")),
        Script("trunk_ddp", "ddp", "mlp-trunk"),
        Script(
            "seq2seq_fsdp2",
            "fsdp2",
            "encoder-decoder",
            ("encoder.towers", "decoder.towers", "EncoderTower", "DecoderTower"),
        ),
        Script("seq2seq_fsdp1", "fsdp1", "encoder-decoder", ("EncoderTower", "DecoderTower")),
        Script("seq2seq_deepspeed", "deepspeed", "encoder-decoder"),
        Script("moe_fsdp2", "fsdp2", "mixture-of-experts", ("body.mixers", "MoEMixer")),
        Script("moe_ddp", "ddp", "mixture-of-experts"),
        Script("recsys_fsdp2", "fsdp2", "embedding-recsys", ("interaction.towers", "CrossUnit")),
        Script("recsys_fsdp1", "fsdp1", "embedding-recsys", ("CrossUnit",)),
    )
}


@dataclass(frozen=True)
class Case:
    """One (script, variant): flags, expected finding ids, and the flags of its fix."""

    script: str
    variant: str
    args: tuple[str, ...] = ()
    expected: frozenset[str] = frozenset()  # empty: healthy, no scored finding may fire
    fix: tuple[str, ...] | None = None  # flags of the fixed run (None: nothing to verify)
    group: str = "core"  # "core": scored by default; "fault": crash/hang, with --faults

    @property
    def name(self) -> str:
        """`script:variant`."""
        return f"{self.script}:{self.variant}"

    @property
    def info(self) -> Script:
        """The script's framework and architecture."""
        return SCRIPTS[self.script]


def _cases() -> list[Case]:
    """The ground truth. Healthy = the script's defaults; each fix is expressible as flags."""
    out: list[Case] = []

    def add(script: str, variant: str, args: Sequence[str], expected: Iterable[str] = (),
            fix: Sequence[str] | None = (), group: str = "core") -> None:  # fmt: skip
        out.append(
            Case(
                script,
                variant,
                tuple(args),
                frozenset(expected),
                None if fix is None or not expected else tuple(fix),
                group,
            )
        )

    slow = ("--slow-rank", "1", "--slow-ms", "300")
    # FSDP2's prefetch fix on CPU/gloo, as missing-overlap recommends it there: the script's
    # explicit prefetch lists (its defaults) and the unshard async op (without it nothing overlaps)
    async_fix = ("--unshard-async",)
    # host syncs' fix: the finding's code, the checks kept on the device and read once at the end
    on_device = ("--checks-on-device",)
    crash = ("--crash-at-step", "3", "--crash-rank", "1")
    hang = ("--hang-rank", "1", "--hang-at-step", "3", "--pg-timeout-s", "20")
    # oom: a batch whose saved activations exceed the emulated budget; fix: checkpointing
    # (budgets sit between the peaks measured with and without checkpointing: docs/user-zoo.md)

    s = "cnn_fsdp2"
    add(s, "healthy", [])
    add(s, "whole-wrap", ["--wrap", "whole"], ["whole-model-wrap"])
    add(s, "leaf-wrap", ["--wrap", "leaf"], ["tiny-layer-wrap"])
    add(s, "prefetch-off", ["--prefetch", "off"], ["missing-overlap"], async_fix)
    add(s, "host-sync", ["--nan-check"], ["host-sync"], ["--nan-check", *on_device])
    add(s, "slow-rank", slow, ["straggler"])
    add(s, "crash", crash, ["crash"], None, "fault")
    add(s, "hang", hang, ["hang"], None, "fault")

    s = "cnn_fsdp1"
    add(s, "healthy", [])
    add(s, "whole-wrap", ["--policy", "none"], ["whole-model-wrap"])
    add(s, "leaf-wrap", ["--policy", "leaf"], ["tiny-layer-wrap"])
    add(s, "prefetch-off", ["--no-backward-prefetch", "--no-forward-prefetch"], ["missing-overlap"])
    oom = ["--batch", "48", "--mem-budget-mib", "30"]
    add(s, "act-oom", oom, ["activation-oom"], [*oom, "--act-ckpt"])
    add(s, "slow-rank", slow, ["straggler"])

    s = "cnn_ddp"
    add(s, "healthy", [])
    add(s, "host-sync", ["--nan-check"], ["host-sync"], ["--nan-check", *on_device])
    add(s, "slow-rank", ("--slow-rank", "0", "--slow-ms", "300"), ["straggler"])
    add(s, "crash", crash, ["crash"], None, "fault")
    add(s, "hang", hang, ["hang"], None, "fault")

    s = "tabular_fsdp2"
    add(s, "healthy", [])
    add(s, "whole-wrap", ["--wrap", "whole"], ["whole-model-wrap"])
    add(s, "leaf-wrap", ["--wrap", "leaf"], ["tiny-layer-wrap"])
    add(s, "prefetch-off", ["--prefetch", "off"], ["missing-overlap"], async_fix)
    add(s, "host-sync", ["--finite-checks"], ["host-sync"], ["--finite-checks", *on_device])
    oom = ["--batch", "1024", "--mem-budget-mib", "48"]
    add(s, "act-oom", oom, ["activation-oom"], [*oom, "--ac"])
    add(s, "slow-rank", slow, ["straggler"])

    s = "tabular_fsdp1"
    add(s, "healthy", [])
    add(s, "whole-wrap", ["--wrap-policy", "size"], ["whole-model-wrap"])
    add(s, "leaf-wrap", ["--wrap-policy", "linear"], ["tiny-layer-wrap"])
    add(s, "prefetch-off", ["--backward-prefetch", "none", "--no-forward-prefetch"],
        ["missing-overlap"])  # fmt: skip
    add(s, "host-sync", ["--nan-check"], ["host-sync"], ["--nan-check", *on_device])

    s = "tabular_deepspeed"
    add(s, "healthy", [])
    add(s, "prefetch-off", ["--prefetch-bucket", "0", "--no-overlap-comm"], ["missing-overlap"])
    add(s, "host-sync", ["--nan-check"], ["host-sync"], ["--nan-check", *on_device])
    oom = ["--batch", "1024", "--mem-budget-mib", "60"]
    add(s, "act-oom", oom, ["activation-oom"], [*oom, "--activation-checkpointing"])
    add(s, "slow-rank", slow, ["straggler"])

    s = "trunk_fsdp2"
    add(s, "healthy", [])
    add(s, "whole-wrap", ["--shard-granularity", "model"], ["whole-model-wrap"])
    add(s, "leaf-wrap", ["--shard-granularity", "linear"], ["tiny-layer-wrap"])
    add(s, "prefetch-off", ["--no-prefetch"], ["missing-overlap"], async_fix)
    add(s, "host-sync", ["--sanity-checks"], ["host-sync"], ["--sanity-checks", *on_device])

    s = "trunk_ddp"
    add(s, "healthy", [])
    add(s, "host-sync", ["--sanity-checks"], ["host-sync"], ["--sanity-checks", *on_device])
    oom = ["--batch", "1024", "--mem-budget-mib", "90"]
    add(s, "act-oom", oom, ["activation-oom"], [*oom, "--checkpoint-cells"])
    add(s, "slow-rank", slow, ["straggler"])

    s = "seq2seq_fsdp2"
    add(s, "healthy", [])
    add(s, "whole-wrap", ["--fsdp-wrap", "root"], ["whole-model-wrap"])
    add(s, "leaf-wrap", ["--fsdp-wrap", "leaf"], ["tiny-layer-wrap"])
    add(s, "prefetch-off", ["--prefetch", "off"], ["missing-overlap"], async_fix)
    oom = ["--batch", "32", "--seq", "64", "--mem-budget-mib", "75"]
    add(s, "act-oom", oom, ["activation-oom"], [*oom, "--checkpoint"])
    add(s, "slow-rank", slow, ["straggler"])

    s = "seq2seq_fsdp1"
    add(s, "healthy", [])
    add(s, "whole-wrap", ["--auto-wrap", "off"], ["whole-model-wrap"])
    add(s, "leaf-wrap", ["--auto-wrap", "linear"], ["tiny-layer-wrap"])
    add(s, "prefetch-off", ["--backward-prefetch", "NONE", "--no-forward-prefetch"],
        ["missing-overlap"])  # fmt: skip
    add(s, "host-sync", ["--nan-check"], ["host-sync"], ["--nan-check", *on_device])

    s = "seq2seq_deepspeed"
    add(s, "healthy", [])
    add(s, "prefetch-off", ["--no-prefetch"], ["missing-overlap"])
    add(s, "host-sync", ["--nan-check"], ["host-sync"], ["--nan-check", *on_device])
    add(s, "slow-rank", slow, ["straggler"])

    s = "moe_fsdp2"
    add(s, "healthy", [])
    add(s, "whole-wrap", ["--granularity", "none"], ["whole-model-wrap"])
    add(s, "leaf-wrap", ["--granularity", "linear"], ["tiny-layer-wrap"])
    add(s, "prefetch-off", ["--prefetch", "off"], ["missing-overlap"], async_fix)
    add(s, "host-sync", ["--log-balance"], ["host-sync"], ["--log-balance", *on_device])
    oom = ["--batch", "16", "--seq", "64", "--mem-budget-mib", "40"]
    add(s, "act-oom", oom, ["activation-oom"], [*oom, "--ckpt"])

    s = "moe_ddp"
    add(s, "healthy", [])
    add(s, "host-sync", ["--log-balance"], ["host-sync"], ["--log-balance", *on_device])
    add(s, "slow-rank", slow, ["straggler"])
    add(s, "crash", ("--crash-at-step", "2", "--crash-rank", "0"), ["crash"], None, "fault")

    s = "recsys_fsdp2"
    add(s, "healthy", [])
    # the fix is the recommendation: the towers as units, the tables left in the root (the
    # script's defaults wrap the tables too, which the recommendation does not propose yet)
    add(s, "whole-wrap", ["--units", "root"], ["whole-model-wrap"], ["--units", "towers-only"])
    add(s, "leaf-wrap", ["--units", "leaf"], ["tiny-layer-wrap"])
    add(s, "prefetch-off", ["--prefetch", "off"], ["missing-overlap"], async_fix)
    add(s, "host-sync", ["--validate"], ["host-sync"], ["--validate", *on_device])
    oom = ["--batch", "2048", "--mem-budget-mib", "58"]
    add(s, "act-oom", oom, ["activation-oom"], [*oom, "--ac"])

    s = "recsys_fsdp1"
    add(s, "healthy", [])
    add(s, "whole-wrap", ["--wrap", "whole"], ["whole-model-wrap"], ["--wrap", "cross-only"])
    add(s, "leaf-wrap", ["--wrap", "every-linear"], ["tiny-layer-wrap"])
    add(s, "prefetch-off", ["--backward-prefetch", "none"], ["missing-overlap"])
    add(s, "slow-rank", slow, ["straggler"])
    return out


CASES: list[Case] = _cases()


# ---- running one case -------------------------------------------------------------------------
@dataclass
class Finding:
    """What the benchmark keeps of one finding."""

    id: str
    severity: str
    gain_ms: float | None
    gain_bytes: int | None
    code: str


@dataclass
class CaseResult:
    """One run of one case and what zdiag said about it."""

    case: Case
    args: tuple[str, ...]
    exit_code: int | None = None
    seconds: float = 0.0
    step_ms: float | None = None
    cpu_share: float | None = None  # the process's CPU time per step over the step (step log)
    peak_mib: float | None = None
    findings: list[Finding] = field(default_factory=list)
    error: str = ""  # the run or the analysis failed in a way the case does not expect
    skipped: str = ""
    run_dir: str = ""

    @property
    def fired(self) -> set[str]:
        """Finding ids raised (any severity)."""
        return {f.id for f in self.findings}

    def finding(self, fid: str) -> Finding | None:
        """The first finding with id `fid`."""
        return next((f for f in self.findings if f.id == fid), None)


_SUMMARY = re.compile(r"summary: rank=(\d+) median_step_ms=([\d.]+) peak_mem_mib=([\d.]+)")


def parse_summaries(text: str) -> tuple[float | None, float | None]:
    """(slowest rank's median step ms, largest peak MiB) from the scripts' summary lines."""
    steps, peaks = [], []
    for m in _SUMMARY.finditer(text):
        steps.append(float(m.group(2)))
        peaks.append(float(m.group(3)))
    return (max(steps) if steps else None, max(peaks) if peaks else None)


def step_log_ms(run_dir: Path, skip: int = 2) -> tuple[float | None, float | None]:
    """Median step duration after `skip` steps, taken on the slowest rank (zdiag's step logs),
    and that rank's median CPU time per step over its median step (None: not logged)."""
    medians: list[tuple[float, float | None]] = []
    for path in sorted((run_dir / "steps").glob("rank-*.jsonl")):
        durations, cpu = [], []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("step", 0) >= skip and rec.get("duration_ms") is not None:
                durations.append(float(rec["duration_ms"]))
                if rec.get("cpu_ms") is not None:
                    cpu.append(float(rec["cpu_ms"]))
        if durations:
            step = statistics.median(durations)
            medians.append((step, statistics.median(cpu) / step if cpu and step else None))
    return max(medians, key=lambda m: m[0]) if medians else (None, None)


def zdiag_command(python: str, out: Path, case_script: str, args: Sequence[str]) -> list[str]:
    """`zdiag run` with default options for one zoo script."""
    script = ZOO / f"{case_script}.py"
    return [python, "-m", "zdiag", "run", "--nproc-per-node", "2", "--out", str(out),
            str(script), *args]  # fmt: skip


def run_case(
    case: Case,
    root: Path,
    *,
    args: Sequence[str] | None = None,
    tag: str = "",
    ds_python: str | None = None,
    timeout_s: float = 300.0,
    reanalyze: bool = False,
    steps: int | None = None,
) -> CaseResult:
    """Run `case` (or the same script with `args`) under `zdiag run`, then `zdiag analyze`.
    With `reanalyze`, a run directory already in `root` is analyzed again (no summary or cache
    reused: the analysis is today's code) instead of running the script. `steps` sets the
    script's `--steps` (else its default, 6)."""
    run_args = tuple(case.args if args is None else args)
    if steps is not None:
        run_args += ("--steps", str(steps))
    result = CaseResult(case, run_args)
    python = sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if case.info.framework == "deepspeed":
        if not ds_python:
            result.skipped = "no --ds-python with deepspeed"
            return result
        python = ds_python
        env["DS_ACCELERATOR"] = env.get("DS_ACCELERATOR", "cpu")
    out = root / (case.name.replace(":", "__") + (f"__{tag}" if tag else ""))
    result.run_dir = str(out)
    start = time.perf_counter()
    if reanalyze and (out / "manifest.json").is_file():
        result.exit_code, result.peak_mib = recorded_exit_and_peak(out)
    else:
        _run_script(result, python, out, case.script, run_args, env, timeout_s)
    logged, result.cpu_share = step_log_ms(out) if out.exists() else (None, None)
    if logged is not None:
        result.step_ms = logged
    expects_failure = bool(case.expected & {"activation-oom", "crash", "hang"}) and args is None
    if result.exit_code not in (0, None) and not expects_failure:
        result.error = f"zdiag run exited {result.exit_code}"
    report = out / "report.json"
    no_cache = ["--no-cache"] if reanalyze else []
    if reanalyze:
        report.unlink(missing_ok=True)  # the earlier analysis's, inside the input directory
    analyze = subprocess.run(
        [sys.executable, "-m", "zdiag", "analyze", str(out), "--json", *no_cache, "-o",
         str(report)],
        capture_output=True, text=True, timeout=timeout_s,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    if analyze.returncode != 0 or not report.exists():
        msg = (analyze.stderr.strip().splitlines() or ["no output"])[-1]
        result.error = (result.error + "; " if result.error else "") + f"analyze: {msg}"
    else:
        data = json.loads(report.read_text())
        result.findings = [
            Finding(
                f["id"],
                f.get("severity", ""),
                f.get("expected_gain_ms"),
                f.get("expected_gain_bytes"),
                f.get("code") or "",
            )
            for f in data.get("findings", [])
        ]
    result.seconds = time.perf_counter() - start
    return result


def _run_script(
    result: CaseResult,
    python: str,
    out: Path,
    script: str,
    run_args: Sequence[str],
    env: dict[str, str],
    timeout_s: float,
) -> None:
    """`zdiag run` the script into `out`; exit code, step time and peak memory into `result`."""
    if out.exists():
        shutil.rmtree(out)  # a run directory left by an earlier session would refuse `--out`
    # own session, so that a timeout ends torchrun and every rank, not only `zdiag run`
    proc = subprocess.Popen(
        zdiag_command(python, out, script, run_args),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        text, _ = proc.communicate(timeout=timeout_s)
        result.exit_code = proc.returncode
        result.step_ms, result.peak_mib = parse_summaries(text)
        if out.is_dir():
            (out / "zoo-run.log").write_text(text)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _kill_ranks_of(out)  # torchrun starts each rank in a session of its own
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # a process the scan missed still holds the pipe: stop reading it
        result.exit_code = None
        result.error = f"zdiag run timed out after {timeout_s:.0f} s (killed)"


def _kill_ranks_of(out: Path, tries: int = 5) -> int:
    """SIGKILL every process whose environment names `out` as its zdiag run directory (Linux);
    scans again (up to `tries` times, 0.2 s apart) until one is found. Returns how many."""
    needle = f"ZDIAG_RUN_DIR={out}".encode() + b"\0"
    killed = 0
    for attempt in range(tries):
        for proc_dir in Path("/proc").glob("[0-9]*"):
            try:
                if needle in (proc_dir / "environ").read_bytes():
                    os.kill(int(proc_dir.name), signal.SIGKILL)
                    killed += 1
            except (OSError, ValueError):
                continue  # gone, or not ours to read
        if killed:
            break
        if attempt + 1 < tries:
            time.sleep(0.2)
    return killed


def recorded_exit_and_peak(out: Path) -> tuple[int | None, float | None]:
    """The exit code in a run directory's manifest and the peak memory its scripts printed (the
    `zoo-run.log` a first run kept), for --reanalyze."""
    try:
        code = json.loads((out / "manifest.json").read_text()).get("exit", {}).get("code")
    except (OSError, ValueError, AttributeError):
        code = None
    log = out / "zoo-run.log"
    peak = parse_summaries(log.read_text())[1] if log.is_file() else None
    return (code if isinstance(code, int) else None), peak


# ---- scoring ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Score:
    """Counts and ratios for one detector (None: undefined, nothing to divide by)."""

    tp: int
    fp: int
    fn: int

    @property
    def precision(self) -> float | None:
        """tp / (tp + fp)."""
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else None

    @property
    def recall(self) -> float | None:
        """tp / (tp + fn)."""
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else None


def score(
    outcomes: Iterable[tuple[frozenset[str], set[str]]], detectors: Sequence[str]
) -> dict[str, Score]:
    """Per detector, from (expected ids, fired ids) pairs, one per case."""
    pairs = list(outcomes)
    out = {}
    for det in detectors:
        tp = sum(1 for exp, fired in pairs if det in exp and det in fired)
        fp = sum(1 for exp, fired in pairs if det not in exp and det in fired)
        fn = sum(1 for exp, fired in pairs if det in exp and det not in fired)
        out[det] = Score(tp, fp, fn)
    return out


def recommendation_ok(result: CaseResult, fid: str) -> bool | None:
    """Whether a wrap finding's code names the user's repeated block in the run's framework.

    None when it does not apply (not a wrap finding, or the finding is absent).
    """
    if fid not in ("whole-model-wrap", "tiny-layer-wrap"):
        return None
    found = result.finding(fid)
    if found is None:
        return None
    info = result.case.info
    code = found.code
    names_block = any(h in code for h in info.unit_hints)
    if info.framework == "fsdp1":
        right_api = "fully_shard(" not in code and ("WrapPolicy" in code or "wrap" in code)
    elif info.framework == "fsdp2":
        right_api = "fully_shard(" in code
    else:
        right_api = True
    return names_block and right_api


def outcome(result: CaseResult, detectors: Sequence[str]) -> str:
    """One word or phrase: ok, missing X, wrong finding X, wrong code X, exception, skipped."""
    if result.skipped:
        return "skipped"
    if result.error:
        return "exception: " + result.error
    fired = result.fired & set(detectors)
    parts = []
    missing = sorted(result.case.expected - fired)
    extra = sorted(fired - result.case.expected)
    if missing:
        parts.append("missing " + ", ".join(missing))
    if extra:
        parts.append("wrong finding " + ", ".join(extra))
    for fid in sorted(result.case.expected & fired):
        if recommendation_ok(result, fid) is False:
            parts.append(f"wrong code {fid}")
    return "; ".join(parts) or "ok"


# ---- reporting --------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown_results(results: list[CaseResult], detectors: Sequence[str]) -> str:
    """The per-case table and the per-detector precision/recall table."""
    lines = [
        "| case | framework | arch | expected | fired (scored) | other findings | outcome "
        "| predicted gain | exit | step ms | peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        scored = sorted(r.fired & set(detectors))
        other = sorted(r.fired - set(detectors))
        gains = []
        for fid in sorted(r.case.expected):
            f = r.finding(fid)
            if f is not None and f.gain_ms is not None:
                gains.append(f"{f.gain_ms:.1f} ms")
            if f is not None and f.gain_bytes:
                gains.append(f"{f.gain_bytes / 2**20:.1f} MiB")
        lines.append(
            f"| `{r.case.name}` | {r.case.info.framework} | {r.case.info.arch} "
            f"| {', '.join(sorted(r.case.expected)) or 'none'} | {', '.join(scored) or '-'} "
            f"| {', '.join(other) or '-'} | {outcome(r, detectors)} | {', '.join(gains) or '-'} "
            f"| {r.exit_code if r.exit_code is not None else '-'} | {_fmt(r.step_ms)} "
            f"| {_fmt(r.peak_mib)} |"
        )
    ran = [r for r in results if not r.skipped]
    scores = score(((r.case.expected, r.fired) for r in ran), detectors)
    lines += ["", "| detector | TP | FP | FN | precision | recall |", "|---|---|---|---|---|---|"]
    for det, s in scores.items():
        lines.append(
            f"| {det} | {s.tp} | {s.fp} | {s.fn} | {_fmt(s.precision, '.2f')} "
            f"| {_fmt(s.recall, '.2f')} |"
        )
    healthy = [r for r in ran if not r.case.expected]
    noisy = [r for r in healthy if r.fired]
    lines += [
        "",
        f"Cases: {len(ran)} run, {len(results) - len(ran)} skipped; "
        f"{sum(outcome(r, detectors) == 'ok' for r in ran)} fully right. Healthy runs with any "
        f"finding at all: {len(noisy)} of {len(healthy)}.",
    ]
    return "\n".join(lines)


@dataclass
class FixRow:
    """Predicted vs measured for one misconfigured case and its fix."""

    case: Case
    predicted_ms: float | None
    predicted_mib: float | None
    measured_ms: float | None
    measured_mib: float | None
    finding_raised: bool  # the variant's run raised the expected finding at all
    finding_gone: bool
    runs: int
    noise_ms: float | None = None  # run-to-run spread of one side's step time (max - min)
    cpu_share: float | None = None  # the variant's CPU time per step over its step (median)


def in_noise(pred: float | None, meas: float | None, noise: float | None) -> bool:
    """Whether a step-time prediction and its measurement are both smaller than the run-to-run
    spread: the runs can neither confirm nor refute the prediction."""
    if pred is None or meas is None or not noise:
        return False
    return abs(pred) < noise and abs(meas) < noise


def within_factor(pred: float | None, meas: float | None, factor: float = 2.0) -> bool | None:
    """Measured within [pred/factor, pred*factor], a predicted cost (pred < 0) within
    [pred*factor, pred/factor] (None when either is missing or pred == 0)."""
    if pred is None or meas is None or pred == 0:
        return None
    low, high = sorted((pred / factor, pred * factor))
    return low <= meas <= high


def fix_verify(
    case: Case,
    root: Path,
    repeats: int,
    ds_python: str | None,
    timeout_s: float,
    reanalyze: bool = False,
    steps: int | None = None,
) -> FixRow:
    """Run the variant and its fix `repeats` times each, interleaved; compare medians. The
    prediction is the median of the variant runs' predictions (the OOM variant, measured without
    its budget, gets one run with the budget for its finding)."""
    assert case.fix is not None
    # an OOM variant is measured without its budget (it would stop at the OOM)
    measure = list(case.args)
    if "--mem-budget-mib" in measure:
        i = measure.index("--mem-budget-mib")
        del measure[i : i + 2]
    bad: list[CaseResult] = []
    good: list[CaseResult] = []
    predicted: list[CaseResult] = []
    for k in range(repeats):
        if k == 0 and measure != list(case.args):
            # the OOM variant: its finding comes from the run with the budget
            predicted.append(run_case(case, root, tag="pred", ds_python=ds_python, timeout_s=timeout_s,
                                      reanalyze=reanalyze, steps=steps))  # fmt: skip
        bad.append(run_case(case, root, args=measure, tag=f"bad{k}", ds_python=ds_python,
                            timeout_s=timeout_s, reanalyze=reanalyze, steps=steps))  # fmt: skip
        good.append(run_case(case, root, args=case.fix, tag=f"fix{k}", ds_python=ds_python,
                             timeout_s=timeout_s, reanalyze=reanalyze, steps=steps))  # fmt: skip
    if not predicted:
        predicted = bad  # the same command: each run's prediction, their median below

    def med(vals: Iterable[float | None]) -> float | None:
        xs = [v for v in vals if v is not None]
        return statistics.median(xs) if xs else None

    fid = sorted(case.expected)[0]
    found = [f for r in predicted if (f := r.finding(fid)) is not None]
    pred_ms = med(f.gain_ms for f in found)
    pred_mib = med(f.gain_bytes / 2**20 if f.gain_bytes else None for f in found)
    b_ms, g_ms = med(r.step_ms for r in bad), med(r.step_ms for r in good)
    b_mb, g_mb = med(r.peak_mib for r in bad), med(r.peak_mib for r in good)
    spreads = [
        max(xs) - min(xs)
        for side in (bad, good)
        if len(xs := [r.step_ms for r in side if r.step_ms is not None]) > 1
    ]
    return FixRow(
        case,
        pred_ms,
        pred_mib,
        None if b_ms is None or g_ms is None else b_ms - g_ms,
        None if b_mb is None or g_mb is None else b_mb - g_mb,
        bool(found),
        all(fid not in r.fired for r in good),
        repeats,
        max(spreads) if spreads else None,
        med(r.cpu_share for r in bad),
    )


def markdown_fix(rows: list[FixRow]) -> str:
    """Predicted vs measured gain per case."""
    lines = [
        "| case | fix flags | predicted ms/step | measured ms/step | run-to-run spread ms "
        "| within 2x | predicted MiB | measured MiB | within 2x | finding gone after fix "
        "| variant's CPU time / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(w: bool | str | None) -> str:
        return "-" if w is None else w if isinstance(w, str) else "yes" if w else "no"

    for r in rows:
        fix_flags = f"`{' '.join(r.case.fix)}`" if r.case.fix else "(the script's defaults)"
        if not r.finding_raised:
            gone = "not raised before the fix"
        else:
            gone = "yes" if r.finding_gone else "no"
        w_ms, w_mb = _within(r)
        lines.append(
            f"| `{r.case.name}` | {fix_flags} | {_fmt(r.predicted_ms)} "
            f"| {_fmt(r.measured_ms)} | {_fmt(r.noise_ms)} | {cell(w_ms)} "
            f"| {_fmt(r.predicted_mib)} | {_fmt(r.measured_mib)} | {cell(w_mb)} | {gone} "
            f"| {'-' if r.cpu_share is None else f'{r.cpu_share:.0%}'} |"
        )
    verdicts = [w for r in rows for w in _within(r)]
    checked = [w for w in verdicts if isinstance(w, bool)]
    # a "noise" row has a nonzero prediction: its measurement agrees when of the same sign
    in_spread = [r for r in rows if _within(r)[0] == "noise"]
    same_sign = sum(
        1
        for r in in_spread
        if r.measured_ms is not None and r.predicted_ms and r.measured_ms * r.predicted_ms > 0
    )
    raised = [r for r in rows if r.finding_raised]
    zero_missed = [
        r
        for r in rows
        if r.predicted_ms == 0
        and r.measured_ms is not None
        and r.noise_ms is not None
        and abs(r.measured_ms) >= r.noise_ms
    ]
    lines += [
        "",
        f"Predictions checkable (a nonzero prediction, a gain or a cost, and a measurement, "
        f"not both inside the run-to-run spread): {len(checked)}; within 2x: {sum(checked)}. "
        f"Inside the spread (neither confirmed nor refuted): {len(in_spread)}, of which "
        f"{same_sign} agree on the sign (measured faster or slower, as predicted). A 0 ms "
        f"prediction with a "
        f"measured change beyond the spread: {len(zero_missed)}. Findings raised before the fix: "
        f"{len(raised)} of {len(rows)}; gone after it: {sum(r.finding_gone for r in raised)} of "
        f"{len(raised)}.",
    ]
    return "\n".join(lines)


def _within(r: FixRow) -> tuple[bool | str | None, bool | None]:
    """Whether the ms and the MiB predictions of a row came true within 2x (None: not checkable;
    "noise": the step-time prediction and its measurement both inside the run-to-run spread)."""
    ms: bool | str | None = within_factor(r.predicted_ms, r.measured_ms)
    if ms is not None and in_noise(r.predicted_ms, r.measured_ms, r.noise_ms):
        ms = "noise"
    return ms, within_factor(r.predicted_mib, r.measured_mib)


def select(cases: Sequence[Case], only: Sequence[str], faults: bool) -> list[Case]:
    """Cases whose name contains any `only` substring (all when empty); faults on request."""
    chosen = [c for c in cases if faults or c.group == "core"]
    if only:
        chosen = [c for c in chosen if any(o in c.name for o in only)]
    return chosen


def main() -> int:
    """Run the zoo (or its fix verification) and write markdown."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", default=[], help="case name substring (repeatable)")
    p.add_argument("--faults", action="store_true", help="include the crash/hang cases")
    p.add_argument(
        "--fix-verify", action="store_true", help="variant vs fix, predicted vs measured"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs of each side in --fix-verify")
    p.add_argument("--ds-python", default=os.environ.get("ZDIAG_DS_PYTHON"),
                   help="a Python with deepspeed installed, for the DeepSpeed cases")  # fmt: skip
    p.add_argument("--workdir", type=Path, default=None, help="keep run directories here")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per zdiag run")
    p.add_argument("--steps", type=int, default=None,
                   help="the scripts' --steps (default: theirs, 6): more steps measure each "
                   "run's median step over more of them")  # fmt: skip
    p.add_argument("--reanalyze", action="store_true",
                   help="analyze the run directories already in --workdir again (today's "
                   "analysis, no cache) instead of running the scripts (also with "
                   "--fix-verify: the measured step times and peaks stay those recorded)")  # fmt: skip
    p.add_argument("-o", "--output", type=Path, default=None, help="markdown file (else stdout)")
    args = p.parse_args()
    cases = select(CASES, args.only, args.faults)
    if not cases:
        print("no case matches --only; names look like cnn_fsdp2:whole-wrap", file=sys.stderr)
        return 2
    detectors = [*SCORED, *(FAULT_IDS if args.faults else ())]
    root = args.workdir or Path(tempfile.mkdtemp(prefix="zdiag-user-zoo-"))
    root.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.perf_counter()
    if args.fix_verify:
        rows = []
        for c in cases:
            if c.fix is None:
                continue
            print(f"fix-verify {c.name} ...", file=sys.stderr, flush=True)
            rows.append(
                fix_verify(
                    c,
                    root,
                    args.repeats,
                    args.ds_python,
                    args.timeout_s,
                    args.reanalyze,
                    args.steps,
                )
            )
        body = markdown_fix(rows)
    else:
        results = []
        for c in cases:
            r = run_case(c, root, ds_python=args.ds_python, timeout_s=args.timeout_s,
                         reanalyze=args.reanalyze, steps=args.steps)  # fmt: skip
            print(f"{c.name}: {outcome(r, detectors)} ({r.seconds:.1f} s)", file=sys.stderr,
                  flush=True)  # fmt: skip
            results.append(r)
        body = markdown_results(results, detectors)
    header = (
        f"Command: `{' '.join(['bench/user_zoo.py', *sys.argv[1:]])}` ({started}, "
        f"{time.perf_counter() - t0:.0f} s). Machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}.\n\n"
    )
    text = header + body + "\n"
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
