"""Analysis of profiler traces and run directories; produces a `Report`.

Never imports torch (so `zdiag analyze` works on a laptop), never prints or draws; every
`import hta` lives in `hta_adapter.py`. `tests/unit/architecture/test_boundaries.py` enforces both.
"""
