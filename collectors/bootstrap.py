"""Run a training script unchanged under zdiag's collectors: one of these per rank.

    python -m zdiag.collectors.bootstrap SCRIPT [ARGS...]
    python -m zdiag.collectors.bootstrap -m MODULE [ARGS...]

`zdiag run` starts it (directly, or as the torchrun worker). It reads the run directory and settings
from the environment (`ZDIAG_RUN_DIR`, `ZDIAG_CONFIG`), starts a `RankSession`, runs the script as
`__main__` with runpy (sys.argv and sys.path[0] as Python would set them), and records how it ended.
Out of memory: the memory data is written first, then the error propagates. Every exception and
exit code of the script passes through unchanged.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

USAGE = "usage: python -m zdiag.collectors.bootstrap (SCRIPT | -m MODULE) [ARGS...]"


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # sys.exit("message") prints the message and exits 1


def run_target(target: str, args: Sequence[str], *, as_module: bool) -> None:
    """Run a script path or module as `__main__` with `args` as its command line."""
    if as_module:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run the target under a session when ZDIAG_RUN_DIR is set, else run it bare."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    target, args = argv[0], argv[1:]

    from zdiag.collectors.config import config_from_env

    found = config_from_env()
    if found is None:  # not under zdiag run: behave exactly like python SCRIPT
        run_target(target, args, as_module=as_module)
        return 0

    from zdiag.collectors import memory
    from zdiag.collectors.session import RankSession

    run_dir, config = found
    command = [sys.executable, *(["-m"] if as_module else []), target, *args]
    try:
        session = RankSession(run_dir, config, auto_step=True, command=command).start()
    except Exception as exc:  # never stop the training because a collector could not start
        print(
            f"zdiag: collectors could not start ({type(exc).__name__}: {exc}); "
            "running the script without them.",
            file=sys.stderr,
            flush=True,
        )
        run_target(target, args, as_module=as_module)
        return 0
    try:
        run_target(target, args, as_module=as_module)
    except SystemExit as exc:
        session.finish(_exit_code(exc))
        raise
    except KeyboardInterrupt:
        session.finish(130, "KeyboardInterrupt")
        raise
    except BaseException as exc:
        if memory.is_out_of_memory(exc):
            session.on_out_of_memory(exc)
        session.finish(1, f"{type(exc).__name__}: {str(exc)[:500]}", exc)
        raise
    session.finish(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
