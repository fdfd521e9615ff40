"""The misconfigurations zdiag's harness can inject and its detectors must find: defined once.

Each name is both a harness preset (`zdiag run --harness --misconfig NAME`, `zdiag demo
--misconfig NAME`) and the id of the finding that diagnoses it. The harness's presets, the CLI's
choices, the bench scripts and the tests import these tuples; tests/unit/detectors/test_frameworks.py checks that
no other Python file spells the list again.
"""

from __future__ import annotations

MISCONFIGS: tuple[str, ...] = (
    "whole-model-wrap",
    "tiny-layer-wrap",
    "missing-overlap",
    "activation-oom",
)
"""The injectable misconfigurations, each also the id of the finding that diagnoses it."""

HEALTHY = "none"
"""The scenario with no misconfiguration (the healthy run)."""

SCENARIOS: tuple[str, ...] = (HEALTHY, *MISCONFIGS)
"""Every `--misconfig` choice: the healthy run, then each misconfiguration."""
