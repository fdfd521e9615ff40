"""Comparing two runs: `diff_reports(a, b)` -> `RunDiff` (the `zdiag diff` command's analysis)."""
