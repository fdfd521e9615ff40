"""Helpers for tests that read a rendered HTML page."""

from __future__ import annotations


def without_plotlyjs(page: str) -> str:
    """The page minus the inlined plotly.js bundle and its loader (the last two script blocks)."""
    start = page.find('<script id="zdiag-plotly-gz"')
    if start < 0:
        return page
    end = page.find("</script>", page.find("<script>", start))
    return page[:start] + page[end + len("</script>") :]
