"""zdiag's built-in FSDP2 training harness: `python -m zdiag.harness --help`.

A decoder-only transformer on synthetic data, sharded with FSDP2, with knobs that inject the
misconfigurations zdiag diagnoses (see docs/harness.md).
"""

from zdiag.harness.config import HarnessConfig, parse_config

__all__ = ["HarnessConfig", "parse_config"]
