"""`python -m zdiag` is the `zdiag` command."""

import sys

from zdiag.cli import main

sys.exit(main())
