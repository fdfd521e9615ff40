"""The long fuzz run of issue 14: the fuzz suite's generators for minutes instead of seconds.

Each case runs `zdiag analyze` (through `zdiag.cli.main`) or the live decoder and monitor state in
a forked child, so that its peak memory (the child's `ru_maxrss`) and wall time are measured one
by one, and a case that hangs is killed (at `KILL_AFTER_S`). The child shares this process's
pages (modules imported, inputs prepared) without counting them; the 2 GB check adds this
process's RSS to the child's peak, a conservative bound. A case fails when it exits with anything
but 0, 1 or 2, prints a traceback, takes over 30 s or over 2 GB.

    PYTHONPATH=. .venv/bin/python bench/fuzz_long.py --minutes 4 [--write-docs]

prints the markdown section (cases, a histogram of exit codes, max RSS, max time per family, and
every failing case with its family and seed to reproduce it) and, with `--write-docs`, puts it
into docs/benchmarks.md (replacing an earlier one).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # fuzz_inputs, and support/ for the dumps

import fuzz_inputs as fz  # noqa: E402

KILL_AFTER_S = 60.0
LIMIT_S = 30.0
LIMIT_RSS = 2 << 30
CHILD_EXTRA_ADDRESS_SPACE = 4 << 30  # a runaway case fails (MemoryError) before the machine
SECTION = "## Fuzzing: the long run (issue 14)"
KNOWN_SLOW = (
    "Known slow shape (not a failure at this size): the flight-recorder family includes a 29 KB "
    "dump whose one entry, with a 500-frame stack, is referenced 5000 times; "
    "`flight_dumps.read_dump` builds every reference (2.5M frames): 5 s alone, up to 22 s on "
    "the loaded machine, ~320 MiB. The cost is linear in references, so a larger dump of that "
    "shape passes 30 s; that reader should visit each shared entry once, as `memory_snapshot` "
    "does."
)


@dataclass
class Family:
    """One kind of case: `make(rng, workdir)` prepares it and returns the argv to run (or None
    for the live-record cases, which run `live_case` instead)."""

    name: str
    make: Callable[[random.Random, Path], list[str] | None]


def _trace_case(data_of: Callable[[random.Random], bytes]) -> Callable[..., list[str]]:
    def make(rng: random.Random, work: Path) -> list[str]:
        data = data_of(rng)
        name = "rank-0.json.gz" if data[:2] == b"\x1f\x8b" else "rank-0.json"
        path = work / name
        path.write_bytes(data)
        return ["analyze", "-q", str(path)]

    return make


_BOMBS: dict[int, bytes] = {}


def _make_bomb(mib: int) -> bytes:
    """A gzip file of a trace header around `mib` MiB of spaces (~1000x compression)."""
    import zlib

    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [c.compress(b'{"traceEvents": [')]
    block = b" " * (1 << 20)
    parts += [c.compress(block) for _ in range(mib)]
    parts += [c.compress(b"]}"), c.flush()]
    return b"".join(parts)


def _gzip_bomb(rng: random.Random) -> bytes:
    """One of the bombs made before forking: below and above the 256 MiB ratio floor."""
    return _BOMBS[rng.choice(sorted(_BOMBS))]


_BASE_RUN: Path | None = None


def _run_dir_case(target: str) -> Callable[..., list[str]]:
    def make(rng: random.Random, work: Path) -> list[str]:
        assert _BASE_RUN is not None
        run = work / "run"
        shutil.copytree(_BASE_RUN, run)
        fz.mutate_run_dir(rng, run, target)
        return ["analyze", "-q", str(run)]

    return make


_BASE_DUMPS: Path | None = None


def _dump_case(rng: random.Random, work: Path) -> list[str]:
    """One rank's dump of a hung 4-rank job damaged (shared references 5000 x 500 deep)."""
    assert _BASE_DUMPS is not None
    dumps = work / "dumps"
    shutil.copytree(_BASE_DUMPS, dumps)
    fz.mutate_dump(rng, dumps / f"nccl_trace_rank_{rng.randrange(4)}", shared=(5000, 500))
    return ["analyze", "-q", str(dumps)]


def _flips(rng: random.Random) -> bytes:
    import gzip

    data = fz.flip_bytes(rng, fz.trace_bytes(fz.base_trace(rng.randrange(2))), rng.randint(1, 6))
    return gzip.compress(data, 1) if rng.random() < 0.3 else data


FAMILIES = (
    Family(
        "trace: field mutations",
        _trace_case(
            lambda rng: fz.trace_bytes(
                fz.mutate_trace_fields(rng, fz.base_trace(rng.randrange(2)), rng.randint(1, 5))
            )
        ),
    ),
    Family("trace: byte flips", _trace_case(_flips)),
    Family("trace: structured malformed", _trace_case(fz.structured_trace)),
    Family("trace: junk bytes", _trace_case(fz.raw_junk)),
    Family("trace: gzip bombs", _trace_case(_gzip_bomb)),
    *(Family(f"run dir: {t}", _run_dir_case(t)) for t in fz.RUN_DIR_TARGETS),
    Family("flight-recorder dumps", lambda rng, work: _dump_case(rng, work)),
    Family("live records", lambda rng, work: None),
)


def live_case(rng: random.Random) -> int:
    """Decode 50 mutated payloads, fold the valid ones into a monitor state and render it."""
    import json as json_

    from zdiag.live.state import MonitorState
    from zdiag.live.wire import SCHEMA_FRAME, WireError, decode
    from zdiag.tui.monitor_text import render_summary, view_to_json

    records = []
    for _ in range(50):
        rec = {"kind": "step", "rank": rng.randrange(8), "step": rng.randrange(100), "ts": 1e9}
        for _ in range(rng.randint(1, 4)):
            rec[rng.choice(("rank", "step", "ts", "step_time_ms", "host", "junk", "kind"))] = (
                fz.hostile(rng)
            )
        payload = fz.dumps(rec)
        if rng.random() < 0.3:
            payload = fz.flip_bytes(rng, payload, rng.randint(1, 3))
        try:
            records.append(dict(decode([SCHEMA_FRAME, b"", payload]), recv_ts=1e9))
        except WireError:
            pass
    state = MonitorState()
    state.ingest(records, 1e9)
    render_summary(state.view(1e9))
    json_.dumps(view_to_json(state.view(1e9)), allow_nan=False)
    return 0


@dataclass
class Outcome:
    rc: int
    seconds: float
    max_rss: int
    stderr: str


def run_forked(family: Family, seed: int, work: Path) -> Outcome:
    """The case in a forked child: exit code, wall time, peak RSS, stderr."""
    err_path = work / "stderr.txt"
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child
        rc = 70
        try:
            with open("/proc/self/statm") as f:
                vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            limit = vm + CHILD_EXTRA_ADDRESS_SPACE
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
            rng = random.Random(seed)
            argv = family.make(rng, work)
            if argv is None:
                rc, stderr = live_case(rng), ""
            else:
                rc, stderr, _ = fz.run_zdiag(argv)
            err_path.write_text(stderr)
        except BaseException as exc:  # the harness's own failure counts as the case's
            err_path.write_text(f"Traceback (harness): {type(exc).__name__}: {exc}")
        finally:
            os._exit(rc)
    deadline = start + KILL_AFTER_S
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            break
        time.sleep(0.005)
    seconds = time.monotonic() - start
    rc = os.waitstatus_to_exitcode(status)
    stderr = err_path.read_text() if err_path.exists() else ""
    return Outcome(rc, seconds, usage.ru_maxrss * 1024, stderr)


@dataclass
class Stats:
    cases: int = 0
    exit_codes: collections.Counter[int] = field(default_factory=collections.Counter)
    max_rss: int = 0
    max_seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


def main() -> int:
    """Run the families round-robin for --minutes; print (and optionally write) the section."""
    global _BASE_RUN, _BASE_DUMPS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=14, help="first seed (cases use seed + i)")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    top = Path(tempfile.mkdtemp(prefix="zdiag-fuzz-long-"))
    _BASE_RUN = fz.make_run_dir(top / "base-run")
    _BASE_DUMPS = fz.make_dump_dir(top / "base-dumps")
    fz.base_trace(0), fz.base_trace(1)  # cached before forking
    for mib in (64, 300, 1200):
        _BOMBS[mib] = _make_bomb(mib)
    fz.run_zdiag(["analyze", "-q", str(_BASE_RUN)])  # imports everything before forking
    with open("/proc/self/statm") as f:
        parent_rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    stats = {f.name: Stats() for f in FAMILIES}
    end = time.monotonic() + args.minutes * 60
    i = 0
    try:
        while time.monotonic() < end:
            family = FAMILIES[i % len(FAMILIES)]
            seed = args.seed + i
            work = top / f"case-{i}"
            work.mkdir()
            out = run_forked(family, seed, work)
            shutil.rmtree(work, ignore_errors=True)
            s = stats[family.name]
            s.cases += 1
            s.exit_codes[out.rc] += 1
            s.max_rss = max(s.max_rss, out.max_rss)
            s.max_seconds = max(s.max_seconds, out.seconds)
            problem = fz.verdict(out.rc, out.stderr)
            if problem is None and out.seconds > LIMIT_S:
                problem = f"took {out.seconds:.1f} s"
            if problem is None and out.max_rss + parent_rss > LIMIT_RSS:
                problem = f"peak RSS {(out.max_rss + parent_rss) / 2**30:.2f} GB"
            if problem is not None:
                s.failures.append(f"seed {seed}: {problem}")
            i += 1
    finally:
        shutil.rmtree(top, ignore_errors=True)
    section = render(stats, args.minutes, args.seed, parent_rss)
    print(section)
    if args.write_docs:
        write_section(ROOT / "docs" / "benchmarks.md", section)
    print(json.dumps({n: s.failures for n, s in stats.items() if s.failures}), file=sys.stderr)
    return 1 if any(s.failures for s in stats.values()) else 0


def render(stats: dict[str, Stats], minutes: float, seed: int, parent_rss: int) -> str:
    """The docs/benchmarks.md section."""
    total = Stats()
    for s in stats.values():
        total.cases += s.cases
        total.exit_codes.update(s.exit_codes)
        total.max_rss = max(total.max_rss, s.max_rss)
        total.max_seconds = max(total.max_seconds, s.max_seconds)
        total.failures += s.failures
    codes = sorted(total.exit_codes)
    lines = [
        SECTION,
        "",
        f"`bench/fuzz_long.py --minutes {minutes:g}` (seeds from {seed}; Python "
        f"{platform.python_version()}, {os.cpu_count()} cores shared with other jobs): each case "
        "in a forked child, through `zdiag.cli.main` (the live-record cases through the decoder, "
        "the monitor state and both renderers). Max RSS is the child's own peak; it also shares "
        f"the {parent_rss / 2**20:.0f} MiB of the parent (imports, prepared inputs), which the "
        "2 GB check adds. A failure is an exit other than 0/1/2, a traceback, over 30 s or "
        "over 2 GB.",
        "",
        "| family | cases | " + " | ".join(f"exit {c}" for c in codes) + " | max RSS | max time |",
        "|---|---:|" + "---:|" * len(codes) + "---:|---:|",
    ]
    for name, s in [*stats.items(), ("**all**", total)]:
        cells = " | ".join(str(s.exit_codes.get(c, 0)) for c in codes)
        lines.append(
            f"| {name} | {s.cases} | {cells} | {s.max_rss / 2**20:.0f} MiB | "
            f"{s.max_seconds:.2f} s |"
        )
    lines.append("")
    lines.append(KNOWN_SLOW)
    lines.append("")
    if total.failures:
        lines.append(f"**{len(total.failures)} failing cases** (family, seed, problem):")
        for name, s in stats.items():
            lines += [f"- {name}, {f}" for f in s.failures[:20]]
    else:
        lines.append(
            f"No failing case: no exit 70, no traceback, no case over 30 s or 2 GB in "
            f"{total.cases} cases."
        )
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    """Put `section` into the markdown file, replacing an earlier copy (up to the next `## `)."""
    text = path.read_text()
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + ("" if nxt < 0 else text[nxt:])
    path.write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
