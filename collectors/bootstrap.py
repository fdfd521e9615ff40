"""Run a training script unchanged under zdiag's collectors: one of these per rank.

    python -m zdiag.collectors.bootstrap SCRIPT [ARGS...]
    python -m zdiag.collectors.bootstrap -m MODULE [ARGS...]

`zdiag run` starts it (directly, or as the torchrun worker). It reads the run directory and settings
from the environment (`ZDIAG_RUN_DIR`, `ZDIAG_CONFIG`), starts a `RankSession`, runs the script as
`__main__` with runpy (sys.argv and sys.path[0] as Python would set them), and records how it ended.
Out of memory: the memory data is written first. An uncaught exception is reported as Python
reports it (through `sys.excepthook`, exit code 1) but with the script's own traceback, without
the bootstrap's and runpy's frames above it; `SystemExit` and `KeyboardInterrupt` pass through
unchanged.

A child the script forks (`os.fork()`) and that then returns or raises comes back here too: it
never finishes the parent's session (the session is disarmed in the child) and ends with its
own exit code through `session.exit_forked_child`, as `python SCRIPT` would end it, but without
the C++ static destructors that hang in a forked child once torch's profiler has run.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from .session import RankSession

USAGE = "usage: python -m zdiag.collectors.bootstrap (SCRIPT | -m MODULE) [ARGS...]"


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # sys.exit("message") prints the message and exits 1


def _end_forked_child(exc: BaseException | None) -> NoReturn:
    """A forked child came back from the script: report as Python would, then end it with its
    exit code, never touching the parent's session."""
    from .session import exit_forked_child

    code = 0
    if isinstance(exc, SystemExit):
        code = _exit_code(exc)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)  # sys.exit("message"), as Python prints it
    elif exc is not None:
        try:
            sys.excepthook(type(exc), exc, exc.__traceback__)
        except BaseException:
            traceback.print_exception(exc)
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    exit_forked_child(code)


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

    from .config import config_from_env

    found = config_from_env()
    if found is None:  # not under zdiag run: behave exactly like python SCRIPT
        try:
            run_target(target, args, as_module=as_module)
        except Exception as exc:
            return _report_uncaught(exc)
        return 0

    from .session import RankSession

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
    pid = os.getpid()
    try:
        run_target(target, args, as_module=as_module)
    except BaseException as exc:
        if os.getpid() != pid:
            _end_forked_child(exc)
        _finish_after(session, exc)
        if isinstance(exc, SystemExit | KeyboardInterrupt):
            raise
        return _report_uncaught(exc)
    if os.getpid() != pid:
        _end_forked_child(None)
    session.finish(0)
    return 0


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """`tb` from the first frame that is neither this module nor runpy: the script's own."""
    start = tb
    while start is not None:
        name = start.tb_frame.f_code.co_filename
        if name != __file__ and not name.endswith(("runpy.py", "<frozen runpy>")):
            return start
        start = start.tb_next
    return tb  # the error is in zdiag's own frames: show them all


def _report_uncaught(exc: BaseException) -> int:
    """What Python does with an uncaught exception, with the script's own traceback (not the
    bootstrap's and runpy's frames above it): print it through `sys.excepthook`, exit 1."""
    exc = exc.with_traceback(_user_frames(exc.__traceback__))  # what the printers read
    try:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    except BaseException:
        traceback.print_exception(exc)
    return 1


def _finish_after(session: RankSession, exc: BaseException) -> None:
    """Finish the session for the exception the script ended with (it is re-raised after)."""
    from . import memory

    if isinstance(exc, SystemExit):
        session.finish(_exit_code(exc))
    elif isinstance(exc, KeyboardInterrupt):
        session.finish(130, "KeyboardInterrupt")
    else:
        if memory.is_out_of_memory(exc):
            session.on_out_of_memory(exc)
        session.finish(1, f"{type(exc).__name__}: {str(exc)[:500]}", exc)


if __name__ == "__main__":
    sys.exit(main())
