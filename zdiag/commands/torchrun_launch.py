"""torchrun, started by `zdiag run`, whose failure summary names the user's script.

torchrun titles its summary of failed workers with the program it started: under `zdiag run`
that is `zdiag.collectors.bootstrap` (each rank's wrapper), not the script the user ran. This
module runs torchrun's own `main` with that one name changed to the script (or `-m` module) the
bootstrap runs, and prints only that summary when workers failed (not torchrun's own traceback
through the launcher, below the workers' tracebacks); everything else is torchrun's. The name comes from a private torch function
(`torch.distributed.launcher.api._get_entrypoint_name`): a torch without it keeps torchrun's
title.

    python -m zdiag.commands.torchrun_launch [torchrun options] -m zdiag.collectors.bootstrap SCRIPT ...
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

BOOTSTRAP_MODULE = "zdiag.collectors.bootstrap"


def target_name(args: Sequence[Any]) -> str | None:
    """The script (or module) the bootstrap runs, from a worker's arguments; None when the
    arguments do not start the bootstrap."""
    items = [str(a) for a in args]
    if BOOTSTRAP_MODULE not in items:
        return None
    rest = items[items.index(BOOTSTRAP_MODULE) + 1 :]
    if rest[:1] == ["-m"]:
        rest = rest[1:]
    return rest[0] if rest else None


def _named(original: Callable[[Any, list[Any]], str]) -> Callable[[Any, list[Any]], str]:
    def entrypoint_name(entrypoint: Any, args: list[Any]) -> str:
        return target_name(args) or original(entrypoint, args)

    return entrypoint_name


def main() -> None:
    """torchrun's main, its failure summary titled with the user's script."""
    try:
        from torch.distributed.launcher import api

        api._get_entrypoint_name = _named(api._get_entrypoint_name)  # type: ignore[assignment]
    except (ImportError, AttributeError):
        pass
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main()
    except ChildFailedError as exc:  # the workers' own tracebacks are above: the summary only
        print(exc, file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
