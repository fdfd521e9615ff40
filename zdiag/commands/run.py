"""`zdiag run`: launch a training script (or the built-in harness) under zdiag's collectors.

    zdiag run [options] train.py [script args]
    zdiag run [options] --harness [harness options]

One plain process by default; with any of `--nproc-per-node --nnodes --node-rank --rdzv-endpoint
--rdzv-id` the ranks are started by torchrun (`python -m torch.distributed.run`). Each rank runs
`python -m zdiag.collectors.bootstrap`, which runs the script unchanged as `__main__`. When the
training ends (however it ends) this launcher merges the ranks' manifest parts into
`RUN_DIR/manifest.json` and exits with the training's exit code. docs/run.md is the user guide,
docs/run-dir.md the run directory contract.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import typing
from pathlib import Path
from types import FrameType
from typing import Any

from zdiag.collectors.config import ENV_CONFIG, ENV_RUN_DIR, FLAG, CollectorConfig, Flag
from zdiag.collectors.fsio import write_json_atomically
from zdiag.collectors.manifest import build_manifest, merge_manifest, read_part, utc_now_iso
from zdiag.collectors.run_records import LauncherPart, Manifest, RankEntry, RankPart
from zdiag.collectors.rundir import (
    MANIFEST,
    PARTS_DIR,
    RANK_PART_GLOB,
    launcher_part_path,
    make_run_dir,
    remove_unfinished_writes,
    step_log_relpath,
)
from zdiag.errors import ConfigError, InputError
from zdiag.live.wire import ENV_JOB, ENV_MONITOR

BOOTSTRAP_MODULE = "zdiag.collectors.bootstrap"
TORCHRUN_MODULE = "zdiag.commands.torchrun_launch"
HARNESS_MODULE = "zdiag.harness"
# A CPU node runs at most this many ranks per core it may use: beyond that gloo collectives
# starve and time out instead of training. (GPU ranks are bound by the script's device choice.)
MAX_RANKS_PER_CPU = 4
FLIGHT_RECORDER_ENTRIES = 2000
"""TORCH_FR_BUFFER_SIZE set for the ranks (unless the user set it): the last 2000 collectives, a
few hundred KB per rank, recorded by torch at the cost of a ring-buffer write per collective."""
MAX_STEP_LOG_BYTES = 64 * 1024 * 1024
"""The most of a step log read to count its lines (100 000 lines of about 200 bytes: 20 MB)."""


def count_step_lines(path: Path) -> int:
    """Complete lines (ending in a newline) in the step log at `path`: 0 when it is absent, not
    a regular file (a link is not followed) or unreadable; read in 1 MiB chunks, at most
    `MAX_STEP_LOG_BYTES`."""
    try:
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        )
    except OSError:
        return 0
    lines = 0
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return 0
        left = MAX_STEP_LOG_BYTES
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            lines += chunk.count(b"\n")
            left -= len(chunk)
    except OSError:
        return lines
    finally:
        os.close(fd)
    return lines


def usable_cpus() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _positive_int(option: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{option} must be a whole number, not {value!r}.") from None
    if n < 1:
        raise ConfigError(f"{option} must be at least 1, not {n}.")
    return n


def _host_port(option: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{option} must be HOST:PORT with a port from 1 to 65535, not {value!r}.")
    return host, int(port)


def add_config_flags(group: argparse._ArgumentGroup) -> None:
    """One option per `CollectorConfig` field that declares a `Flag` (its type and default say
    which kind; see `Flag`), with the field's name as its destination."""
    hints = typing.get_type_hints(CollectorConfig)
    for fld in dataclasses.fields(CollectorConfig):
        flag: Flag | None = fld.metadata.get(FLAG)
        if flag is None:
            continue
        options: dict[str, Any] = {"dest": fld.name, "help": flag.help}
        if flag.parse is not None:
            options.update(default=flag.shown_default, metavar=flag.metavar)
        elif hints[fld.name] is bool and flag.name.startswith("--no-"):
            options.update(action="store_false", default=fld.default)
        elif hints[fld.name] is bool and fld.default:
            options.update(action=argparse.BooleanOptionalAction, default=fld.default)
        elif hints[fld.name] is bool:
            options.update(action="store_true", default=fld.default)
        else:
            options.update(type=_value_type(hints[fld.name]), default=fld.default)
            options.update(metavar=flag.metavar)
        group.add_argument(flag.name, **options)


def _value_type(hint: Any) -> Any:
    """`float` of `float | None`: what a flag's value converts to."""
    return next((t for t in typing.get_args(hint) if t is not type(None)), hint)


class RunCommand:
    """`zdiag run`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of `zdiag run` (everything after the script, or after --harness, is passed on)."""
        parser.usage = "zdiag run [options] SCRIPT [script args]\n       zdiag run [options] --harness [harness options]"
        out = parser.add_argument_group("output")
        out.add_argument(
            "--out",
            type=Path,
            default=None,
            metavar="DIR",
            help="run directory (default: ./zdiag_runs/<timestamp>); must not hold a finished run",
        )
        prof = parser.add_argument_group("profiler")
        add_config_flags(prof)
        prof.add_argument(
            "--monitor",
            metavar="HOST:PORT",
            default=None,
            help="publish live step records (step time, compute/comm split, memory, and an "
            "end-of-run record) to a `zdiag monitor` listening at HOST:PORT",
        )
        dist = parser.add_argument_group("ranks and nodes (passed to torchrun)")
        dist.add_argument(
            "--nproc-per-node",
            metavar="N",
            default=None,
            help="ranks on this node (default: one plain process, no torchrun)",
        )
        dist.add_argument("--nnodes", metavar="N", default=None, help="number of nodes")
        dist.add_argument(
            "--node-rank",
            metavar="K",
            default=None,
            help="this node's rank (0..nnodes-1); selects torchrun's static rendezvous",
        )
        dist.add_argument(
            "--rdzv-endpoint",
            metavar="HOST:PORT",
            default=None,
            help="rendezvous endpoint (node 0)",
        )
        dist.add_argument("--rdzv-id", metavar="ID", default=None, help="rendezvous (job) id")
        parser.add_argument(
            "--harness",
            nargs=argparse.REMAINDER,
            default=None,
            metavar="HARNESS_OPTIONS",
            help="run the built-in FSDP2/ZeRO harness (python -m zdiag.harness) with these options "
            "('zdiag run --harness --help' lists them)",
        )
        parser.add_argument(
            "target",
            nargs=argparse.REMAINDER,
            metavar="SCRIPT [ARGS]",
            help="training script and its arguments",
        )

    def run(self, args: argparse.Namespace) -> int:
        """Validate, launch, wait, merge the manifest; returns the training's exit code."""
        plan = LaunchPlan.from_args(args)
        return plan.execute()


class LaunchPlan:
    """A validated `zdiag run` invocation: what to start, where it writes, and how to merge."""

    def __init__(
        self,
        *,
        target: list[str],
        config: CollectorConfig,
        out: Path,
        monitor: str | None,
        torchrun: list[str] | None,
        nnodes: int,
        node_rank: int,
        expected_world_size: int | None,
        argv: list[str],
    ) -> None:
        self.target = target
        self.config = config
        self.out = out
        self.monitor = monitor
        self.torchrun = torchrun
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.expected_world_size = expected_world_size
        self.argv = argv
        self._child: subprocess.Popen[bytes] | None = None

    # ----------------------------------------------------------------- validation
    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LaunchPlan:
        """Check every option; raise ConfigError/InputError with one sentence on the first problem."""
        target = cls._target(args)
        config = CollectorConfig.from_flags(vars(args))
        if not config.profile and (
            config.record_shapes or config.profile_memory or config.with_stack
        ):
            raise ConfigError(
                "--no-profile turns the profiler off, so --record-shapes, --profile-memory and "
                "--with-stack cannot apply; drop one or the other."
            )
        if args.monitor is not None:
            _host_port("--monitor", args.monitor)
        torchrun, nnodes, node_rank, world = cls._torchrun(args)
        out = cls._out_dir(args.out)
        return cls(
            target=target,
            config=config,
            out=out,
            monitor=args.monitor,
            torchrun=torchrun,
            nnodes=nnodes,
            node_rank=node_rank,
            expected_world_size=world,
            argv=["zdiag", *sys.argv[1:]],
        )

    @staticmethod
    def _target(args: argparse.Namespace) -> list[str]:
        script = list(args.target or [])
        if args.harness is not None:
            if script:
                raise ConfigError(
                    f"give either a training script or --harness, not both (got {script[0]!r} too); "
                    "put harness options after --harness."
                )
            import importlib.util

            if importlib.util.find_spec(HARNESS_MODULE) is None:
                raise InputError(
                    "the built-in harness (zdiag.harness) is not installed in this environment; "
                    "reinstall zdiag or run your own script."
                )
            # Check the harness options here (no torch import), so a typo is one line and no
            # run is started or run directory made; --help prints the harness's options.
            from zdiag.harness.config import build_parser, config_from_args

            harness_parser = build_parser()
            harness_parser.prog = "zdiag run --harness"
            config_from_args(harness_parser.parse_args(args.harness))
            return ["-m", HARNESS_MODULE, *args.harness]
        if not script:
            raise ConfigError(
                "give a training script to run (zdiag run train.py ...) or --harness."
            )
        path = Path(script[0])
        if script[0].startswith("-"):
            raise ConfigError(
                f"unknown option {script[0]!r} before the training script (see 'zdiag run --help')."
            )
        if not path.is_file():
            raise InputError(f"training script {script[0]!r} not found; check the path.")
        return [str(path), *script[1:]]

    @staticmethod
    def _torchrun(args: argparse.Namespace) -> tuple[list[str] | None, int, int, int | None]:
        given = [args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id]
        if all(v is None for v in given):
            return None, 1, 0, 1
        nproc = _positive_int("--nproc-per-node", args.nproc_per_node or "1")
        nnodes = _positive_int("--nnodes", args.nnodes or "1")
        limit = MAX_RANKS_PER_CPU * usable_cpus()
        if nproc > limit:
            raise ConfigError(
                f"--nproc-per-node {nproc} is more ranks than this node can run: at most "
                f"{MAX_RANKS_PER_CPU} per usable CPU core ({limit} here); lower it."
            )
        node_rank = 0
        if args.node_rank is not None:
            try:
                node_rank = int(args.node_rank)
            except ValueError:
                raise ConfigError(
                    f"--node-rank must be a whole number, not {args.node_rank!r}."
                ) from None
            if not 0 <= node_rank < nnodes:
                raise ConfigError(
                    f"--node-rank must be between 0 and {nnodes - 1} (--nnodes {nnodes}), not {node_rank}."
                )
        if args.rdzv_endpoint is not None:
            _host_port("--rdzv-endpoint", args.rdzv_endpoint)
        if nnodes > 1 and args.rdzv_endpoint is None:
            raise ConfigError(
                f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address) so the nodes can meet."
            )
        # torchrun, its failure summary naming the script (commands/torchrun_launch.py)
        cmd = [sys.executable, "-m", TORCHRUN_MODULE, "--nproc-per-node", str(nproc)]
        cmd += ["--nnodes", str(nnodes), "--max-restarts", "0"]
        if args.rdzv_endpoint is None:
            cmd += ["--standalone"]
        elif args.node_rank is not None:
            # Static rendezvous: node ranks as given, node 0 hosts the store at the endpoint.
            cmd += ["--rdzv-backend", "static", "--rdzv-endpoint", args.rdzv_endpoint]
            cmd += ["--node-rank", str(node_rank)]
        else:
            cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint]
        if args.rdzv_id is not None:
            cmd += ["--rdzv-id", str(args.rdzv_id)]
        cmd += ["-m", BOOTSTRAP_MODULE]
        return cmd, nnodes, node_rank, nproc * nnodes

    @staticmethod
    def _out_dir(out: Path | None) -> Path:
        if out is None:
            base = Path("zdiag_runs") / time.strftime("%Y%m%d-%H%M%S")
            out, n = base, 1
            while out.exists():
                n += 1
                out = base.with_name(f"{base.name}-{n}")
        if out.exists() and not out.is_dir():
            raise InputError(f"--out {str(out)!r} is a file, not a folder; choose another path.")
        if (out / MANIFEST).exists():
            raise InputError(
                f"--out {str(out)!r} already holds a finished run; choose a new folder."
            )
        return out.resolve()

    # ----------------------------------------------------------------- launch
    def command(self) -> list[str]:
        """The command line that starts the rank(s)."""
        if self.torchrun is not None:
            return [*self.torchrun, *self.target]
        return [sys.executable, "-m", BOOTSTRAP_MODULE, *self.target]

    def environment(self) -> dict[str, str]:
        """The ranks' environment: ours plus the run directory and settings."""
        env = dict(os.environ)
        env[ENV_RUN_DIR] = str(self.out)
        env[ENV_CONFIG] = self.config.to_json()
        env["ZDIAG_NODE_RANK"] = str(self.node_rank)
        if self.config.hang_timeout_s != 0:
            # torch's flight recorder (NCCL, and gloo since torch 2.7) keeps the last collectives
            # for the hang dump; the user's own setting wins.
            env.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
        if self.monitor:
            env[ENV_MONITOR] = self.monitor
            env.setdefault(ENV_JOB, self.out.name)  # the monitor's header names the run
        else:
            env.pop(ENV_MONITOR, None)
        return env

    def _launcher_part(
        self, started_at: str, exit_code: int | None, error: str | None
    ) -> LauncherPart:
        return LauncherPart(
            node_rank=self.node_rank,
            nnodes=self.nnodes,
            command=tuple(self.argv),
            cwd=os.getcwd(),
            expected_world_size=self.expected_world_size,
            profile=self.config.manifest_profile(),
            started_at=started_at,
            ended_at=utc_now_iso() if exit_code is not None else None,
            exit_code=exit_code,
            error=error,
        )

    def _prepare_out(self, started_at: str) -> None:
        """Create the run directory and write the launcher's first part, before any training;
        InputError (exit 2) when `--out` cannot be written."""
        created = not os.path.lexists(self.out)
        try:
            make_run_dir(self.out)
            write_json_atomically(
                launcher_part_path(self.out, self.node_rank),
                self._launcher_part(started_at, None, None).to_json(),
            )
        except OSError as exc:
            if created:  # nothing half-written: the folders made here go again
                shutil.rmtree(self.out, ignore_errors=True)
            reason = exc.strerror or type(exc).__name__
            raise InputError(
                f"--out {str(self.out)!r} cannot be written ({reason}); choose a folder you can "
                "write to."
            ) from None

    def execute(self) -> int:
        """Start the ranks, wait for them, merge the manifest; the training's exit code.

        Once the training has run, its exit code is what this returns, whatever happens to the
        run directory: a failure to write it (a full disk, a lost permission) is one line on
        stderr.
        """
        started = utc_now_iso()
        self._prepare_out(started)
        # SIGTERM to zdiag run (alone, or with its whole process group, as `timeout` and Slurm
        # send it) is forwarded while the training runs; once it has ended, the run directory is
        # still completed (well under a second), so a terminated run keeps its manifest.
        previous = signal.signal(signal.SIGTERM, self._forward_sigterm)
        try:
            code, error = self._run_child()
            try:
                code = self._training_code(code)
                self._finish_run_dir(started, code, error)
            except Exception as exc:  # the training's outcome is never replaced by zdiag's own
                reason = str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
                print(
                    f"zdiag run: the run directory {self.out} could not be completed ({reason}); "
                    f"the training's exit code {code} is returned.",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            signal.signal(signal.SIGTERM, previous)
        return code

    def _forward_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM handler of the launcher: pass it to the training while it runs."""
        child = self._child
        if child is not None and child.returncode is None:
            try:
                child.send_signal(signum)
            except OSError:  # it ended meanwhile
                pass

    def _training_code(self, code: int) -> int:
        """The training's exit code: under torchrun, which exits 1 for any failed worker, the
        first failing rank's own code from the ranks' manifest parts."""
        if code != 0 and self.torchrun is not None:
            for rank in build_manifest(self.out).ranks:
                if rank.exit_code not in (None, 0):
                    return int(rank.exit_code)
        return code

    def _finish_run_dir(self, started: str, code: int, error: str | None) -> None:
        """Write the launcher's final part and the merged manifest, and print the summary."""
        removed = remove_unfinished_writes(self.out)
        if removed:
            print(
                f"zdiag run: removed {removed} unfinished file(s) of rank(s) killed while writing "
                "(SIGKILL before the rename); what they had finished writing is kept.",
                file=sys.stderr,
                flush=True,
            )
        unfinished = self._complete_unfinished_parts()
        part = launcher_part_path(self.out, self.node_rank)
        write_json_atomically(part, self._launcher_part(started, code, error).to_json())
        self._summary(merge_manifest(self.out), code, unfinished)

    def _complete_unfinished_parts(self) -> int:
        """Ranks of this node that did not finish (`os._exit`, SIGKILL, an interpreter crash, or
        a signal or hang after which they ran on) left a part written earlier: its `steps` (and
        `step_log`, null before the first write) are brought up to the step log, whose lines reach
        the file step by step. Returns how many ended with no zdiag write at all (no end, no
        signal flush, no hang dump)."""
        silent = 0
        for path in sorted((self.out / PARTS_DIR).glob(RANK_PART_GLOB)):
            part = read_part(path, RankPart)
            if part is None:
                continue
            entry = part.entry
            if entry.ended_at is not None or entry.node_rank not in (None, self.node_rank):
                continue
            if entry.ended_by is None and entry.hang is None:
                silent += 1
            rel = step_log_relpath(entry.rank)
            lines = count_step_lines(self.out / rel)
            if lines > entry.steps or (lines and entry.step_log is None):
                entry = dataclasses.replace(entry, steps=max(lines, entry.steps), step_log=rel)
                write_json_atomically(path, dataclasses.replace(part, entry=entry).to_json())
        return silent

    def _run_child(self) -> tuple[int, str | None]:
        try:
            child = self._child = subprocess.Popen(self.command(), env=self.environment())
        except OSError as exc:
            return 127, f"could not start {self.command()[0]}: {exc}"
        while True:
            try:
                rc = child.wait()
                break
            except KeyboardInterrupt:  # the child got the same SIGINT; let it end cleanly
                continue
        if rc < 0:
            return 128 - rc, f"training ended by signal {-rc}"
        return rc, None if rc == 0 else f"training exited with code {rc}"

    def _summary(self, manifest: Manifest, code: int, unfinished: int = 0) -> None:
        ranks = manifest.ranks
        traces = sum(1 for r in ranks if r.trace)
        notes = []
        if manifest.exit.oom:
            notes.append("out of memory (memory data written)")
        if unfinished:
            notes.append(
                f"{unfinished} rank(s) ended without zdiag's end-of-run writes (os._exit, SIGKILL, "
                "or a crash of the interpreter): their steps are counted from their step logs, "
                "and a profiler window still open then is lost"
            )
        raised = _culprits(manifest)
        if raised:
            first = raised[0]
            error = (first.error or "").splitlines()[0][:160]
            notes.append(
                f"rank {first.rank} raised {error}"
                + (f" (and {len(raised) - 1} more rank(s))" if len(raised) > 1 else "")
                + f"; 'zdiag analyze {self.out}' says where and which ranks it tore down"
            )
        if self.config.profile and traces < len(ranks) and not manifest.exit.oom:
            steps = min(r.steps for r in ranks) if ranks else 0
            notes.append(
                f"{len(ranks) - traces} rank(s) without a trace: {steps} step(s) detected, and the "
                f"profiler records steps {self.config.wait + self.config.warmup} to "
                f"{self.config.wait + self.config.warmup + self.config.active - 1} "
                f"(--profile-steps {self.config.wait}:{self.config.warmup}:{self.config.active})"
            )
        extra = f"; {'; '.join(notes)}" if notes else ""
        print(
            f"zdiag run: {self.out} ({len(ranks)} rank(s), {traces} trace(s), exit code {code}){extra}",
            file=sys.stderr,
            flush=True,
        )


def _culprits(manifest: Manifest) -> list[RankEntry]:
    """The ranks that raised (not the ones torn down by it), as the `crash` finding names
    them; the analysis is imported only when some rank recorded an error."""
    if not any(r.raised for r in manifest.ranks):
        return []
    from zdiag.analyzers.detectors.crash import culprit_ranks

    return culprit_ranks(list(manifest.ranks))


COMMAND = RunCommand()
