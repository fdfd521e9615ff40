"""Headless Chromium for the HTML report's tests: the DOM of a page after its scripts ran."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def dump_dom(page: Path, profile: Path) -> str:
    """The page's DOM after its scripts ran, from headless Chromium."""
    if CHROMIUM is None:
        pytest.skip("headless Chromium not found (apt-get install -y chromium)")
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=4000",
        "--dump-dom",
        page.resolve().as_uri(),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
