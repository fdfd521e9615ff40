"""`python -m zdiag.harness [options]`: the built-in FSDP2 harness as a plain training script."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from zdiag.errors import UserError


def main(argv: Sequence[str] | None = None) -> int:
    """Parse options and train; a bad option prints one line and returns 2."""
    from zdiag.harness.config import parse_config

    prog = "python -m zdiag.harness"
    try:
        cfg = parse_config(argv)
        from zdiag.harness.train import train

        return train(cfg)
    except UserError as exc:
        print(f"{prog}: error: {exc.message}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
