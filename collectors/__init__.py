"""Collectors run inside training ranks.

They import only the standard library, torch and pyzmq (the live stream's transport), never
pandas, textual or plotly; `tests/unit/architecture/test_boundaries.py` enforces it. Nothing here may slow, block
or crash training: off costs nothing, errors are contained and reported once, output is bounded.
"""
