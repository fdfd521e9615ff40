"""The checks only a GPU can show (issues 3 and 5), as one command for a lent CUDA machine.

Each check runs the harness under `zdiag run` on every visible GPU (one process per GPU, NCCL),
analyzes the run and writes what it saw: OUT/summary.md (a table, pass / FAIL / skip per check
with its figures), OUT/log.txt (every command's output) and OUT/gpu_runs.tgz (the run
directories, for `sample_traces/gpu/`).

    python3 bench/gpu_checks.py --out OUT                      # on a CUDA machine, ~5 min
    python3 bench/gpu_checks.py --out OUT --device cpu         # the same flow on CPU (gloo, 2
                                                               # ranks): tests this script

Checks:
1. healthy harness: exit 0, NCCL, a trace per rank with kernels and collectives, FSDP units
   with gathered bytes, allocator memory in the step log, no misconfiguration finding.
2. the zoo: whole-model-wrap, tiny-layer-wrap, missing-overlap each raise their own finding.
3. a real out-of-memory from activations: the peak of the same shape with and without
   activation checkpointing is measured first, the allocator is capped between the two
   (`--memory-budget-gb`, `torch.cuda.set_per_process_memory_fraction`), so only the run without
   checkpointing fails: non-zero exit, OOM in the manifest, a snapshot with stacks, and the
   `activation-oom` finding with its predicted saving next to the measured one.
4. NVTX: the `zdiag step N` ranges seen by Nsight Systems (`nsys`), else Nsight Compute
   (`ncu --nvtx` with an include filter: kernels profiled only inside the range).
5. snapshot sites: a user's own snapshot recorded with C++ frames (`stacks="all"`) names Python
   lines, autograd nodes or aten ops as allocation sites, never the allocator's C++ frames.
6. diff: `zdiag diff` on device runs: one configuration run twice is "no change"; a whole-model
   wrap against the healthy wrap is named on the first line; dropping activation checkpointing
   trips `--fail-on-memory` (and adding it does not); a CPU run against a GPU run is refused.
7. what-if: `zdiag whatif --checkpoint layers` on the healthy run against the run with `--ac
   block`, `--prefetch 1` on a run without prefetch against the run with it, and `--wrap layers`
   on a whole-model wrap (the finer wrap: the root split per block) against the per-block run
   (both NCCL only), each predicted gain within 2x of the re-run's (or both inside 2% of the
   step).
8. measured activations: `--profile-memory` measures what each block saves for backward in the
   rank; `zdiag whatif --checkpoint layers`'s memory change against the allocator's peak of the
   `--ac block` run, and `--param-dtype bf16` against the `--precision bf16` run (NCCL only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.inputs.cuda_snapshot import read_snapshot
from zdiag.analyzers.memory.memory_snapshot import summarize_snapshot
from zdiag.analyzers.misconfigs import MISCONFIGS
from zdiag.analyzers.report import Report
from zdiag.collectors import rundir

GIB = 1024**3
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Check:
    """One row of the summary: `ok` None means skipped."""

    name: str
    ok: bool | None
    detail: str


class Runner:
    """Runs `zdiag` commands, logging their output to one file."""

    def __init__(self, out: Path, device: str) -> None:
        self.out = out
        self.device = device
        self.runs = Path(tempfile.mkdtemp(prefix="zdiag-gpu-checks-"))
        self.log = (out / "log.txt").open("a")
        self.nproc = 2 if device == "cpu" else max(1, _cuda_count())
        # FSDP2 on one rank issues no collective, and NCCL refuses two ranks on one GPU: on a
        # one-GPU machine the checks that need communication run 2 gloo ranks sharing the GPU
        self.shared_gpu = device == "cuda" and self.nproc == 1

    def zdiag(self, args: list[str], timeout: int = 300) -> subprocess.CompletedProcess[str]:
        """`python -m zdiag ARGS`, output appended to log.txt."""
        return self.command([sys.executable, "-m", "zdiag", *args], timeout)

    def command(self, cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess[str]:
        """Any command, output appended to log.txt."""
        started = time.perf_counter()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as exc:
            proc = subprocess.CompletedProcess(cmd, 124, str(exc.stdout or ""), "timed out")
        self.log.write(
            f"\n$ {' '.join(cmd)}\n(exit {proc.returncode}, {time.perf_counter() - started:.1f} s)"
            f"\n{proc.stdout[-20000:]}\n{proc.stderr[-20000:]}\n"
        )
        self.log.flush()
        return proc

    def harness(
        self,
        name: str,
        options: list[str],
        profile: str = "2:1:3",
        memory: bool = False,
        comm: bool = False,
    ) -> tuple[Path, subprocess.CompletedProcess[str]]:
        """`zdiag run` of the harness into runs/NAME (`comm`: the check needs collectives)."""
        run_dir = self.runs / name
        nproc = self.nproc
        if comm and self.shared_gpu:
            nproc, options = 2, [*options, "--backend", "gloo"]
        launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
        extra = ["--profile-memory"] if memory else []
        args = [
            "run", *launch, "--out", str(run_dir), "--profile-steps", profile, *extra,
            "--harness", "--device", self.device, *options,
        ]  # fmt: skip
        return run_dir, self.zdiag(args)


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def _fired(report: Report) -> set[str]:
    return {f.id for f in report.findings if f.id in MISCONFIGS}


def _manifest(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def shape(device: str) -> list[str]:
    """A shape whose compute is worth measuring on the device (small on CPU)."""
    if device == "cpu":
        return ["--layers", "3", "--dim", "64", "--heads", "4", "--vocab", "512", "--seq", "64"]
    return ["--layers", "8", "--dim", "1024", "--heads", "16", "--vocab", "8192", "--seq", "1024"]


def check_environment(r: Runner) -> Check:
    """GPU, driver, torch, CUDA and NCCL versions."""
    proc = r.command(
        [
            sys.executable,
            "-c",
            "import torch, platform; c = torch.cuda.is_available(); "
            "print(platform.node(), 'torch', torch.__version__, 'cuda', torch.version.cuda, "
            "'nccl', torch.cuda.nccl.version() if c else None, "
            "[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])",
        ]
    )
    return Check("environment", proc.returncode == 0, proc.stdout.strip() or proc.stderr[-300:])


def check_healthy(r: Runner) -> Check:
    """The default harness: NCCL, kernels, units, allocator memory, no misconfiguration."""
    run_dir, proc = r.harness("healthy", [*shape(r.device), "--steps", "8"], comm=True)
    if proc.returncode != 0:
        return Check("healthy harness", False, f"exit {proc.returncode}: {proc.stderr[-300:]}")
    report = analyze_paths([run_dir])
    m = _manifest(run_dir)
    steps = [s for rank in report.ranks for s in rank.steps]
    comm = sum(s.comm_ms for s in steps)
    overlapped = sum(s.overlapped_ms for s in steps)
    kernels = sum(s.kernel_count for s in steps)
    gathered = sum(u.all_gather_bytes for u in report.fsdp_units)
    step_log = run_dir / rundir.step_log_relpath(0)
    lines = step_log.read_text().splitlines() if step_log.is_file() else []
    peak = json.loads(lines[-1]).get("mem_peak_bytes") if lines else None
    want_backend = "gloo" if r.device == "cpu" or r.shared_gpu else "nccl"
    problems = [
        p
        for p, bad in (
            (f"backend {m.get('backend')}", m.get("backend") != want_backend),
            ("no steps", not steps),
            ("no kernels", r.device != "cpu" and kernels == 0),
            ("no communication", comm <= 0),
            ("no FSDP gather bytes", gathered <= 0),
            ("no allocator peak in the step log", r.device != "cpu" and not peak),
            (f"findings {sorted(_fired(report))}", bool(_fired(report))),
        )
        if bad
    ]
    devices = sorted({rank.device for rank in report.ranks})
    detail = (
        f"{len(report.ranks)} rank(s) on {devices}, manifest device {m.get('device')}, "
        f"{len(steps)} step(s), median {sorted(s.duration_ms for s in steps)[len(steps) // 2]:.1f}"
        f" ms, {kernels} kernels, comm {comm:.1f} ms of which {overlapped:.1f} ms overlapped, "
        f"{gathered / 2**20:.1f} MiB gathered over {len(report.fsdp_units)} unit rows, "
        f"step-log peak {peak}"
        if steps
        else "no steps"
    )
    return Check("healthy harness", not problems, "; ".join([*problems, detail]))


def check_zoo(r: Runner) -> list[Check]:
    """Each misconfiguration a GPU run can show raises its own finding."""
    out = []
    for misconfig in ("whole-model-wrap", "tiny-layer-wrap", "missing-overlap"):
        if misconfig == "missing-overlap" and r.shared_gpu:
            out.append(
                Check(
                    f"zoo {misconfig}",
                    None,
                    "gloo on a shared GPU blocks the host in every collective: there is no "
                    "overlap to lose (seen on an H100, 2026-11-27: comm-bound either way)",
                )
            )
            continue
        run_dir, proc = r.harness(
            misconfig, [*shape(r.device), "--steps", "8", "--misconfig", misconfig], comm=True
        )
        if proc.returncode != 0:
            out.append(Check(f"zoo {misconfig}", False, f"exit {proc.returncode}"))
            continue
        fired = _fired(analyze_paths([run_dir]))
        out.append(Check(f"zoo {misconfig}", fired == {misconfig}, f"fired {sorted(fired)}"))
    return out


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MiB"


def _peak_bytes(run_dir: Path) -> int | None:
    peaks = []
    for log in sorted((run_dir / "steps").glob("rank-*.jsonl")):
        for line in log.read_text().splitlines():
            value = json.loads(line).get("mem_peak_bytes")
            if isinstance(value, int):
                peaks.append(value)
    return max(peaks) if peaks else None


def check_oom(r: Runner) -> Check:
    """A real OOM from activations, its snapshot, and the finding's predicted saving."""
    oom_shape = ["--layers", "8", "--dim", "512", "--heads", "8", "--vocab", "1024"]
    oom_shape += ["--seq", "2048", "--batch", "8", "--steps", "3"]
    if r.device == "cpu":  # the emulated budget: the preset's own shape and budget
        run_dir, proc = r.harness("oom", ["--misconfig", "activation-oom"], "0:0:2", memory=True)
        measured = None
    else:
        ac_dir, ac_proc = r.harness("peak-ac", [*oom_shape, "--ac", "block"], "0:0:1")
        no_dir, no_proc = r.harness("peak-no-ac", oom_shape, "0:0:1")
        ac_peak, no_peak = _peak_bytes(ac_dir), _peak_bytes(no_dir)
        if ac_proc.returncode or no_proc.returncode or not ac_peak or not no_peak:
            return Check("activation OOM", False, "could not measure the two peaks first")
        budget = (ac_peak + no_peak) / 2 / GIB
        measured = no_peak - ac_peak
        run_dir, proc = r.harness(
            "oom", [*oom_shape, "--memory-budget-gb", f"{budget:.3f}"], "0:0:2", memory=True
        )
    m = _manifest(run_dir)
    report = analyze_paths([run_dir])
    finding = next((f for f in report.findings if f.id == "activation-oom"), None)
    snap_detail = "no snapshot"
    snaps = sorted((run_dir / "memory").glob("rank-*.snapshot.pickle"))
    if snaps:
        data = read_snapshot(snaps[0])
        mem = summarize_snapshot(data)
        cats = {k: f"{v / 2**20:.0f}" for k, v in sorted(mem.category_bytes.items())}
        entries = sum(len(t) for t in data.get("device_traces") or [])
        snap_detail = (
            f"snapshot {snaps[0].stat().st_size / 2**20:.1f} MiB, {entries} trace entries, "
            f"{mem.blocks_with_frames} of {mem.blocks} live blocks with stacks, "
            f"MiB by category {cats}"
        )
    problems = [
        p
        for p, bad in (
            ("exit 0", proc.returncode == 0),
            ("manifest exit.oom false", not (m.get("exit") or {}).get("oom")),
            ("no snapshot", r.device != "cpu" and not snaps),
            (f"no activation-oom finding: {sorted(_fired(report))}", finding is None),
        )
        if bad
    ]
    predicted = finding.expected_gain_bytes if finding else None
    detail = (
        f"exit {proc.returncode}; predicted saving {_mib(predicted)}, measured peak difference "
        f"with and without checkpointing {_mib(measured)}; {snap_detail}"
    )
    return Check("activation OOM", not problems, "; ".join([*problems, detail]))


def check_nvtx(r: Runner) -> Check:
    """The step ranges as Nsight sees them (nsys, else ncu)."""
    if r.device == "cpu":
        return Check("NVTX ranges", None, "no CUDA: NVTX is off by design")
    args = ["run", "--no-profile", "--harness", "--device", "cuda", *shape("cuda"), "--steps", "5"]
    zdiag = [sys.executable, "-m", "zdiag", *args]
    if shutil.which("nsys"):
        rep = r.runs / "nsys"
        r.command(["nsys", "profile", "-t", "cuda,nvtx", "-o", str(rep), "-f", "true", *zdiag])
        stats = r.command(["nsys", "stats", "-r", "nvtx_sum", "-f", "csv", f"{rep}.nsys-rep"])
        names = [line for line in stats.stdout.splitlines() if "zdiag" in line]
        return Check("NVTX ranges (nsys)", bool(names), f"{len(names)} zdiag range rows")
    if shutil.which("ncu"):
        proc = r.command(
            ["ncu", "--nvtx", "--nvtx-include", "zdiag step 3/", "--launch-count", "3",
             "--metrics", "gpu__time_duration.sum", *zdiag],
            timeout=240,
        )  # fmt: skip
        profiled = proc.stdout.count("gpu__time_duration.sum")
        seen = "zdiag step 3" in proc.stdout
        return Check(
            "NVTX ranges (ncu)",
            profiled > 0,
            f"{profiled} kernel(s) profiled inside `zdiag step 3`; range named in output: {seen}",
        )
    return Check("NVTX ranges", None, "neither nsys nor ncu on PATH")


NATIVE_FILES = (".c", ".cpp", ".cc", ".h", ".cu")
SNAPSHOT_SCRIPT = """
import sys, torch
from torch import nn
model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
                        for _ in range(4)]).cuda()
opt = torch.optim.AdamW(model.parameters())
def step():
    loss = model(torch.randn(64, 1024, device="cuda")).square().mean()
    loss.backward(); opt.step(); opt.zero_grad()
step()
torch.cuda.memory._record_memory_history(max_entries=100000, stacks="all")
step()
torch.cuda.memory._dump_snapshot(sys.argv[1])
"""


def check_snapshot_sites(r: Runner) -> Check:
    """A user's snapshot recorded with C++ frames (`stacks="all"`): the sites are Python lines."""
    if r.device == "cpu":
        return Check("snapshot sites", None, "no CUDA: no allocator snapshot")
    path = r.out / "stacks_all.snapshot.pickle"
    proc = r.command([sys.executable, "-c", SNAPSHOT_SCRIPT, str(path)])
    if proc.returncode != 0 or not path.is_file():
        return Check("snapshot sites", False, f"exit {proc.returncode}: {proc.stderr[-300:]}")
    report = analyze_paths([path])
    sites = [s.site for b in report.memory_breakdowns for s in b.top_sites]
    # a Python line (a file, or `<string>` for `python -c`), else an autograd node or aten op
    native = [s for s in sites if s.startswith("??") or s.split(":")[0].endswith(NATIVE_FILES)]
    frames = sum(
        len(b.get("frames") or [])
        for seg in read_snapshot(path).get("segments") or []
        for b in seg.get("blocks") or []
    )
    return Check(
        "snapshot sites",
        bool(sites) and not native,
        f"{path.stat().st_size / 2**20:.1f} MiB, {frames} frames in live blocks; top sites "
        f"{sites[:4]}; native sites {native[:3]}",
    )


# Big files (a snapshot with 100k history entries) stay out of the tarball, which must come back
# from a lent machine (16 MiB per file there); summary.md has their figures.
MAX_TAR_MEMBER = 8 * 2**20


def _diff(r: Runner, a: Path, b: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return r.zdiag(["diff", str(a), str(b), *extra])


def check_diff(r: Runner) -> list[Check]:
    """`zdiag diff` on real device runs: the same configuration twice is no change (with the
    spread it measured), a whole-model wrap against the healthy wrap names it on the first
    line, activation checkpointing's memory change trips the memory gate the right way round,
    and a CPU run against this device's run is refused."""
    opts = [*shape(r.device), "--steps", "10"]
    a, pa = r.harness("diff-healthy-a", opts, "2:1:5", memory=True)
    b, pb = r.harness("diff-healthy-b", opts, "2:1:5", memory=True)
    ac, pac = r.harness("diff-ac-block", [*opts, "--ac", "block"], "2:1:5", memory=True)
    hg, phg = r.harness("diff-healthy-gloo", opts, "2:1:5", comm=True)
    wg, pwg = r.harness(
        "diff-whole-gloo", [*opts, "--misconfig", "whole-model-wrap"], "2:1:5", comm=True
    )
    if any(p.returncode for p in (pa, pb, pac, phg, pwg)):
        return [Check("diff", False, "a harness run failed (see log.txt)")]
    out = []
    same = _diff(r, a, b)
    first = same.stdout.splitlines()[0] if same.stdout else same.stderr[-200:]
    out.append(
        Check(
            "diff: same config twice", same.returncode == 0 and first.startswith("no change"), first
        )
    )
    whole = _diff(r, hg, wg, "--fail-on-regression", "5")
    first = whole.stdout.splitlines()[0] if whole.stdout else whole.stderr[-200:]
    out.append(
        Check(
            "diff: whole-model wrap named",
            "whole-model" in first,
            f"exit {whole.returncode}: {first}",
        )
    )
    grew = _diff(r, ac, a, "--fail-on-memory", "5")  # dropping checkpointing raises the peak
    shrank = _diff(r, a, ac, "--fail-on-memory", "5")
    mem = [ln for ln in grew.stdout.splitlines() if ln.strip().startswith("total")]
    out.append(
        Check(
            "diff: memory gate",
            grew.returncode == 1 and shrank.returncode == 0,
            f"ac->no-ac exit {grew.returncode}, no-ac->ac exit {shrank.returncode}; {mem[:1]}",
        )
    )
    cpu = REPO / "sample_traces" / "none"
    refused = _diff(r, cpu, a)
    out.append(
        Check(
            "diff: CPU vs GPU refused",
            r.device == "cpu" or refused.returncode == 2,
            refused.stderr.strip()[-200:],
        )
    )
    return out


def _job_step_ms(run_dir: Path) -> float | None:
    """The job's measured step: the median over ranks of each rank's median step."""
    report = analyze_paths([run_dir])
    medians = []
    for rank in report.ranks:
        steps = sorted(s.duration_ms for s in rank.steps)
        if steps:
            medians.append(steps[len(steps) // 2])
    return sorted(medians)[len(medians) // 2] if medians else None


def _whatif_ms(r: Runner, run_dir: Path, *change: str) -> tuple[float | None, str]:
    """(the job's predicted step, or None; what went wrong) from `zdiag whatif --json`."""
    proc = r.zdiag(["whatif", str(run_dir), *change, "--json", "--no-cache"])
    if proc.returncode != 0:
        return None, f"whatif exit {proc.returncode}: {proc.stderr.strip()[-200:]}"
    ranks = json.loads(proc.stdout)["ranks"]
    predicted = sorted(x["predicted_ms"] for x in ranks)
    return predicted[len(predicted) // 2], ""


def check_whatif(r: Runner) -> list[Check]:
    """The what-if replay against re-runs on this device: activation checkpointing of every
    block predicted on the healthy run (`--checkpoint layers`) against the run with `--ac
    block`, prefetch depth 1 predicted on a run without prefetch against the run with it, and
    the whole-model wrap split per block (`--wrap layers`) against the per-block run (the last
    two with NCCL only: gloo on a shared GPU blocks in every collective, where the split's
    replay is only a lower bound on the step). Each within 2x of the measured change, or inside
    the two runs' own noise."""
    opts = [*shape(r.device), "--steps", "10"]
    out = []
    base, pb = r.harness("whatif-healthy", opts, "2:1:5", comm=True)
    ac, pa = r.harness("whatif-ac", [*opts, "--ac", "block"], "2:1:5", comm=True)
    pairs = [("checkpointing", base, pb, ac, pa, ("--checkpoint", "layers"))]
    if r.device != "cpu" and not r.shared_gpu:
        off, po = r.harness("whatif-no-prefetch", [*opts, "--prefetch", "off"], "2:1:5")
        pairs.append(("prefetch", off, po, base, pb, ("--prefetch", "1")))
        whole, pw = r.harness("whatif-whole-wrap", [*opts, "--wrap", "whole"], "2:1:5")
        pairs.append(("finer wrap", whole, pw, base, pb, ("--wrap", "layers")))
    else:  # (the harness's prefetch off also drops the async unshard: blocking gathers)
        out.append(Check("whatif prefetch", None, "gloo blocks in every collective here"))
        out.append(Check("whatif finer wrap", None, "blocking gloo: the split is a lower bound"))
    for name, before, p_before, after, p_after, change in pairs:
        if p_before.returncode or p_after.returncode:
            out.append(Check(f"whatif {name}", False, "a harness run failed (see log.txt)"))
            continue
        measured_before, measured_after = _job_step_ms(before), _job_step_ms(after)
        predicted, why = _whatif_ms(r, before, *change)
        if predicted is None or measured_before is None or measured_after is None:
            out.append(Check(f"whatif {name}", False, why or "no steps"))
            continue
        want, got = measured_before - measured_after, measured_before - predicted
        ok = (want * got > 0 and 0.5 <= got / want <= 2.0) or abs(want) < 0.02 * measured_before
        out.append(
            Check(
                f"whatif {name}",
                ok,
                f"{' '.join(change)}: step {measured_before:.1f} ms, predicted {predicted:.1f}, "
                f"re-run with the change {measured_after:.1f} (gain {got:+.1f} predicted, "
                f"{want:+.1f} measured)",
            )
        )
    return out


def check_measured_memory(r: Runner) -> list[Check]:
    """The activation sizes `--profile-memory` measures in the rank, on this device: the memory
    `zdiag whatif --checkpoint layers` predicts on the healthy run against the allocator's peak
    of the run with `--ac block` (within 2x of the measured change), and `--param-dtype bf16`
    on the fp32 run against the `--precision bf16` run (NCCL only: a lower bound, since bf16
    math is faster too, so the measured gain must reach at least half the predicted one)."""
    opts = [*shape(r.device), "--steps", "8"]
    out = []
    base, pb = r.harness("memory-healthy", opts, "2:1:3", memory=True, comm=True)
    ac, pa = r.harness("memory-ac", [*opts, "--ac", "block"], "2:1:3", memory=True, comm=True)
    before, after = _peak_bytes(base), _peak_bytes(ac)
    proc = r.zdiag(["whatif", str(base), "--checkpoint", "layers", "--json", "--no-cache"])
    if r.device == "cpu" and not (pb.returncode or pa.returncode or proc.returncode):
        predicted = json.loads(proc.stdout)["memory_delta_bytes"]
        out.append(
            Check(
                "measured activations",
                None,
                f"predicted {_mib(predicted)}; no allocator peak on CPU to compare with "
                "(bench/plan_checkpoint.py measures the resident memory there)",
            )
        )
    elif pb.returncode or pa.returncode or proc.returncode or before is None or after is None:
        out.append(Check("measured activations", False, "a run or the what-if failed (log.txt)"))
    else:
        predicted = json.loads(proc.stdout)["memory_delta_bytes"]
        want = after - before
        ok = predicted is not None and want < 0 and 0.5 <= predicted / want <= 2.0
        out.append(
            Check(
                "measured activations",
                ok,
                f"--checkpoint layers: peak {_mib(before)}, predicted change "
                f"{_mib(predicted)}, re-run with --ac block {_mib(after)} ({_mib(want)})",
            )
        )
    if r.device == "cpu" or r.shared_gpu:
        out.append(Check("whatif bf16 params", None, "refused on CPU runs; NCCL only"))
        return out
    fp32, p32 = r.harness("bf16-fp32", opts, "2:1:5")
    bf16, p16 = r.harness("bf16-bf16", [*opts, "--precision", "bf16"], "2:1:5")
    m32, m16 = _job_step_ms(fp32), _job_step_ms(bf16)
    predicted_ms, why = _whatif_ms(r, fp32, "--param-dtype", "bf16")
    if p32.returncode or p16.returncode or None in (m32, m16, predicted_ms):
        out.append(Check("whatif bf16 params", False, why or "a harness run failed"))
        return out
    assert m32 is not None and m16 is not None and predicted_ms is not None
    gain_predicted, gain_measured = m32 - predicted_ms, m32 - m16
    out.append(
        Check(
            "whatif bf16 params",
            gain_predicted > 0 and gain_measured >= gain_predicted / 2,
            f"--param-dtype bf16: step {m32:.1f} ms, predicted {predicted_ms:.1f} (a lower "
            f"bound of the gain: {gain_predicted:+.1f}), re-run with --precision bf16 "
            f"{m16:.1f} ({gain_measured:+.1f})",
        )
    )
    return out


def _small_files(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if info.size > MAX_TAR_MEMBER else info


def write_summary(out: Path, checks: list[Check], r: Runner, seconds: float) -> None:
    """summary.md: one table row per check."""
    mark = {True: "pass", False: "FAIL", None: "skip"}
    lines = [
        f"# zdiag GPU checks: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, device "
        f"{r.device}, {r.nproc} process(es), {seconds:.0f} s",
        "",
        "| check | result | figures |",
        "|---|---|---|",
        *(f"| {c.name} | {mark[c.ok]} | {c.detail.replace('|', '/')} |" for c in checks),
    ]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


CHECKS: dict[str, Callable[[Runner], Check | list[Check]]] = {
    "environment": check_environment,
    "healthy": check_healthy,
    "zoo": check_zoo,
    "oom": check_oom,
    "nvtx": check_nvtx,
    "snapshot_sites": check_snapshot_sites,
    "diff": check_diff,
    "whatif": check_whatif,
    "measured-memory": check_measured_memory,
}


def main() -> int:
    """Run every check; exit 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for the results")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--checks",
        default=",".join(CHECKS),
        help=f"comma-separated subset of {', '.join(CHECKS)} (default: all)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    r = Runner(args.out, args.device)
    started = time.perf_counter()
    checks: list[Check] = []
    # summary.md is rewritten after each check, so a run cut short by a lease's limit still
    # brings back what it saw
    wanted = [name.strip() for name in args.checks.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(CHECKS))
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    for check in (CHECKS[name] for name in wanted):
        result = check(r)
        checks.extend(result if isinstance(result, list) else [result])
        write_summary(args.out, checks, r, time.perf_counter() - started)
    r.log.close()
    with tarfile.open(args.out / "gpu_runs.tgz", "w:gz") as tar:
        for run_dir in sorted(p for p in r.runs.iterdir() if (p / "manifest.json").is_file()):
            tar.add(run_dir, arcname=run_dir.name, filter=_small_files)
    shutil.rmtree(r.runs, ignore_errors=True)
    print((args.out / "summary.md").read_text())
    return 1 if any(c.ok is False for c in checks) else 0


if __name__ == "__main__":
    raise SystemExit(main())
